"""DAPO's data-side pieces: dynamic sampling that refills the batch, overlong filtering, soft overlong
punishment (Yu et al. 2025, arXiv:2503.14476, as verl's DAPO recipe and reward manager run them).

Between links 2 and 3 of the chain (after the reward): filter and refill the groups, reshape the reward,
mask truncated responses. `dynamic_sampling` keeps drawing rounds of fresh prompts until the step holds
`target` groups with reward variance (a group of equal rewards has advantage 0 and teaches nothing);
`truncated_loss_mask` takes truncated responses out of the loss (their reward still counts in the
group's baseline); `overlong_penalty` adds a linear length penalty inside a buffer before max_new_tokens.
Start at `dynamic_sampling`. Key choices: when the rounds run out nanorl trains on the groups it found
(verl raises), and filtering reads the reward before the overlong penalty. The `dapo` preset turns all
three on with clip-higher (0.2/0.28) and token-mean, as the paper's Table 1 stacks them. Details and the
comparison with verl: docs/from-slime-verl.md, "nanorl/dapo.py".

Test: python -m pytest tests/test_dapo.py -q
"""
from __future__ import annotations

from typing import Callable

import torch


def has_signal(rewards: list[float]) -> bool:
    """A group teaches something only if its rewards differ."""
    return len(set(rewards)) > 1


def dynamic_sampling(draw: Callable[[bool], list], target: int, max_rounds: int,
                     any_short: Callable[[bool], bool] = lambda short: short):
    """Collect `target` groups with reward variance from up to `max_rounds` generation rounds.

    draw(generate) → the round's scored samples (a group's samples share a group_id); with
    generate=False it only advances the prompt stream and returns [] (a rank that is full while
    another is short, so every rank's data order stays the same). any_short(short) → whether any
    rank is still short (an all-reduce with several ranks). The kept samples get group ids 0..n−1 in
    the order found. Returns (samples, rounds, generated_groups, gave_up)."""
    kept, found, rounds, generated = [], 0, 0, 0
    while rounds < max_rounds and any_short(found < target):
        batch = draw(found < target)
        rounds += 1
        groups: dict[int, list] = {}
        for s in batch:
            groups.setdefault(s.group_id, []).append(s)
        generated += len(groups)
        for members in groups.values():
            if found < target and has_signal([s.total_reward for s in members]):
                for s in members:
                    s.group_id = found
                kept += members
                found += 1
    return kept, rounds, generated, found < target


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment per response [B]: 0 up to max_len − buffer tokens, then linear
    down to −factor at max_len (lengths beyond max_len keep falling, as verl's formula)."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}")
    exceed = lengths.float() - (max_len - buffer)                                    # [B]
    return (-exceed / buffer * factor).clamp(max=0.0)


def buffer_tokens(share: float, max_new_tokens: int) -> int:
    """The buffer L_cache in tokens from its share of max_new_tokens (at least one token)."""
    return max(1, min(max_new_tokens, round(share * max_new_tokens)))


def truncated_loss_mask(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: the loss mask [B, T] with every truncated row zeroed (truncated: [B] bool)."""
    if truncated.shape != mask.shape[:1]:
        raise ValueError(f"truncated must be [B={mask.shape[0]}], got {tuple(truncated.shape)}")
    return mask * (~truncated.bool()).to(mask.dtype)[:, None]


def apply_overlong_penalty(samples: list, max_new_tokens: int, share: float, factor: float) -> float:
    """Add the soft overlong punishment to every sample's reward (a dict reward gets an "overlong"
    component); returns the mean penalty."""
    if not samples:
        return 0.0
    lengths = torch.tensor([s.response_length for s in samples])
    pen = overlong_penalty(lengths, max_new_tokens, buffer_tokens(share, max_new_tokens), factor).tolist()
    for s, p in zip(samples, pen):
        s.reward = {**s.reward, "overlong": p} if isinstance(s.reward, dict) else float(s.reward or 0.0) + p
    return sum(pen) / len(pen)
