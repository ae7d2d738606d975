"""DAPO's data-side pieces: dynamic sampling that refills the batch, overlong filtering, soft overlong punishment.

    rollout → reward → **(DAPO: filter and refill the groups, reshape the reward, mask truncated)** →
    logprob recompute → advantage → loss → backward → optimizer step → weight sync

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv:2503.14476),
as verl's DAPO recipe and reward manager (verl 0.9.1 workers/reward_manager/dapo.py) run them:

- Dynamic sampling. A group whose rewards are all equal (all right or all wrong) has advantage 0 on
  every token: it costs a forward and backward and teaches nothing, and as accuracy rises more groups
  look like that, so the effective batch shrinks. DAPO over-samples: it keeps drawing generation
  rounds of fresh prompts, keeps only groups with reward variance, and stops when the step holds
  `target` of them, cut to exactly `target` (verl: `batch[:train_batch_size]`). `max_rounds` bounds
  the rounds (the recipe's max_num_gen_batches = 10). Choice: verl raises when the rounds run out;
  nanorl trains on the groups it found and says so (`gave_up`; train.py logs a line and counts it), as
  one hard stretch of data should not end a long run. Filtering reads the reward before the overlong
  penalty (the recipe filters on "acc", the correctness score): a group all right but of different
  lengths has no correctness signal.
- Overlong filtering (`truncated_loss_mask`). A response cut at max_new_tokens has no final answer,
  so its reward punishes reasoning that may have been sound. Its tokens leave the loss (mask 0); its
  reward still counts in its group's baseline.
- Soft overlong punishment (`overlong_penalty`). With L_max = max_new_tokens and a buffer L_cache,
  R_length(y) = 0 if |y| ≤ L_max − L_cache, ((L_max − L_cache) − |y|)/L_cache · factor inside the
  buffer, so −factor at |y| = L_max (paper: L_max 20480, L_cache 4096, factor 1). Added to the reward.
The `dapo` preset turns all three on with clip-higher (0.2/0.28) and token-mean, as the paper's
Table 1 stacks them. Test: python -m pytest tests/test_dapo.py -q
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
