"""Checkpoints: everything a run needs to continue exactly, written atomically, resumed from the
newest one that is whole (every save_every steps, after the optimizer step and weight sync).

A crash, a kill or a full disk must cost at most the steps since the last checkpoint, and a resumed
run must go on as if nothing had happened. `out_dir/checkpoints/step_NNNNNN/` holds the model and
tokenizer (safetensors, loadable as is by transformers / vLLM); trainer_state.pt (scheduler, every
RNG state per rank; optimizer and critic in the full layout); trainer_state.json (step, loader
position, KL controller, counters, reward faults, config, layout, length of metrics.jsonl); and
manifest.json (size and sha256 of every other file) written LAST. Nothing is unpickled: JSON,
safetensors, DCP, and `torch.load(weights_only=True)` (tensors and plain containers only). The
reference model is the starting `--model`, not saved.

Two layouts. One process or DDP ("full"): rank 0 writes the one copy (`save_pretrained`, the
optimizer's state_dict). FSDP ("sharded"): every rank writes and reads only its own shards of the
weights, optimizer state and critic (torch.distributed.checkpoint, nanorl/ckpt_sharded.py); such a
checkpoint resumes on any number of ranks, one process without FSDP included. The layout read is
the checkpoint's, whatever the resuming run's mode. Ranks split the hashing (save and verify) and
agree on every verdict, so no rank resumes from a checkpoint another one skipped.

Atomicity: files go to a hidden `.tmp-step_N-<pid>/`, are fsync'd, the manifest comes last, and one
rename puts the directory in place: a reader sees a whole checkpoint or none. One damaged later (a
truncated copy, a bad disk) fails its manifest check and is skipped with the reason; `--resume
latest` falls back to the next older. A failed save (ENOSPC) deletes its temporary directory and
raises `CheckpointError`, never touching older checkpoints. The newest `keep_checkpoints` are kept.

Exact resume: 2N steps, and N steps + `--resume latest` + N steps, log identical per-step metrics
(tests/test_reliability.py): every random stream is restored (python, numpy, torch CPU/CUDA, the
engine's sampler), the loader restarts at the same row, train.py seeds its mini-batch shuffle by
step, evaluation runs under `isolated_rng` so it never shifts the training stream, and
metrics.jsonl is cut back to the checkpoint. Limits: bitwise for the HF engine on CPU at the same
thread count. GPU kernels with atomics (some attention / scatter backwards) differ run to run unless
`torch.use_deterministic_algorithms(True)`; vLLM has its own per-request sampling RNG and
batch-shape-dependent kernels: it resumes from the right state, equal in distribution, not bitwise.

Asynchronous runs (--async-steps K) also store the K batches sampled ahead from versions the
checkpoint does not hold (pipeline.pt); what that guarantees is in nanorl/pipeline.py.

Test hook: NANORL_CHECKPOINT_PAUSE=<seconds> sleeps between the weights and the trainer state, so a
test can SIGKILL a save midway.        python -m pytest tests/test_reliability.py -q
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import time
from collections import Counter
from contextlib import contextmanager

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from torch.distributed.checkpoint import CheckpointException

from nanorl import ckpt_sharded, distributed

FORMAT = "nanorl-checkpoint-1"
MANIFEST = "manifest.json"
PAUSE_ENV = "NANORL_CHECKPOINT_PAUSE"
STEP_DIR = re.compile(r"^step_(\d+)$")
FREE_FIELDS = {"resume", "steps", "out_dir", "save_every", "eval_every", "eval_limit", "quiet", "threads",
               "keep_checkpoints", "tensorboard", "wandb_project", "reward_timeout", "pass_k",
               "test_data", "eval_temperature", "eval_max_new_tokens"}


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; the message says which and why."""


