"""Rollout dumps: what was sampled, how it was scored, and what the trainer made of every token.

    rollout → reward → logprob recompute → advantage → loss → backward → optimizer step → weight sync
    ^^^^^^^^^^^^^^^^   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^ written after the update, from what these held

    python train.py --dump-rollouts 10             # runs/nanorl/rollouts/step_000010.jsonl, ...
    python train.py --debug-rollout-only --dump-rollouts 1 --steps 1 --train-data my.jsonl --reward my.py:fn
    python -m nanorl.viewer runs/nanorl/rollouts/step_000010.jsonl -o view.html

Debugging RL is reading rollouts. Every `--dump-rollouts N` steps rl_step writes one JSONL line per
sample of the step (`record`): step, index, group (samples of one prompt share it), prompt and response
text, reward (the total) and its components, status, weight version, and per response token, as
parallel lists under "tokens": id, text (each token decoded alone), rollout_logprob (the engine's),
trainer_logprob and entropy (π_old as the trainer computed it: the recompute pass when it ran, else
the update's first forward — on-policy, one epoch and one mini-batch, that pass runs before the only
optimizer step, so it is π_old exactly; on a dump step the recompute always runs, so rows that
--skip-zero-advantage leaves out of the update are scored too; nanorl/update.py old_policy_view), advantage, and loss_mask
(after DAPO's overlong filter; 0 on environment tokens). Floats are the float32 values exactly (JSON
round-trips them); a non-finite one is written as null, so the file is strict JSON. With
`--debug-rollout-only` nothing after the reward runs, and the trainer's fields are null.

Size: out_dir/rollouts stays under `--dump-rollouts-mb` (`write`): a dump that alone would exceed the
budget is cut after the last sample that fits (logged), then the oldest dumps are deleted until the
directory fits. One budget, not a file count: what fills a disk is bytes, and a step of long answers
is 1000x the built-in task's. Several ranks: rank 0 writes the samples it holds (its shard of the
step's prompts, 1/world of them): no collective in the dump path, one file per step.

Test: python -m pytest tests/test_dump.py -q
"""
from __future__ import annotations

import glob
import json
import math
import os

import torch

FIELDS = ("id", "text", "rollout_logprob", "trainer_logprob", "entropy", "advantage", "loss_mask")


def _floats(values) -> list:
    return [v if math.isfinite(v) else None for v in values]  # NaN / inf: null, strict JSON


def records(samples, tokenizer, step: int, tokens: dict | None = None) -> list[dict]:
    """One dict per sample; tokens: per-token tensors [B, T] aligned with `samples` (row i = sample
    i, as collate lays them out) under the FIELDS names, or None (rollout only)."""
    tokens = {k: v.detach().float().cpu() for k, v in (tokens or {}).items()}
    unknown = set(tokens) - set(FIELDS)
    if unknown:
        raise ValueError(f"dump.records: unknown per-token fields {sorted(unknown)}; known: {FIELDS}")
    ids = sorted({i for s in samples for i in s.response_ids})
    piece = dict(zip(ids, tokenizer.batch_decode([[i] for i in ids]))) if ids else {}  # each token alone
    out = []
    for row, s in enumerate(samples):
        R = s.response_length
        tok = {"id": list(s.response_ids), "text": [piece[i] for i in s.response_ids],
               "rollout_logprob": _floats(s.rollout_logprobs) if s.rollout_logprobs is not None else None,
               "loss_mask": list(s.loss_mask) if s.loss_mask is not None else [1] * R}
        for k in ("trainer_logprob", "entropy", "advantage", "loss_mask"):
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
    """Write recs to directory/step_NNNNNN.jsonl within max_bytes, then delete the oldest dumps until
    the directory's dumps fit in max_bytes. Returns (path, number of samples written)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step:06d}.jsonl")
    size, written = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            line = json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n"
            n = len(line.encode("utf-8"))
            if size + n > max_bytes:  # cut: every line written is a whole sample
                break
            f.write(line)
            size, written = size + n, written + 1
    old = sorted(p for p in glob.glob(os.path.join(directory, "step_*.jsonl")) if p != path)  # oldest first
    total = size + sum(os.path.getsize(p) for p in old)
    for p in old:
        if total <= max_bytes:
            break
        total -= os.path.getsize(p)
        os.remove(p)
    return path, written


def read(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def due(run) -> bool:
    """Whether this step dumps (the same answer on every rank: rl_step then runs the π_old recompute on
    all of them, a collective under FSDP, so that every row has its trainer logprob and entropy — also
    the rows --skip-zero-advantage keeps out of the update)."""
    return bool(run.cfg.dump_rollouts) and (run.step + 1) % run.cfg.dump_rollouts == 0


def rollouts(run, samples, batch=None) -> str | None:
    """rl_step's hook: every cfg.dump_rollouts steps, on rank 0, dump this step's samples; batch: the
    trained PaddedBatch (its per-token tensors), None with --debug-rollout-only. Returns the path."""
    cfg, step = run.cfg, run.step + 1  # the step number metrics.jsonl logs this step under
    if not due(run) or run.rank != 0 or not samples:
        return None
    tokens = None
    if batch is not None:
        from nanorl.update import old_policy_view  # update imports the heavy model code; dump stays light

        logp, ent, scored = old_policy_view(batch)  # scored 0: a row no trainer forward saw → null
        unscored = torch.where(scored > 0, 0.0, math.nan)  # [B, T]
        tokens = {"trainer_logprob": logp + unscored, "entropy": ent + unscored,
                  "advantage": batch.token_data["advantages"], "loss_mask": batch.response_mask}
    recs = records(samples, run.tokenizer, step, tokens)
    path, n = write(os.path.join(cfg.out_dir, "rollouts"), step, recs, int(cfg.dump_rollouts_mb * 2**20))
    if n < len(recs):
        run.logger.print(f"step {step}: rollout dump {path} cut at {n} of {len(recs)} samples "
                         f"(--dump-rollouts-mb {cfg.dump_rollouts_mb})")
    return path


def as_tensor(recs: list[dict], field: str, T: int) -> torch.Tensor:
    """A per-token field of read-back records as [B, T] float32, 0 beyond each response (tests, tools)."""
    out = torch.zeros(len(recs), T)
    for i, r in enumerate(recs):
        vals = [0.0 if v is None else float(v) for v in (r["tokens"][field] or [])]
        out[i, :len(vals)] = torch.tensor(vals[:T])
    return out
