"""Checkpoints: everything a run needs to continue exactly, written atomically, resumed from the newest
one that is whole. Link: after the optimizer step and weight sync, every save_every steps.

Start at `save(state, cfg, logger)` and `resume(state, cfg, path_or_latest, logger)`; `State` lists what
is saved. A step directory `out_dir/checkpoints/step_NNNNNN/` holds the model and tokenizer (safetensors,
loadable as is by transformers / vLLM), trainer_state.pt (optimizer, critic, scheduler, every rank's RNG
streams), trainer_state.json (step, loader, KL controller, counters, reward faults, config, layout) and
manifest.json (size and sha256 of every other file), written last. Key choices: nothing is unpickled
(JSON, safetensors, DCP, `torch.load(weights_only=True)`); a save is atomic (a hidden directory, fsync'd,
one rename: nanorl/ckpt_atomic.py, which this module hands the files to write), so a reader sees a
whole checkpoint or none, and a damaged one fails its manifest and is skipped; two layouts, "full"
(rank 0 writes one copy) and "sharded" under FSDP (nanorl/ckpt_sharded.py); ranks agree on every
verdict; a resume puts back every random stream, the loader and metrics.jsonl, so N steps + resume + N
steps log what 2N steps log (the limits are in `resume`). The reference model is the starting
`--model`, not saved. A LoRA run (--lora-rank) saves layout "lora": its adapters in PEFT's
format (adapter_config.json, adapter_model.safetensors: `PeftModel.from_pretrained(base, step_dir)`
loads them) and the model's config instead of the full weights (the base is `--model`, unchanged);
`python -m nanorl.export` merges them into a Hugging Face checkpoint.

    python -m pytest tests/test_reliability.py -q
"""
from __future__ import annotations

import json
import os
import random
import re
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint import CheckpointException

from nanorl import ckpt_atomic, ckpt_sharded, distributed, lora

# how the files land on disk (nanorl/ckpt_atomic.py); these names are this module's interface too
from nanorl.ckpt_atomic import MANIFEST, CheckpointError, list_checkpoints, verify  # noqa: F401
from nanorl.logger import OPTIMIZER_STEPS

# test hook: NANORL_CHECKPOINT_PAUSE=<seconds> sleeps between the weights and the trainer state, so a
# test can SIGKILL a save midway (tests/test_reliability.py)
PAUSE_ENV = "NANORL_CHECKPOINT_PAUSE"
# config fields a resumed run may change without a note (where it writes, how long it runs, how it evaluates)
# (lr: applied and said in the resume line, `_apply_lr`; AdamW's betas, eps and weight decay: applied to
# the restored groups; overwrite: a start-up choice about out_dir)
FREE_FIELDS = {"resume", "steps", "out_dir", "save_every", "eval_every", "eval_limit", "quiet", "threads",
               "keep_checkpoints", "tensorboard", "wandb_project", "reward_timeout", "pass_k",
               "test_data", "eval_temperature", "eval_max_new_tokens", "lr", "overwrite", "adam_beta1",
               "adam_beta2", "adam_eps", "weight_decay"}


@dataclass
class State:
    """What a checkpoint saves and `resume` restores in place (the objects are loaded into; `step` is
    set here, and a caller that keeps its own step count reads it back).

    model: the policy (a Hugging Face causal LM: save_pretrained; under FSDP its sharded self).
    tokenizer: saved beside it (save_pretrained). optimizer, scheduler: torch's (state_dict).
    loader, kl_ctl: anything with state_dict() / load_state_dict() of JSON values (nanorl/data.py
    PromptLoader, nanorl/kl.py controllers). trained: the module the optimizer's parameters were taken
    from (train.py's policy + critic behind DDP / FSDP); None: `model`. critic: PPO's value model or None.
    engine: the rollout engine or None: its `generator` (a torch.Generator) is one of the random streams,
    and `update_weights(model, version=step)` syncs it after a resume. rewards: the reward runner or None:
    its `faults` Counter is saved per rank. scorers: the reward model / judge components by name
    (nanorl/build.py make_scorers): their `faults` Counters, per rank too. pipeline: what is in flight
    or None: --async-steps' trainer end (nanorl/pipeline.py: the batches sampled ahead; started after a
    resume), or synchronous --partial-rollout abort's source (nanorl/sources.py Partial: each rank's
    buffer, put back by `resume` through its load(path)); every rank's save(path, step) writes its part.
    counters: plain counts (restored by update, in place). step: the steps done. rank, world: this
    process's rank and the number of ranks; every rank calls save and resume."""
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    loader: object
    kl_ctl: object
    trained: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None
    engine: object | None = None
    rewards: object | None = None
    scorers: dict = field(default_factory=dict)
    pipeline: object | None = None
    counters: dict = field(default_factory=dict)
    step: int = 0
    rank: int = 0
    world: int = 1

    def __post_init__(self):
        if self.trained is None:
            self.trained = self.model