def _engine_gen(run) -> torch.Generator | None:
    gen = getattr(run.engine, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def rng_state(run) -> dict:
    """Every random stream of this process (tensors and plain values: loadable with weights_only)."""
    npy = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (npy[0], npy[1].tolist(), *npy[2:]),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if _engine_gen(run) is not None:
        state["engine"] = _engine_gen(run).get_state()
    return state


def set_rng_state(run, state: dict) -> None:
    npy = state["numpy"]
    random.setstate(state["python"])
    np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), *npy[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "engine" in state and _engine_gen(run) is not None:
        _engine_gen(run).set_state(state["engine"])


@contextmanager
def isolated_rng(run, seed: int):
    """Evaluate from a fixed seed, then put every stream back: evaluation never shifts training's."""
    saved = rng_state(run)
    if _engine_gen(run) is not None:
        _engine_gen(run).manual_seed(seed)
    try:
        yield
    finally:
        set_rng_state(run, saved)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def save(run) -> str:
    """Checkpoint the current step; every rank calls it and returns the path, or raises the same
    CheckpointError. FSDP: each rank writes its own shards (nanorl/ckpt_sharded.py). Else rank 0
    writes the one copy (DDP replicas are identical). Every rank hashes a share of the files."""
    local = {"rng": rng_state(run), "reward_faults": dict(run.rewards.faults)}
    ranks = [local] * run.world  # RNG streams differ by rank: collect them all
    if run.world > 1:
        torch.distributed.all_gather_object(ranks, local)
    root = os.path.join(run.cfg.out_dir, "checkpoints")
    final = os.path.join(root, f"step_{run.step:06d}")
    tmp, err = _from_rank0(run, _make_tmp(root, run.step) if run.rank == 0 else None)
    # several nodes: a rank that cannot see rank 0's directory would hash nothing, silently; the
    # verdict is agreed before the collective save below
    if run.world > 1:
        if err is None and not os.path.isdir(tmp):
            err = f"{tmp} (made by rank 0) is not visible on rank {run.rank}: --out-dir must be shared"
        err = _first_error(run, err)
    trash = tmp.replace(f"{os.sep}.tmp-", f"{os.sep}.trash-")
    try:
        if err is None:
            try:
                sharded = ckpt_sharded.save(run, tmp) if run.cfg.fsdp else None  # collective
                if run.rank == 0:
                    _write_rank0(run, tmp, ranks, sharded)
            except (OSError, CheckpointException) as e:
                err = f"{type(e).__name__}: {e}"
        err = _first_error(run, err)
        entries = {}
        if err is None:  # sizes and sha256 (after an fsync): each rank a share of the files
            files = sorted(os.path.relpath(os.path.join(d, n), tmp) for d, _, ns in os.walk(tmp) for n in ns)
            try:
                entries = {f: _entry(tmp, f) for f in files[run.rank::run.world]}
            except OSError as e:
                err = f"{type(e).__name__}: {e}"
        shares = [(entries, err)] * run.world
        if run.world > 1:
            torch.distributed.all_gather_object(shares, (entries, err))
        err = next((e for _, e in shares if e), None)
        if run.rank == 0 and err is None:
            try:
                _write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT, "step": run.step, "files": {
                    f: m for share, _ in shares for f, m in sorted(share.items())}})  # last: it means "complete"
                _fsync(tmp)
                if os.path.exists(final):  # the same step saved again (save_every, then the end of the run)
                    os.rename(final, trash)
                os.rename(tmp, final)
                _fsync(root)
            except OSError as e:
                err = f"{type(e).__name__}: {e}"
        err = _from_rank0(run, err)
    except BaseException:  # anything else (a bug, Ctrl-C): leave no half-written directory behind
        if run.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if err is not None:
        if run.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = [p for _, p in list_checkpoints(root)]
        raise CheckpointError(f"could not write checkpoint {final}: {err}. Nothing was replaced: the previous "
                              f"checkpoint ({prev[0] if prev else 'none'}) is intact. Free disk space, then "
                              "resume with --resume latest.")
    if run.rank == 0:
        shutil.rmtree(trash, ignore_errors=True)
        complete = [(s, p) for s, p in list_checkpoints(root) if os.path.isfile(os.path.join(p, MANIFEST))]
        for s, p in list_checkpoints(root):  # keep the newest K complete ones, delete everything older
            if len(complete) >= run.cfg.keep_checkpoints and s < complete[run.cfg.keep_checkpoints - 1][0]:
                shutil.rmtree(p, ignore_errors=True)
    return final


