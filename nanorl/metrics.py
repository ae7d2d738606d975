"""Metric names: every scalar a step logs lives in one namespace, named here and nowhere else.

The layout RL engineers read (slime's): `rollout/` what was sampled and scored (links 1-2 of the chain),
`train/` what the update did (links 3-7), `eval/` held-out (nanorl/evaluation.py names its own), `perf/`
time, throughput and memory, `sync/` the engine's weight-sync check (link 8), `routing/` MoE routing
replay. Each module keeps its short, readable local names (`pg_clipfrac`, `reward_mean`, `time/step`);
`rl_step` hands the step's dict to `namespaced` once, so the rule lives in one place and the same names
reach metrics.jsonl, the console, TensorBoard and W&B. Start at `name`. docs/tour.md's table gives each
name's meaning.

    python -c "from nanorl.metrics import name; print(name('pg_clipfrac'), name('time/step'))"
"""
from __future__ import annotations

import resource
import sys

import torch

from nanorl.rewards import correct

NAMESPACES = ("rollout/", "train/", "eval/", "perf/", "sync/", "routing/")
ROLLOUT = ("reward_mean", "reward_std", "accuracy", "response_length_mean", "response_length_max",
           "truncated_frac", "groups_kept_frac", "overlong_penalty_mean", "dropped_frac", "think_masked_frac")
ROLLOUT_GROUPS = ("reward/", "reward_faults/", "ksm/", "env/", "env_faults/", "agent/", "agent_faults/",
                  "dapo/", "dropped/")
PERF = ("tokens_per_s",)


def name(key: str) -> str:
    """The namespaced name of a local metric name (an already namespaced name is returned as is).

    time/<phase> → perf/time/<phase>; async/*_s (waits, worker seconds) → perf/async/, the rest of
    async/ (staleness, partial rollouts) → rollout/async/; the rollout names and groups above →
    rollout/; tokens_per_s → perf/; everything else a step returns comes from the update → train/."""
    if key.startswith(NAMESPACES):
        return key
    if key.startswith("async/"):
        return ("perf/" if key.endswith("_s") else "rollout/") + key
    if key in ROLLOUT or key.startswith(ROLLOUT_GROUPS):
        return "rollout/" + key
    if key in PERF or key.startswith("time/"):
        return "perf/" + key
    return "train/" + key


def namespaced(metrics: dict) -> dict:
    """Every key renamed by `name`; two local names landing on one namespaced name is a bug: raise."""
    out = {}
    for k, v in metrics.items():
        n = name(k)
        if n in out:
            raise ValueError(f"metrics {k!r} and another key both map to {n!r}: rename one")
        out[n] = v
    return out


def reward_metrics(samples) -> dict:
    """What was sampled and scored: reward, accuracy, lengths, truncation, reward components."""
    r = torch.tensor([s.total_reward for s in samples])                                 # [N]
    lengths = torch.tensor([s.response_length for s in samples], dtype=torch.float)    # [N]
    m = {"reward_mean": r.mean(), "reward_std": r.std() if len(r) > 1 else torch.tensor(0.0),
         "accuracy": torch.tensor([correct(s.reward) >= 1.0 for s in samples]).float().mean(),
         "response_length_mean": lengths.mean(), "response_length_max": lengths.max(),
         "truncated_frac": torch.tensor([s.status == "truncated" for s in samples]).float().mean()}
    if isinstance(samples[0].reward, dict):
        for k in samples[0].reward:
            m[f"reward/{k}"] = torch.tensor([s.reward.get(k, 0.0) for s in samples]).mean()
    return {k: float(v) for k, v in m.items()}


def memory_metrics(device: torch.device) -> dict:
    """Peak memory of this process so far: resident host memory, and the CUDA allocator's peak."""
    # KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    m = {"perf/mem/peak_rss_gb": rss / (2**30 if sys.platform == "darwin" else 2**20)}
    if device.type == "cuda":
        m["perf/mem/cuda_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return m
