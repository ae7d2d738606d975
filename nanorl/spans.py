"""Spans of a response's text mapped to its tokens: what a reward or a flag says about part of a response.

`--mask-think`: a reasoning model writes `<think>…</think>` and then its answer; the thinking tokens get
loss_mask 0: they still condition the answer (they stay in the sequence), the reward still reads the
whole text, but no gradient and no KL term is taken on them (S0 §4.5's think mask, on the RL path).
`SpanReward`: a single-turn reward function may credit spans of the response (S0 §5.2's token- and
step-level rewards: each span's value lands on its last token, where GAE, REINFORCE++ and ReMax read it)
and mask spans out of the loss (train only the final answer). Start at `mask_think` and `SpanReward`.

Key choice: spans are found in the decoded text and mapped back to tokens by decoding prefixes
(`token_at`: a bisection, O(R log R) per span) — a tag may be one special token (Qwen3) or several BPE
pieces merged with its neighbours, and only the text says where it is. A token that straddles a span's
edge belongs to it. Only the response's tags count: a template that opens `<think>` in the prompt leaves
a response that starts inside the span (masked up to its `</think>`); an unclosed `<think>` masks to the end.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

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


def token_at(tokenizer, ids: list[int], char: int, skip_special_tokens: bool = False) -> int:
    """The index of the token of `ids` whose decoded text holds character `char` of decode(ids): the
    last k with len(decode(ids[:k])) <= char. (A prefix that ends inside a multi-byte character decodes
    to a replacement character; lengths stay ordered around the ASCII tags this is used for.)
    skip_special_tokens: the text is decoded as the reward function read it (rewards.score_samples)."""
    def decode(prefix: list[int]) -> str:
        if skip_special_tokens:
            return tokenizer.decode(prefix, skip_special_tokens=True)
        return tokenizer.decode(prefix)
    lo, hi = 0, len(ids)  # invariant: len(decode(ids[:lo])) <= char < len(decode(ids[:hi]))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) <= char:
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


# ----------------------------------------------------------------------------- a reward's spans


@dataclass(frozen=True)
class SpanReward:
    """What a reward function may return instead of a number or a dict:

        return SpanReward(reward=1.0, credit=[(0, 42, 0.2)], masked=[(0, 42)])

    reward: the outcome, a number or named components, as a plain return (credited at the last token).
    credit: (start, end, value) spans of the response text (character offsets, end exclusive, as the
        function read it): each value is a component "spans" of the reward, credited at the span's last
        trained token — per token for the estimators that read token rewards (GAE, REINFORCE++, ReMax:
        advantage_inputs), in the sample's total for the outcome ones (GRPO, RLOO, ...).
    masked: (start, end) spans kept out of the loss (loss_mask 0), e.g. all but the final answer."""
    reward: float | dict
    credit: tuple = ()
    masked: tuple = ()


def place(value: SpanReward, sample, tokenizer) -> float | dict:
    """The sample's reward from a SpanReward (its outcome, plus the component "spans" = Σ credit);
    the credits' token ranges go to sample.span_credits and the masked spans zero its loss_mask."""
    ids = sample.response_ids
    if not ids:
        return value.reward

    def tok(char: int) -> int:
        return token_at(tokenizer, ids, max(char, 0), skip_special_tokens=True)
    credits = [((tok(a), tok(max(a, b - 1)) + 1), float(v)) for a, b, v in value.credit]
    sample.span_credits = credits or None
    if value.masked:
        mask = list(sample.loss_mask) if sample.loss_mask is not None else [1] * len(ids)
        for a, b in value.masked:
            first, last = tok(a), tok(max(a, b - 1))
            mask[first:last + 1] = [0] * (last + 1 - first)
        sample.loss_mask = mask
    if not credits:
        return value.reward
    outcome = dict(value.reward) if isinstance(value.reward, dict) else {"correct": float(value.reward)}
    return {**outcome, "spans": sum(v for _, v in credits)}


def span_reward_tensor(samples: list, T: int):
    """[B, T] rewards per token when a reward credited spans (`SpanReward`), else None: each span's
    value (times the "spans" weight, --reward-weights) on the last trained token inside it (else the
    last trained token), and the rest of the sample's total on its last trained token — so each row
    sums to Sample.total_reward, as the outcome estimators read it (nanorl/env.py turn_reward_tensor
    places an episode's turn rewards the same way)."""
    if not any(s.span_credits for s in samples):
        return None
    out = torch.zeros(len(samples), T)  # [B, T]
    for b, s in enumerate(samples):
        mask = s.loss_mask or [1] * s.response_length
        valid = [t for t, m in enumerate(mask) if m]
        if not valid:
            continue
        w = (s.reward_weights or {}).get("spans", 1.0)
        placed = 0.0
        for (start, end), v in s.span_credits or []:
            inside = [t for t in valid if start <= t < end]
            out[b, (inside or valid)[-1]] += w * v
            placed += w * v
        out[b, valid[-1]] += s.total_reward - placed
    return out