def _make_tmp(root: str, step: int) -> tuple[str, str | None]:
    """Rank 0: clear what killed saves left behind, create this save's hidden directory: (path, error)."""
    tmp = os.path.join(root, f".tmp-step_{step:06d}-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of a save that was killed: never valid, never read
            if name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
        return tmp, None
    except OSError as e:
        return tmp, f"{type(e).__name__}: {e}"


def _write_rank0(run, tmp: str, ranks: list[dict], sharded: dict | None) -> None:
    """Rank 0's files: the model (not sharded: the module's own tensors) or, sharded, its config; the
    tokenizer; trainer_state.pt and trainer_state.json."""
    if sharded is None:
        critic = distributed.full_state_dict(run.critic) if run.critic is not None else None
        run.model.save_pretrained(tmp)
    else:  # the weights were written by every rank (ckpt_sharded); the critic and optimizer too
        critic = None
        run.model.config.save_pretrained(tmp)
        if run.model.generation_config is not None:
            run.model.generation_config.save_pretrained(tmp)
    run.tokenizer.save_pretrained(tmp)
    time.sleep(float(os.environ.get(PAUSE_ENV) or 0))  # test hook (module docstring)
    torch.save({"optimizer": run.optimizer.state_dict() if sharded is None else None, "critic": critic,
                "scheduler": run.scheduler.state_dict(), "rng": [r["rng"] for r in ranks]},
               os.path.join(tmp, "trainer_state.pt"))  # read back with weights_only=True
    if getattr(run, "pipeline", None) is not None:  # --async-steps: the batches in flight (nanorl/pipeline.py)
        run.pipeline.save(tmp, run.step)
    logfile = getattr(run.logger, "file", None)  # rank 0's metrics.jsonl
    if logfile is not None:
        logfile.flush()
    _write_json(os.path.join(tmp, "trainer_state.json"), {
        "format": FORMAT, "step": run.step, "config": dataclasses.asdict(run.cfg),
        "layout": "full" if sharded is None else "sharded", "sharded": sharded,
        "loader": run.loader.state_dict(), "kl_ctl": run.kl_ctl.state_dict(), "counters": dict(run.counters),
        "reward_faults": [r["reward_faults"] for r in ranks],
        "metrics_bytes": os.path.getsize(logfile.name) if logfile is not None else None})


def _entry(root: str, name: str) -> dict:
    path = os.path.join(root, name)
    _fsync(path)
    return {"bytes": os.path.getsize(path), "sha256": _sha256(path)}


def _from_rank0(run, value):
    """Rank 0's value on every rank (a broadcast; one process: the value)."""
    box = [value]
    if run.world > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _first_error(run, err: str | None) -> str | None:
    """The first rank's error, or None: the same verdict on every rank (an all-gather)."""
    errs = [err] * run.world
    if run.world > 1:
        torch.distributed.all_gather_object(errs, err)
    return next((e for e in errs if e), None)


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step_N directory under root, newest first (validity not checked)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := STEP_DIR.match(n))]
    return sorted(found, reverse=True)