def _engine_gen(engine) -> torch.Generator | None:
    return engine.rng() if engine is not None else None


def rng_state(engine=None) -> dict:
    """Every random stream of this process, the engine's sampler included when it has a torch
    generator (tensors and plain values: loadable with weights_only)."""
    npy = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (npy[0], npy[1].tolist(), *npy[2:]),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if _engine_gen(engine) is not None:
        state["engine"] = _engine_gen(engine).get_state()
    return state


def set_rng_state(state: dict, engine=None) -> None:
    """Put back what `rng_state` returned (the engine's stream only when both have one)."""
    npy = state["numpy"]
    random.setstate(state["python"])
    np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), *npy[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "engine" in state and _engine_gen(engine) is not None:
        _engine_gen(engine).set_state(state["engine"])


@contextmanager
def isolated_rng(engine, seed: int):
    """Seed the engine's sampler with `seed`, then put every stream back: evaluation, run inside,
    never shifts training's random stream (exact resume depends on it)."""
    saved = rng_state(engine)
    if _engine_gen(engine) is not None:
        _engine_gen(engine).manual_seed(seed)
    try:
        yield
    finally:
        set_rng_state(saved, engine)


def save(state: State, cfg, logger=None) -> str:
    """Checkpoint `state` as out_dir/checkpoints/step_NNNNNN (state.step); every rank calls it and
    returns the path, or raises the same CheckpointError. cfg: the run's Config, saved whole (a resume
    compares it); its out_dir, fsdp and keep_checkpoints are read. logger: a nanorl.logger.Logger or
    None; its `file` (rank 0's metrics.jsonl) is flushed and its length saved, for the resume to cut
    back to. FSDP: each rank writes its own shards (nanorl/ckpt_sharded.py). Else rank 0 writes the
    one copy (DDP replicas are identical). Every rank hashes a share of the files."""
    local = {"rng": rng_state(state.engine),
             "reward_faults": dict(state.rewards.faults) if state.rewards is not None else {},
             "scorer_faults": {name: dict(s.faults) for name, s in state.scorers.items()}}
    # RNG streams differ by rank: collect them all
    ranks = ckpt_atomic.all_gather(state.world, local)

    def write(tmp: str) -> None:
        # collective: State carries the model, trained, critic, optimizer and rank it reads
        sharded = ckpt_sharded.save(state, tmp) if cfg.memory.fsdp else None
        # what is in flight, on every rank: --async-steps' batches sampled from versions this checkpoint
        # does not hold (rank 0's pipeline.pt; the others' Follower saves nothing: nanorl/pipeline.py);
        # synchronous --partial-rollout: each rank's aborted groups (nanorl/sources.py Partial)
        if state.pipeline is not None:
            state.pipeline.save(tmp, state.step)
        if state.rank == 0:
            _write_rank0(state, cfg, logger, tmp, ranks, sharded)
    return ckpt_atomic.write_step_dir(os.path.join(cfg.out_dir, "checkpoints"), state.step, state.rank,
                                      state.world, write, cfg.saving.keep_checkpoints)


def _write_rank0(state: State, cfg, logger, tmp: str, ranks: list[dict], sharded: dict | None) -> None:
    """Rank 0's files: the model (not sharded: the module's own tensors) or, sharded, its config; the
    tokenizer; trainer_state.pt and trainer_state.json."""
    layout = "lora" if lora.is_lora(state.model) else "full" if sharded is None else "sharded"
    if layout == "full":
        state.model.save_pretrained(tmp)
    # sharded: the weights were written by every rank (ckpt_sharded); sharded and LoRA: the config
    else:
        if layout == "lora":  # the adapters (PEFT's format) and the config; the base is --model
            lora.save_adapters(state.model, tmp)
        state.model.config.save_pretrained(tmp)
        if state.model.generation_config is not None:
            state.model.generation_config.save_pretrained(tmp)
    state.tokenizer.save_pretrained(tmp)
    # test hook (PAUSE_ENV)
    time.sleep(float(os.environ.get(PAUSE_ENV) or 0))
    # read back with weights_only=True; sharded: the critic and optimizer are in the shards
    critic = state.critic if sharded is None else None
    trainer = {"optimizer": state.optimizer.state_dict() if sharded is None else None,
               "critic": distributed.full_state_dict(critic) if critic is not None else None,
               "scheduler": state.scheduler.state_dict(), "rng": [r["rng"] for r in ranks]}
    ckpt_atomic.torch_save(trainer, os.path.join(tmp, "trainer_state.pt"))
    # rank 0's metrics.jsonl
    logfile = getattr(logger, "file", None)
    if logfile is not None:
        logfile.flush()
    ckpt_atomic.write_json(os.path.join(tmp, "trainer_state.json"), {
        "format": ckpt_atomic.FORMAT, "step": state.step, "config": cfg.as_flags(), "layout": layout,
        "sharded": sharded, "loader": state.loader.state_dict(), "kl_ctl": state.kl_ctl.state_dict(),
        "counters": dict(state.counters), "reward_faults": [r["reward_faults"] for r in ranks],
        "scorer_faults": [r["scorer_faults"] for r in ranks],
        "metrics_bytes": os.path.getsize(logfile.name) if logfile is not None else None,
        "optimizer_steps_bytes": _size(os.path.join(cfg.out_dir, OPTIMIZER_STEPS))})


def _read(rank: int, world: int, path: str) -> tuple[dict, dict, list[dict]]:
    """Verified trainer state, trainer tensors and — full layout only — the model's weight shards, in
    memory (sharded: read later, each rank its slices). Every rank reaches the same verdict."""
    state = tensors = weights = err = None
    try:
        manifest = verify(path, (rank, world))
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        # weights_only: tensors and plain containers only, no arbitrary unpickling
        tensors = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
        shards = sorted(f for f in manifest["files"] if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors", f))
        # LoRA: the adapters are the weights
        if state.get("layout") == "lora":
            shards = [f for f in manifest["files"] if f == lora.ADAPTER_FILE]
        if not shards:
            raise CheckpointError(f"{path}: has no {'adapter' if state.get('layout') == 'lora' else 'model'}"
                                  ".safetensors")
        sharded = state.get("layout") == "sharded"
        weights = [] if sharded else [load_file(os.path.join(path, s)) for s in shards]
    except CheckpointError as e:
        err = str(e)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        err = f"{path}: unreadable ({type(e).__name__}: {e})"
    err = ckpt_atomic.first_error(world, err)
    if err is not None:
        raise CheckpointError(err)
    return state, tensors, weights


def resume(state: State, cfg, path_or_latest: str, logger=None) -> str | None:
    """Restore `state` in place from a checkpoint directory, or from the newest valid one under
    cfg.out_dir/checkpoints ("latest": a damaged one is skipped with the reason, the next older
    tried). Returns the path, or None when "latest" finds no checkpoint at all (the run then starts
    from scratch). cfg: the run's Config (a difference from the saved one is noted); logger: as for
    `save` (its print for notes; its metrics.jsonl is cut back to the checkpoint), or None (print).

    Exact: 2N steps, and N steps + resume + N steps, log identical per-step metrics
    (tests/test_reliability.py): every random stream is restored (python, numpy, torch CPU/CUDA, the
    engine's sampler), the loader restarts at the same row, train.py seeds its mini-batch shuffle by
    step, evaluation runs under `isolated_rng`, and metrics.jsonl is cut back. Limits: bitwise for the
    HF engine on CPU at the same thread count. GPU kernels with atomics (some attention / scatter
    backwards) differ run to run unless `torch.use_deterministic_algorithms(True)`; vLLM has its own
    per-request sampling RNG and batch-shape-dependent kernels: it resumes from the right state, equal
    in distribution, not bitwise. Another world size: the streams stay as the run seeded them."""
    log = logger.print if logger is not None else print
    root = os.path.join(cfg.out_dir, "checkpoints")
    latest = path_or_latest == "latest"
    candidates = [p for _, p in list_checkpoints(root)] if latest else [path_or_latest]
    if not candidates:
        log(f"--resume latest: no checkpoint in {root}; starting from scratch")
        _cut_metrics(logger, cfg.out_dir, root, 0)
        return None
    skipped = []
    for path in candidates:
        try:
            loaded = _read(state.rank, state.world, path)
            break
        except CheckpointError as e:
            # a checkpoint named explicitly is that one or nothing
            if not latest:
                raise
            log(f"skipping checkpoint: {e}")
            skipped.append(str(e))
    else:
        raise CheckpointError(f"no valid checkpoint in {root}:\n  " + "\n  ".join(skipped))
    _apply(state, cfg, logger, path, *loaded)
    saved_lr = loaded[0]["config"].get("lr", cfg.lr)
    lr = f"; --lr {cfg.lr:g} applied (the checkpoint's run had {saved_lr:g})" if saved_lr != cfg.lr else ""
    log(f"resumed from {path} at step {state.step}{lr}")
    return path


def _load_weights(state: State, path: str, weights: list[dict], tensors: dict, layout: str) -> None:
    if (layout == "lora") != lora.is_lora(state.model):
        raise CheckpointError(f"{path}: a {'LoRA' if layout == 'lora' else 'full fine-tuning'} checkpoint, "
                              f"but this run {'has' if lora.is_lora(state.model) else 'has no'} --lora-rank")
    if layout == "lora":
        lora.load_adapters(state.model, weights[0], path)
    else:
        _load_model_weights(state, path, weights)
    if state.critic is not None:
        if tensors["critic"] is None:
            raise CheckpointError(f"{path}: has no critic, but this run has one (--vf-coef > 0)")
        distributed.load_full_state_dict(state.critic, tensors["critic"])


def _load_model_weights(state: State, path: str, weights: list[dict]) -> None:
    model_sd = state.model.state_dict()
    # every safetensors shard, by name
    full = {k: v for shard in weights for k, v in shard.items()}
    if any(k not in model_sd for k in full):  # transformers 5's fused MoE experts, saved split
        full = _in_memory_names(state.model, full)
    unexpected = [k for k in full if k not in model_sd]
    if unexpected:
        raise CheckpointError(f"{path}: weights {unexpected[:5]} do not belong to this model")
    # a tied weight (lm_head = embeddings) is saved once
    saved = {_ptr(model_sd[k]): k for k in full}
    full.update({k: full[saved[_ptr(v)]] for k, v in model_sd.items() if k not in full and _ptr(v) in saved})
    missing = [k for k in model_sd if k not in full]
    if missing:
        raise CheckpointError(f"{path}: no weights for {missing[:5]}")
    # --fsdp: each rank keeps its shards
    distributed.load_full_state_dict(state.model, full)


def _in_memory_names(model: torch.nn.Module, full: dict) -> dict:
    """A saved checkpoint's tensors `full` under the model's in-memory names. transformers 5 fuses MoE
    experts in memory (gate_up_proj [E, 2I, H]) and save_pretrained splits them again
    (engine_weights.iter_checkpoint_tensors); here each fused tensor is rebuilt from its saved pieces,
    which the same reversal of a probe that numbers the tensor's elements locates: exact, whatever the
    reversal does (rename, split, transpose). Names it does not map stay as they are."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: in-memory names are the checkpoint names
        return full
    out, used = {}, set()
    for name, t in model.state_dict().items():
        # the names first, on a shape without storage: most tensors keep theirs
        pieces = revert_weight_conversion(model, {name: torch.empty(t.shape, device="meta")})
        if list(pieces) == [name] or not all(k in full for k in pieces):
            continue
        probe = torch.arange(t.numel()).reshape(t.shape)  # element i holds i
        pieces = revert_weight_conversion(model, {name: probe})
        first = full[next(iter(pieces))]
        flat = torch.empty(t.numel(), dtype=first.dtype)  # [numel]
        for k, where in pieces.items():
            flat[where.reshape(-1)] = full[k].reshape(-1)
        out[name] = flat.reshape(t.shape)
        used.update(pieces)
    return {**{k: v for k, v in full.items() if k not in used}, **out}


def _ptr(t: torch.Tensor) -> int:
    # FSDP: the local shard
    return (t.to_local() if hasattr(t, "to_local") else t).data_ptr()


def _apply(state: State, cfg, logger, path: str, saved: dict, tensors: dict, weights: list[dict]) -> None:
    log = logger.print if logger is not None else print
    # FREE_FIELDS: harmless to change
    # saved by flag name (older checkpoints too: Config was flat), compared by flag name
    now = cfg.as_flags()
    changed = {k: (v, now.get(k)) for k, v in saved["config"].items()
               if k not in FREE_FIELDS and now.get(k) != v}
    if changed:
        log(f"note: config differs from the checkpoint's (saved, now): {changed}")
    try:
        # sharded: every rank reads its slices (any world size, FSDP or not)
        if saved.get("layout") == "sharded":
            ckpt_sharded.load(state, path, saved["sharded"])
        else:
            _load_weights(state, path, weights, tensors, saved.get("layout", "full"))
            distributed.load_optimizer_state(state.trained, state.optimizer, tensors["optimizer"])
    # another model or setup
    except (RuntimeError, ValueError, KeyError, CheckpointException) as e:
        raise CheckpointError(f"{path} does not fit this run (another model or --vf-coef?): {e}") from None
    state.scheduler.load_state_dict(tensors["scheduler"])
    if saved["config"].get("lr", cfg.lr) != cfg.lr:
        _apply_lr(state, cfg.lr)
    for group in state.optimizer.param_groups:  # the restored groups carry the saved run's settings
        group.update(betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2), eps=cfg.optim.adam_eps,
                     weight_decay=cfg.optim.weight_decay)
    state.kl_ctl.load_state_dict(saved["kl_ctl"])
    state.loader.load_state_dict(saved["loader"])
    # synchronous --partial-rollout abort: its buffer (sources.Partial); the async pipeline is started
    # after a resume, from the directory (pipeline.start)
    if state.pipeline is not None:
        state.pipeline.load(path)
    state.counters.update(saved["counters"])
    state.step = int(saved["step"])
    # another world size: the streams stay as the run seeded them
    if len(tensors["rng"]) == state.world:
        set_rng_state(tensors["rng"][state.rank], state.engine)
        if state.rewards is not None:
            state.rewards.faults = Counter(saved["reward_faults"][state.rank])
        # a checkpoint written before scorer faults were saved has none
        for name, faults in saved.get("scorer_faults", [{}] * state.world)[state.rank].items():
            if name in state.scorers:
                state.scorers[name].faults = Counter(faults)
    if state.engine is not None:
        state.engine.update_weights(state.model, version=state.step)
    if saved.get("metrics_bytes") is not None:
        _cut_metrics(logger, cfg.out_dir, os.path.dirname(os.path.normpath(path)), saved["metrics_bytes"],
                     saved.get("optimizer_steps_bytes", 0))


def _apply_lr(state: State, lr: float) -> None:
    """A resume with another --lr: the schedule continues at its restored step from the new base rate,
    exactly as a run started with it would be there (LambdaLR: base_lr × factor(step)). The optimizer's
    and the scheduler's saved state carry the old base rate (base_lrs, initial_lr, the current lr),
    which would otherwise go on silently (build.make_optimizer: every group takes --lr)."""
    sched = state.scheduler
    sched.base_lrs = [lr] * len(sched.base_lrs)
    lrs = [lr * factor(sched.last_epoch) for factor in sched.lr_lambdas]
    for group, group_lr in zip(state.optimizer.param_groups, lrs):
        group["initial_lr"], group["lr"] = lr, group_lr
    sched._last_lr = lrs  # what get_last_lr (the logged train/lr) reads until the next step


def _cut_metrics(logger, out_dir: str, root: str, size: int, opt_size: int = 0) -> None:
    """Cut this run's metrics.jsonl (and optimizer_steps.jsonl) back to the checkpoint: steps logged
    after it are redone."""
    logfile = getattr(logger, "file", None)
    own = os.path.realpath(root) == os.path.realpath(os.path.join(out_dir, "checkpoints"))
    if logfile is not None and own and os.path.getsize(logfile.name) >= size:
        logfile.flush()
        os.truncate(logfile.name, size)
        opt = os.path.join(out_dir, OPTIMIZER_STEPS)
        if _size(opt) > opt_size:  # the logger opens it later: nothing to flush
            os.truncate(opt, opt_size)


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0
