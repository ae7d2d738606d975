"""Spans of a response kept out of the loss: `--mask-think` trains only what follows the reasoning.

A reasoning model writes `<think>…</think>` and then its answer. With --mask-think the thinking tokens
get loss_mask 0: they still condition the answer (they stay in the sequence), the reward still reads the
whole text, but no gradient and no KL term is taken on them — the policy is trained on the answer given
its own reasoning (S0 §4.5's think mask, on the RL path). Start at `mask_think(samples, tokenizer)`.

Key choice: spans are found in the decoded text and mapped back to tokens by decoding prefixes
(`token_at`: a bisection, O(R log R) per span) — a tag may be one special token (Qwen3) or several BPE
pieces merged with its neighbours, and only the text says where it is. A token that straddles a span's
edge is masked. Only the response's tags count: a template that opens `<think>` in the prompt leaves a
response that starts inside the span (masked up to its `</think>`); an unclosed `<think>` (truncated)
masks to the end.
"""
from __future__ import annotations

import re

OPEN, CLOSE = "<think>", "</think>"
_BLOCK = re.compile(re.escape(OPEN) + ".*?(?:" + re.escape(CLOSE) + "|$)", re.S)


def think_spans(text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of the thinking in a response: every <think>…</think> block
    (an unclosed one runs to the end), and text before a first </think> with no <think> before it."""
    spans = []
    first_close, first_open = text.find(CLOSE), text.find(OPEN)
    if first_close >= 0 and (first_open < 0 or first_close < first_open):  # opened in the prompt
        spans.append((0, first_close + len(CLOSE)))
    start = spans[0][1] if spans else 0
    spans += [(m.start(), m.end()) for m in _BLOCK.finditer(text, start)]
    return spans


def token_at(tokenizer, ids: list[int], char: int) -> int:
    """The index of the token of `ids` whose decoded text holds character `char` of decode(ids): the
    last k with len(decode(ids[:k])) <= char. (A prefix that ends inside a multi-byte character decodes
    to a replacement character; lengths stay ordered around the ASCII tags this is used for.)"""
    lo, hi = 0, len(ids)  # invariant: len(decode(ids[:lo])) <= char < len(decode(ids[:hi]))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid])) <= char:
            lo = mid
        else:
            hi = mid
    return lo


def mask_think(samples: list, tokenizer) -> float:
    """Zero each sample's loss_mask on its thinking tokens (in place, on top of the mask it has:
    environment tokens stay 0). Returns the share of response tokens masked here (logged as
    rollout/think_masked_frac)."""
    masked = total = 0
    for s in samples:
        ids, total = s.response_ids, total + s.response_length
        spans = think_spans(tokenizer.decode(ids)) if ids else []
        if not spans:
            continue
        mask = list(s.loss_mask) if s.loss_mask is not None else [1] * len(ids)
        for start, end in spans:
            first, last = token_at(tokenizer, ids, start), token_at(tokenizer, ids, end - 1)
            masked += sum(mask[first:last + 1])
            mask[first:last + 1] = [0] * (last + 1 - first)
        s.loss_mask = mask
    return masked / max(total, 1)