def verify(path: str, part: tuple[int, int] = (0, 1)) -> dict:
    """The manifest of a complete, intact checkpoint; else CheckpointError saying what is wrong.
    part=(rank, world): hash only every world-th file from the rank-th (ranks split the reading)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (not a checkpoint, or its save was interrupted)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupt {MANIFEST} ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for i, (name, meta) in enumerate(sorted(files.items())):
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            raise CheckpointError(f"{path}: {name} is missing")
        if os.path.getsize(p) != meta["bytes"] or (i % part[1] == part[0] and _sha256(p) != meta["sha256"]):
            raise CheckpointError(f"{path}: {name} is corrupt (size or sha256 differs from the manifest)")
    return manifest


def _read(run, path: str) -> tuple[dict, dict, list[dict]]:
    """Verified trainer state, trainer tensors and — full layout only — the model's weight shards, in
    memory (sharded: read later, each rank its slices). Every rank reaches the same verdict."""
    state = tensors = weights = err = None
    try:
        manifest = verify(path, (run.rank, run.world))
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        # weights_only: tensors and plain containers only, no arbitrary unpickling
        tensors = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
        shards = sorted(f for f in manifest["files"] if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors", f))
        if not shards:
            raise CheckpointError(f"{path}: has no model.safetensors")
        weights = [] if state.get("layout") == "sharded" else [load_file(os.path.join(path, s)) for s in shards]
    except CheckpointError as e:
        err = str(e)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        err = f"{path}: unreadable ({type(e).__name__}: {e})"
    err = _first_error(run, err)
    if err is not None:
        raise CheckpointError(err)
    return state, tensors, weights


def resume(run, path_or_latest: str) -> str | None:
    """Restore `run` from a checkpoint directory, or from the newest valid one under
    out_dir/checkpoints ("latest"). Returns the path, or None when "latest" finds no checkpoint
    at all (the run then starts from scratch)."""
    log, root = run.logger.print, os.path.join(run.cfg.out_dir, "checkpoints")
    latest = path_or_latest == "latest"
    candidates = [p for _, p in list_checkpoints(root)] if latest else [path_or_latest]
    if not candidates:
        log(f"--resume latest: no checkpoint in {root}; starting from scratch")
        _cut_metrics(run, root, 0)
        return None
    skipped = []
    for path in candidates:
        try:
            loaded = _read(run, path)
            break
        except CheckpointError as e:
            if not latest:  # a checkpoint named explicitly is that one or nothing
                raise
            log(f"skipping checkpoint: {e}")
            skipped.append(str(e))
    else:
        raise CheckpointError(f"no valid checkpoint in {root}:\n  " + "\n  ".join(skipped))
    _apply(run, path, *loaded)
    log(f"resumed from {path} at step {run.step}")
    return path


def _load_weights(run, path: str, weights: list[dict], tensors: dict) -> None:
    model_sd = run.model.state_dict()
    full = {k: v for shard in weights for k, v in shard.items()}  # every safetensors shard, by name
    unexpected = [k for k in full if k not in model_sd]
    if unexpected:
        raise CheckpointError(f"{path}: weights {unexpected[:5]} do not belong to this model")
    saved = {_ptr(model_sd[k]): k for k in full}  # a tied weight (lm_head = embeddings) is saved once
    full.update({k: full[saved[_ptr(v)]] for k, v in model_sd.items() if k not in full and _ptr(v) in saved})
    missing = [k for k in model_sd if k not in full]
    if missing:
        raise CheckpointError(f"{path}: no weights for {missing[:5]}")
    distributed.load_full_state_dict(run.model, full)  # --fsdp: each rank keeps its shards
    if run.critic is not None:
        if tensors["critic"] is None:
            raise CheckpointError(f"{path}: has no critic, but this run has one (--vf-coef > 0)")
        distributed.load_full_state_dict(run.critic, tensors["critic"])


def _ptr(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).data_ptr()  # FSDP: the local shard


def _apply(run, path: str, state: dict, tensors: dict, weights: list[dict]) -> None:
    changed = {k: (v, getattr(run.cfg, k, None)) for k, v in state["config"].items()  # FREE_FIELDS: harmless
               if k not in FREE_FIELDS and getattr(run.cfg, k, None) != v}
    if changed:
        run.logger.print(f"note: config differs from the checkpoint's (saved, now): {changed}")
    try:
        if state.get("layout") == "sharded":  # every rank reads its slices (any world size, FSDP or not)
            ckpt_sharded.load(run, path, state["sharded"])
        else:
            _load_weights(run, path, weights, tensors)
            distributed.load_optimizer_state(run.trained, run.optimizer, tensors["optimizer"])
    except (RuntimeError, ValueError, KeyError, CheckpointException) as e:  # another model or setup
        raise CheckpointError(f"{path} does not fit this run (another model or --vf-coef?): {e}") from None
    run.scheduler.load_state_dict(tensors["scheduler"])
    run.kl_ctl.load_state_dict(state["kl_ctl"])
    run.loader.load_state_dict(state["loader"])
    run.counters.update(state["counters"])
    run.step = int(state["step"])
    if len(tensors["rng"]) == run.world:  # another world size: the streams stay as setup() seeded them
        set_rng_state(run, tensors["rng"][run.rank])
        run.rewards.faults = Counter(state["reward_faults"][run.rank])
    run.engine.update_weights(run.model, version=run.step)
    if state.get("metrics_bytes") is not None:
        _cut_metrics(run, os.path.dirname(os.path.normpath(path)), state["metrics_bytes"])


def _cut_metrics(run, root: str, size: int) -> None:
    """Cut this run's metrics.jsonl back to the checkpoint: steps logged after it are redone."""
    logfile = getattr(run.logger, "file", None)
    own = os.path.realpath(root) == os.path.realpath(os.path.join(run.cfg.out_dir, "checkpoints"))
    if logfile is not None and own and os.path.getsize(logfile.name) >= size:
        logfile.flush()
        os.truncate(logfile.name, size)
