"""Metric names: every scalar a step logs lives in one namespace, named here and nowhere else.

The layout RL engineers read (slime's): `rollout/` what was sampled and scored (links 1-2 of the chain),
`train/` what the update did (links 3-7), `eval/` held-out (nanorl/evaluation.py names its own), `perf/`
time, throughput and memory, `sync/` the engine's weight-sync check (link 8), `routing/` MoE routing
replay. Each module keeps its short, readable local names (`pg_clipfrac`, `reward_mean`, `time/step`);
`rl_step` hands the step's dict to `namespaced` once, so the rule lives in one place and the same names
reach metrics.jsonl, the console, TensorBoard and W&B. Start at `name`. docs/tour.md's table gives each
name's meaning. `with_metadata` adds the samples' own metadata fields (--log-metadata, a reward's log-only
fields) under their own names, pooled over ranks.

    python -c "from nanorl.metrics import name; print(name('pg_clipfrac'), name('time/step'))"
"""
from __future__ import annotations

import math
import numbers
import resource
import sys

import torch

from nanorl import distributed
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


# ----------------------------------------------------------------------------- Sample.metadata fields

def with_metadata(metrics: dict, samples: list, patterns: list[str]) -> dict:
    """`metrics` plus the samples' metadata metrics (--log-metadata's `patterns`, and the reward's
    log-only fields), logged under their own names (a name that is already a metric of the step raises:
    rename the field). Every rank calls it: the fields are pooled over ranks first (one
    all_gather_object), so all ranks log the same keys — a key only some ranks had would misalign the
    metric all-reduce (nanorl/distributed.py reduce_metrics)."""
    return with_fields(metrics, metadata_metrics(samples, patterns), "metric names of the step")


def with_fields(metrics: dict, extra: dict, what: str) -> dict:
    """`metrics` plus the metadata metrics `extra`; a field named like one of `metrics` (`what` they
    are) raises: rename the field."""
    clash = sorted(set(extra) & set(metrics))
    if clash:
        raise ValueError(f"Sample.metadata fields {clash} are also {what}: rename them")
    return {**metrics, **extra}


def metadata_metrics(samples: list, patterns: list[str], gather=distributed.all_gather) -> dict:
    """Mean of every numeric Sample.metadata field that a pattern names (exactly, or by prefix when
    the pattern ends in "/") or that the reward returned as log-only (named in Sample.log_only:
    nanorl/rewards.py), over the samples that have it, logged under the field's own name.
    Non-finite values are left out of the mean (and counted in `<name>/nonfinite`): a NaN from one
    sample never reaches a metric. `gather` pools the per-field sums over ranks (list of dicts; by
    default every rank's, so every rank calls it)."""
    return pooled_means(gather(metadata_sums(samples, patterns)))


def metadata_sums(samples: list, patterns: list[str]) -> dict[str, list]:
    """`metadata_metrics`' fields of these samples: {name: [sum of the finite values, their count,
    the count of non-finite ones]} (evaluation pools these per eval set, nanorl/evaluation.py)."""
    sums: dict[str, list] = {}
    for s in samples:
        logged = s.log_only or ()
        for key, value in s.metadata.items():
            named = any(key == p or (p.endswith("/") and key.startswith(p)) for p in patterns)
            # lists, strings, nested dicts: not a per-sample scalar (bools count as 0/1)
            if not (key in logged or named) or not isinstance(value, numbers.Real):
                continue
            acc = sums.setdefault(key, [0.0, 0, 0])
            if math.isfinite(value):
                acc[0], acc[1] = acc[0] + float(value), acc[1] + 1
            else:
                acc[2] += 1
    return sums


def pooled_means(parts: list[dict]) -> dict:
    """`metadata_sums` of several parts (one per rank) added up: each field's mean over the values
    counted, and `<name>/nonfinite` where some were not finite."""
    sums: dict[str, list] = {}
    for part in parts:
        for k, (total, n, bad) in part.items():
            acc = sums.setdefault(k, [0.0, 0, 0])
            acc[0], acc[1], acc[2] = acc[0] + total, acc[1] + n, acc[2] + bad
    out = {k: total / n for k, (total, n, _) in sums.items() if n}
    out.update({f"{k}/nonfinite": bad for k, (_, _, bad) in sums.items() if bad})
    return out
