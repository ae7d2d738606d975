"""Rollout dumps: what was sampled, how it was scored, and what the trainer made of every token.
Link: written after the update, from what the rollout, reward, recompute and advantage held.

    python train.py --dump-rollouts 10             # runs/nanorl/rollouts/step_000010.jsonl, ...
    python train.py --debug-rollout-only --dump-rollouts 1 --steps 1 --train-data my.jsonl --reward my.py:fn
    python -m nanorl.viewer runs/nanorl/rollouts/step_000010.jsonl -o view.html

Start at `rollouts` (the step's hook), then `records` (one JSON line per sample: step, index, group,
prompt and response text, reward and its components, status, weight version, and per response token,
as parallel lists under "tokens": id, text, rollout_logprob, trainer_logprob, entropy, advantage,
loss_mask, teacher_logprob — null without --teacher) and `write`. Key choices: floats are the float32
values exactly and a non-finite one is null (strict JSON); the trainer's π_old is the recompute pass or
the update's first forward, and on a dump step the recompute always runs, so every row has one
(`rollouts`); out_dir/rollouts stays under one byte budget, `--dump-rollouts-mb` (`write`); several
ranks: rank 0 writes the samples it holds, with no collective in the dump path.

Test: python -m pytest tests/test_dump.py -q
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys

import torch

FIELDS = ("id", "text", "rollout_logprob", "trainer_logprob", "entropy", "advantage", "loss_mask",
          "teacher_logprob")


def _floats(values) -> list:
    # NaN / inf: null, strict JSON
    return [v if math.isfinite(v) else None for v in values]


def records(samples, tokenizer, step: int, tokens: dict | None = None) -> list[dict]:
    """One dict per sample; tokens: per-token tensors [B, T] aligned with `samples` (row i = sample
    i, as collate lays them out) under the FIELDS names, or None (rollout only)."""
    tokens = {k: v.detach().float().cpu() for k, v in (tokens or {}).items()}
    unknown = set(tokens) - set(FIELDS)
    if unknown:
        raise ValueError(f"dump.records: unknown per-token fields {sorted(unknown)}; known: {FIELDS}")
    ids = sorted({i for s in samples for i in s.response_ids})
    # each token decoded alone
    piece = dict(zip(ids, tokenizer.batch_decode([[i] for i in ids]))) if ids else {}
    out = []
    for row, s in enumerate(samples):
        R = s.response_length
        tok = {"id": list(s.response_ids), "text": [piece[i] for i in s.response_ids],
               "rollout_logprob": _floats(s.rollout_logprobs) if s.rollout_logprobs is not None else None,
               "loss_mask": list(s.loss_mask) if s.loss_mask is not None else [1] * R}
        for k in ("trainer_logprob", "entropy", "advantage", "loss_mask", "teacher_logprob"):
            if k in tokens:
                vals = _floats(tokens[k][row, :R].tolist())
                tok[k] = [int(v) for v in vals] if k == "loss_mask" else vals
            tok.setdefault(k, None)
        comps = s.reward if isinstance(s.reward, dict) else None
        out.append({"step": step, "index": row, "group": s.group_id,
                    "prompt": tokenizer.decode(s.prompt_ids), "response": tokenizer.decode(s.response_ids),
                    "reward": _floats([s.total_reward])[0], "reward_components": comps, "status": s.status,
                    "weight_version": s.weight_version, "tokens": {k: tok[k] for k in FIELDS}})
    return out


def write(directory: str, step: int, recs: list[dict], max_bytes: int) -> tuple[str, int]:
    """Write recs to directory/step_NNNNNN.jsonl within max_bytes (a dump that alone would exceed it is
    cut after the last whole sample that fits), then delete the oldest dumps until the directory's dumps
    fit in max_bytes: one budget in bytes, not a file count, since what fills a disk is bytes (a step
    of long answers is 1000x the built-in task's). Returns (path, number of samples written)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step:06d}.jsonl")
    size, written = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            line = json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n"
            n = len(line.encode("utf-8"))
            # cut: every line written is a whole sample
            if size + n > max_bytes:
                break
            f.write(line)
            size, written = size + n, written + 1
    # oldest first
    old = sorted(p for p in glob.glob(os.path.join(directory, "step_*.jsonl")) if p != path)
    total = size + sum(os.path.getsize(p) for p in old)
    for p in old:
        if total <= max_bytes:
            break
        total -= os.path.getsize(p)
        os.remove(p)
    return path, written


class DumpError(ValueError):
    """A dump that cannot be read (damaged, or no samples); the message names the file."""


def read(path: str, log=None) -> list[dict]:
    """The records of a dump. A last line that is not whole JSON (the run was killed while writing it,
    or the disk filled) is skipped with a note through `log` (default: stderr): the samples before it
    are intact, and they are what a user opens a dump to see (nanorl/viewer.py). A broken line anywhere
    else is not a cut: a DumpError naming the file and the line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    records = []
    for k, (n, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError as e:
            if k < len(lines) - 1:
                raise DumpError(f"{path}:{n}: not a rollout record ({e}); the dump is damaged") from None
            (log or (lambda m: print(m, file=sys.stderr)))(
                f"{path}:{n}: the last line is cut off (the run stopped while writing it); skipped")
    return records


def due(every: int, step: int) -> bool:
    """Whether step `step` (numbered as metrics.jsonl logs it: 1 for the first) dumps, every `every`
    steps (0: never). The same answer on every rank: rl_step then runs the π_old recompute on all of
    them, a collective under FSDP, so that every row has its trainer logprob and entropy — also the
    rows --skip-zero-advantage keeps out of the update."""
    return bool(every) and step % every == 0


def rollouts(samples, batch, tokenizer, step: int, every: int, out_dir: str, max_mb: float, rank: int = 0,
             log=print) -> str | None:
    """rl_step's hook: on a `due` step, on rank 0, dump this step's samples (with `records`) to
    out_dir/rollouts within max_mb MiB (with `write`; a cut is reported through `log`). batch: the
    trained PaddedBatch (its per-token tensors), or None (--debug-rollout-only: the trainer's fields
    are null). step: numbered as metrics.jsonl logs it. Returns the path, or None when nothing dumps.

    trainer_logprob and entropy are π_old as the trainer computed it: the recompute pass when it ran,
    else the update's first forward — on-policy, one epoch and one mini-batch, that pass runs before
    the only optimizer step, so it is π_old exactly (nanorl/update.py old_policy_view); advantage and
    loss_mask are the trained ones (after DAPO's overlong filter; 0 on environment tokens)."""
    if not due(every, step) or rank != 0 or not samples:
        return None
    tokens = None
    if batch is not None:
        # update imports the heavy model code; dump stays light
        from nanorl.update import old_policy_view

        # scored 0: a row no trainer forward saw → null
        logp, ent, scored = old_policy_view(batch)
        # [B, T]
        unscored = torch.where(scored > 0, 0.0, math.nan)
        tokens = {"trainer_logprob": logp + unscored, "entropy": ent + unscored,
                  "advantage": batch.tensors.advantages, "loss_mask": batch.response_mask}
        if batch.tensors.teacher_logprobs is not None:  # --teacher: its log-probs of the sampled tokens
            tokens["teacher_logprob"] = batch.tensors.teacher_logprobs
    recs = records(samples, tokenizer, step, tokens)
    path, n = write(os.path.join(out_dir, "rollouts"), step, recs, int(max_mb * 2**20))
    if n < len(recs):
        log(f"step {step}: rollout dump {path} cut at {n} of {len(recs)} samples "
            f"(--dump-rollouts-mb {max_mb})")
    return path


def as_tensor(recs: list[dict], field: str, T: int) -> torch.Tensor:
    """A per-token field of read-back records as [B, T] float32, 0 beyond each response (tests, tools)."""
    out = torch.zeros(len(recs), T)
    for i, r in enumerate(recs):
        vals = [0.0 if v is None else float(v) for v in (r["tokens"][field] or [])]
        out[i, :len(vals)] = torch.tensor(vals[:T])
    return out
