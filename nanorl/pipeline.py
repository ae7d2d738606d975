"""Asynchronous RL (--async-steps K), links 1-2 of the chain ahead of the trainer: a rollout worker
process samples and scores the next batches while the trainer trains on this one, from weights at
most K versions old; link 8 publishes each new version to it through shared memory.

Start at `start` (train.py calls it) and `Pipeline.take` / `Pipeline.publish`. Key choices: a
process, not a thread (the tiny model's forwards hold the GIL: 1.40x vs 1.30x over synchronous,
measured); a deterministic staleness rule — batch b is sampled from version max(v0, b − K), so a
K > 0 run is a function of its seed; with a KL term the worker also scores the reference on the same
micro-batches as the trainer's recompute; a checkpoint stores the batches already sampled ahead, so
a resume continues the very run. Partial rollouts (--partial-rollout) switch versions mid-batch.
Not with DAPO's refill, ReMax, --env, --routing-replay, --fsdp, vLLM, or several ranks (the config
raises). The design, the metrics and the measurements: docs/async.md.
Test: python -m pytest tests/test_pipeline.py -q
"""
from __future__ import annotations

import atexit
import copy
import dataclasses
import functools
import math
import os
import pickle
import queue
import signal
import time
import traceback
import types
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from nanorl import precision
from nanorl.distributed import Trained
from nanorl.policy import frozen_copy, load_model
from nanorl.rewards import RewardRunner, load_reward_fn, score_samples
from nanorl.rollout import HFEngine, SamplingConfig, stop_token_ids
from nanorl.trajectory import Sample, collate
from nanorl.update import forward, score_batch

FILE = "pipeline.pt"  # in a checkpoint directory: the batches a save finished (module docstring)


def sampled_from(b: int, K: int, v0: int) -> int:
    """The staleness rule: the weight version batch b is sampled from (module docstring)."""
    return max(v0, b - K)


def start_method(device: str) -> str:
    """fork on CPU: the worker starts in ~0.1 s with everything imported. CUDA cannot fork: spawn
    re-imports torch and transformers (seconds) and re-runs a script that has no __main__ guard."""
    return "spawn" if torch.device(device).type == "cuda" or torch.cuda.is_initialized() else "fork"


def batch_seed(seed: int, b: int) -> int:
    """The sampling seed of batch b: fixed by (run seed, batch), whatever ran before it."""
    return seed * 1_000_003 + b


@dataclasses.dataclass
class WorkerSpec:
    """What the worker process needs (picklable: the spawn start method sends it)."""
    cfg: object               # the run's Config: model, dtype, reward, KL, async flags
    device: str
    sampling: SamplingConfig  # the run's sampling; the worker sets its per-batch seed
    start_version: int        # v0: the version the trainer starts from (0, or the resumed step)


def slot_layout(model: torch.nn.Module, dtype: torch.dtype) -> tuple[list[tuple], int]:
    """Where each state-dict tensor lives in a slot's flat buffer: entries (names, dtype, shape, byte
    offset) and the slot's size in bytes. Floating-point parameters are stored in the compute dtype
    the worker's engine holds them in (a frozen copy, `frozen_copy`), buffers and integer tensors in
    their own; tied parameters (one tensor, several names) take one place. Offsets are 64-byte aligned,
    so every entry can be viewed as its dtype."""
    params = {id(p) for p in model.parameters()}
    entries, where, size = [], {}, 0
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in where:
            entries[where[id(t)]][0].append(name)
            continue
        dt = dtype if id(t) in params and t.is_floating_point() else t.dtype
        where[id(t)] = len(entries)
        entries.append(([name], dt, tuple(t.shape), size))
        size += -(-t.numel() * dt.itemsize // 64) * 64
    return [(tuple(n), dt, shape, off) for n, dt, shape, off in entries], max(size, 64)


class SharedWeights:
    """K+1 slots of the policy's tensors in shared memory; version v lives in slot v % (K+1).

    A slot is overwritten by version v + K + 1, which needs step v + K to have trained, hence batch
    v + K to exist, which the worker samples from version ≥ v: no slot is rewritten while read.

    One shared storage per slot, every tensor a view into it at its offset (`slot_layout`): torch
    shares each CPU storage through a file descriptor held open by every process that maps it, so a
    storage per tensor (291 for Qwen2.5-0.5B, × K+1 slots) ran past the common `ulimit -n` of 1024.
    The slots hold the compute dtype (bf16 runs ship and store half the bytes of the fp32 masters;
    fp32 runs stay fp32, bit for bit the trainer's weights)."""

    def __init__(self, model: torch.nn.Module, K: int, ctx, dtype: torch.dtype = torch.float32):
        self.layout, size = slot_layout(model, dtype)
        self.flat = [torch.empty(size, dtype=torch.uint8).share_memory_() for _ in range(K + 1)]
        self.latest, self.cond = ctx.RawValue("q", -1), ctx.Condition()
        self._views, self._staging = {}, None

    def __getstate__(self) -> dict:
        # what the spawn start method pickles: the K+1 flat storages (one descriptor each), never
        # the views, which would each be reduced as a storage of their own
        return {**self.__dict__, "_views": {}, "_staging": None}

    def _view(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for names, dt, shape, off in self.layout:
            view = flat[off:off + math.prod(shape) * dt.itemsize].view(dt).view(shape)
            out.update(dict.fromkeys(names, view))
        return out

    def slot(self, version: int) -> dict[str, torch.Tensor]:
        """Every state-dict name → its tensor in version's slot (tied names: the same view)."""
        i = version % len(self.flat)
        if i not in self._views:
            self._views[i] = self._view(self.flat[i])
        return self._views[i]

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        state, i = model.state_dict(), version % len(self.flat)
        first = [names[0] for names, *_ in self.layout]
        if any(state[n].is_cuda for n in first):
            self._publish_from_cuda(state, first, i)
        else:
            # on the host the copy into shared memory is the only copy (casting to the slot's dtype)
            views = self.slot(version)
            for n in first:
                views[n].copy_(state[n].detach())
        with self.cond:  # the lock orders the copy before the version the worker reads
            self.latest.value = version
            self.cond.notify_all()

    def _publish_from_cuda(self, state: dict, first: list[str], i: int) -> None:
        """Device → pinned staging buffer, every tensor cast to the slot's dtype on the device first
        (half the bytes over the bus in bf16) and copied with non_blocking=True, one synchronisation
        for all; then one host copy into the shared slot. A device → pageable (shared) copy would
        block on each tensor. The staging buffer (one slot's size, page-locked) is made once."""
        if self._staging is None:
            self._staging = torch.empty(self.flat[i].numel(), dtype=torch.uint8, pin_memory=True)
            self._staging_views = self._view(self._staging)
        devices = set()
        for n in first:
            t, dst = state[n].detach(), self._staging_views[n]
            devices.add(t.device)
            # the cast's temporary is freed after the copy is queued: the caching allocator reuses
            # it only for work queued later on the same stream, after the copy has read it
            dst.copy_(t.to(dst.dtype), non_blocking=True)
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        self.flat[i].copy_(self._staging)

    def wait_for(self, version: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.latest.value >= version, timeout)

    def newest(self) -> int:
        with self.cond:
            return self.latest.value


# ----------------------------------------------------------------------------- the worker process


class Worker:
    """The rollout side: its own model copy, HF engine, reward runner and (with a KL term) frozen
    reference model, one batch per request."""

    def __init__(self, spec: WorkerSpec, weights: SharedWeights):
        cfg, dtype = spec.cfg, precision.compute_dtype(spec.cfg.dtype)
        self.spec, self.cfg, self.weights = spec, cfg, weights
        # The starting --model in fp32 on the host, never on the trainer's GPU: the engine samples in
        # the compute dtype (autocast), so with bf16/fp16 it holds a frozen copy in that dtype (the
        # slots' dtype); with fp32 it is the loaded model itself, as before.
        base, self.tokenizer = load_model(cfg.model, "cpu", dtype)
        if cfg.fp32_lm_head:  # the trainer's numerics, so rollout logprobs match its recompute
            precision.keep_lm_head_fp32(base)
        base.requires_grad_(False)
        # The reference is the starting --model, frozen, as the trainer's (train.py setup): scoring it
        # here takes its forward off the trainer's side of the step, where it would not overlap.
        score = functools.partial(forward, cfg)
        self.ref = None if not cfg.uses_reference else \
            Trained(frozen_copy(base, dtype).to(spec.device), None, score, dtype)
        model = (base if dtype == torch.float32 else frozen_copy(base, dtype)).to(spec.device)
        del base
        self.scoring = types.SimpleNamespace(cfg=cfg, model=model, tokenizer=self.tokenizer, world=1)  # a run
        self.params = model.state_dict()  # views of the module's tensors: loading copies into them
        for names, dt, shape, _ in weights.layout:  # the trainer's layout must fit this model exactly
            for n in names:
                t = self.params.get(n)
                if t is None or t.dtype != dt or tuple(t.shape) != shape:
                    got = None if t is None else (t.dtype, tuple(t.shape))
                    raise RuntimeError(f"async worker: {n} is {got} here, the trainer sends {(dt, shape)}")
        self.engine = HFEngine(model, pad_id=self.tokenizer.pad_token_id, compute_dtype=dtype,
                               between_steps=self.pick_up_newer if cfg.partial_rollout else None)
        self.rewards = RewardRunner(load_reward_fn(cfg.reward), timeout=cfg.reward_timeout, log=print)
        self.engine.version = -1  # nothing loaded yet

    @torch.no_grad()
    def load(self, version: int) -> None:
        done = set()
        for k, view in self.weights.slot(version).items():
            t = self.params[k]
            if t.data_ptr() not in done:  # tied names: one tensor, copied once
                done.add(t.data_ptr())
                t.copy_(view)
        self.engine.version = version

    def pick_up_newer(self) -> bool:
        """Between decode steps (partial rollouts): load a version published since, if any."""
        newest = self.weights.latest.value  # a plain read; newest() then synchronises with publish
        if newest <= self.engine.version:
            return False
        self.load(self.weights.newest())
        return True

    def rollout(self, b: int, prompts: list) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        need = sampled_from(b, cfg.async_steps, self.spec.start_version)
        while not self.weights.wait_for(need, timeout=5.0):
            _exit_if_orphaned()
        t1 = time.perf_counter()
        if self.engine.version < need or not cfg.partial_rollout:  # partial: a newer version held is kept
            self.load(need)
        faults = dict(self.rewards.faults)
        sampling = dataclasses.replace(self.spec.sampling, seed=batch_seed(cfg.seed, b))
        samples = self.engine.generate([p.ids for p in prompts], cfg.samples_per_prompt, sampling)
        t2 = time.perf_counter()
        for s, r in zip(samples, score_samples(self.rewards, self.tokenizer, prompts, samples)):
            s.reward = r
        if cfg.mask_offpolicy_in_partial_rollout:
            for s in samples:
                mask_older_tokens(s)
        t3 = time.perf_counter()
        if self.ref is not None:
            self.score_reference(samples)
        new_faults = {k: v - faults.get(k, 0) for k, v in self.rewards.faults.items()
                      if v != faults.get(k, 0)}
        timing = {"async/engine_wait_s": t1 - t0, "async/generate_s": t2 - t1, "async/reward_s": t3 - t2,
                  "async/reference_s": time.perf_counter() - t3}
        return {"batch": b, "prompt_ids": [p.ids for p in prompts], "samples": samples, "faults": new_faults,
                "metrics": timing}

    @torch.no_grad()
    def score_reference(self, samples: list[Sample]) -> None:
        """Reference logprobs of every response token, as train.py's recompute would score them (the
        same collated batch and micro-batches): metadata["ref_logprobs"], read by `ref_logprobs`."""
        batch = collate(samples, self.tokenizer.pad_token_id).to(self.spec.device)
        support = batch.sampling_support if self.cfg.keep_sampling_mask else None
        lp = score_batch(self.scoring, self.ref, batch, support)[0].cpu()  # [B, T]
        for s, row in zip(samples, lp):
            s.metadata["ref_logprobs"] = row[:s.response_length].tolist()


def mask_older_tokens(s: Sample) -> None:
    """--mask-offpolicy-in-partial-rollout: loss mask 0 on the tokens sampled under an older version
    than the sample's newest (combined with any mask it has)."""
    versions = s.metadata["token_versions"]
    newest, old = max(versions), s.loss_mask or [1] * len(versions)
    s.loss_mask = [int(m and v == newest) for m, v in zip(old, versions)]


_PARENT: list[int] = []  # the worker's trainer process


def _exit_if_orphaned() -> None:
    """The trainer was killed: nobody will read or publish again, so leave at once."""
    if _PARENT and os.getppid() != _PARENT[0]:
        _leave()


def _leave(*_) -> None:
    """End the worker now, and the reward worker processes it started (they would outlive it)."""
    for child in mp.active_children():
        child.kill()
    os._exit(0)


def _worker_main(spec: WorkerSpec, weights: SharedWeights, requests, results) -> None:
    # Ctrl-C reaches the whole process group; the trainer handles it (finishes the step and saves,
    # which needs this worker).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Not daemonic (a daemonic process cannot start the reward runner's worker pool), so it ends
    # itself: on SIGTERM (close(), the trainer's exit: `_stop_at_exit`) and when orphaned.
    signal.signal(signal.SIGTERM, _leave)
    torch.set_num_threads(spec.cfg.threads or 1)
    _PARENT.append(os.getppid())
    worker = None
    try:
        worker = Worker(spec, weights)
        while True:
            try:
                req = requests.get(timeout=5.0)
            except queue.Empty:
                _exit_if_orphaned()
                continue
            if req is None:
                break
            results.put(pickle.dumps(("batch", worker.rollout(*req))))  # tensors by value: no fd per tensor
    except Exception:  # any failure: the trainer raises it, with this traceback
        results.put(pickle.dumps(("error", traceback.format_exc())))
    if worker is not None:  # its reward worker processes: this process's exit would wait for them
        worker.rewards.close()
    results.close()
    results.join_thread()  # what was put reaches the pipe before exit (close() reads it off)


# ----------------------------------------------------------------------------- the trainer side


class Trainer(Protocol):
    """What this module reads of `run` (train.py's Run is one). The worker gets copies of cfg and the
    weights; the trainer's end takes prompts from a copy of loader and adds the worker's reward faults to
    rewards.faults."""
    cfg: Any  # nanorl/config.py Config (async_steps, sampling, reward, reference, rollout_device, ...)
    model: torch.nn.Module  # the policy whose versions are published to the worker
    tokenizer: Any  # stop tokens and the worker's decoding
    loader: Any  # nanorl/data.py PromptLoader: the worker draws the same prompts, in the same order
    rewards: Any  # nanorl/rewards.py RewardRunner: .faults, the run totals
    logger: Any  # .print(str)
    step: int  # the version the worker starts from
    world: int  # ranks (the pipeline runs on one)


class Pipeline:
    """The trainer's end: submits prompt batches, takes scored ones, publishes weights, saves what
    is in flight. Batches are taken in order, one per step. Batch t+K+1's prompts are submitted as t
    is taken: the worker then always holds its next request, so its idle time is waiting for weights."""

    def __init__(self, run: Trainer, restored: dict[int, dict]):
        cfg, self.run, self.K = run.cfg, run, run.cfg.async_steps
        device = cfg.rollout_device or str(next(run.model.parameters()).device)
        ctx = mp.get_context(start_method(device))
        self.weights = SharedWeights(run.model, self.K, ctx, precision.compute_dtype(cfg.dtype))
        self.weights.publish(run.model, run.step)
        self.v0 = run.step
        sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                  max_new_tokens=cfg.max_new_tokens, keep_support=cfg.keep_sampling_mask,
                                  stop_token_ids=stop_token_ids(run.model, run.tokenizer),
                                  support_cap=cfg.support_cap)
        spec = WorkerSpec(cfg, device, sampling, run.step)
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        # daemon=False: the worker runs bounded rewards (--reward math's default timeout) in a process
        # pool, which a daemonic process may not start; the trainer's exit still ends it (_stop_at_exit)
        self.proc = ctx.Process(target=_worker_main, args=(spec, self.weights, self.requests, self.results),
                                daemon=False, name="nanorl-rollout")
        self.proc.start()
        _stop_at_exit(self.proc)
        # The worker draws nothing: this loader, a copy of the trainer's, draws batch b's prompts ahead;
        # rl_step draws the same ones from run.loader and `take` checks they agree.
        self.loader = copy.copy(run.loader)
        self.loader.load_state_dict(run.loader.state_dict())  # its own order list and position
        self.ready, self.submitted, self.metrics = {}, run.step, {}
        for b in range(run.step, run.step + self.K):
            if b in restored:  # finished before the checkpoint: its prompts are already drawn
                self.ready[b] = restored[b]
                self.loader.next_batch()
                self.submitted = b + 1
            else:
                break
        self._fill(run.step + self.K)

    def _fill(self, upto: int) -> None:
        """Submit every batch up to `upto` (never past the run's last step)."""
        while self.submitted <= min(upto, self.run.cfg.steps - 1):
            self.requests.put((self.submitted, self.loader.next_batch()))
            self.submitted += 1

    def _receive(self) -> None:
        """Wait for the worker's next batch; raise what went wrong in it."""
        while True:
            alive = self.proc.is_alive()  # before the read: what it sent before exiting is still read
            try:
                kind, payload = pickle.loads(self.results.get(timeout=1.0))
                break
            except queue.Empty:
                if not alive:
                    raise RuntimeError(f"the rollout worker died (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"the rollout worker failed:\n{payload}")
        self.ready[payload["batch"]] = payload

    def take(self, step: int, prompts) -> list[Sample]:
        """Batch `step`'s scored samples (blocking), checked against the staleness bound."""
        self._fill(step + self.K + 1)  # prompts only: the worker waits for batch b's version itself
        need, latest = sampled_from(step, self.K, self.v0), self.weights.newest()
        if latest < need:  # the worker would wait for it forever, and this for the worker
            raise RuntimeError(f"async rollout: batch {step} is sampled from version {need}, but the newest "
                               f"published is {latest}: publish() the weights after every step")
        start = time.perf_counter()
        while step not in self.ready:
            self._receive()
        got = self.ready.pop(step)
        if got["prompt_ids"] != [p.ids for p in prompts]:
            raise RuntimeError(f"async rollout: batch {step} was sampled for other prompts than the "
                               "trainer's")
        samples = got["samples"]
        for s in samples:  # the bound this module promises: never trust it silently
            if not step - self.K <= s.weight_version <= step:
                raise RuntimeError(f"async rollout: a sample of version {s.weight_version} reached step "
                                   f"{step} "
                                   f"(--async-steps {self.K} allows versions {step - self.K}..{step})")
        self.run.rewards.faults.update(got["faults"])  # the worker's reward faults, as run totals
        self.metrics = {**got["metrics"], **staleness_metrics(samples, step),
                        "async/trainer_wait_s": time.perf_counter() - start}
        return samples

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self.weights.publish(model, version)

    @staticmethod
    def ref_logprobs(samples: list[Sample], batch) -> torch.Tensor:
        """[B, T] reference logprobs of `batch` (collated from `samples`), scored by the worker."""
        out = torch.zeros(batch.response_ids.shape)  # [B, T], 0 on padding as score_batch gives
        for b, s in enumerate(samples):
            out[b, :s.response_length] = torch.tensor(s.metadata["ref_logprobs"])
        return out.to(batch.response_ids.device)

    def save(self, path: str, step: int) -> None:
        """Finish batches step … step+K−1 and store them in `path` (module docstring: Checkpoints)."""
        need = range(step, min(step + self.K, self.run.cfg.steps))
        while any(b not in self.ready for b in need):
            self._receive()
        batches = [{**self.ready[b], "samples": [dataclasses.asdict(s) for s in self.ready[b]["samples"]]}
                   for b in need]
        torch.save({"K": self.K, "batches": batches}, os.path.join(path, FILE))

    def close(self) -> None:
        """Stop the worker: it finishes its batch, flushes its results (read off here and dropped)."""
        self.requests.put(None)
        deadline = time.monotonic() + 10.0
        while self.proc.is_alive() and time.monotonic() < deadline:
            try:
                self.results.get(timeout=0.1)
            except queue.Empty:
                pass
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join()
        _RUNNING.discard(self.proc)


_RUNNING: set = set()  # rollout workers not yet closed


def _stop_at_exit(proc) -> None:
    """End `proc` when the trainer's interpreter exits without close() (an error in the loop).
    multiprocessing's own exit handler joins every non-daemonic child, which would wait forever for a
    worker blocked on its next request; atexit runs handlers last-registered first, and this one is
    registered after multiprocessing's (queues and process start import multiprocessing.util, which
    registers it), so the worker gets SIGTERM before that join."""
    if not _RUNNING:
        atexit.unregister(_terminate_running)
        atexit.register(_terminate_running)
    _RUNNING.add(proc)


def _terminate_running() -> None:
    for proc in list(_RUNNING):
        if proc.is_alive():
            proc.terminate()
            proc.join(10.0)
        _RUNNING.discard(proc)


def staleness_metrics(samples: list[Sample], step: int) -> dict:
    """How far behind the trainer (version `step`) a batch is: per sample and per token."""
    ages = torch.tensor([step - s.weight_version for s in samples], dtype=torch.float)  # [N]
    tokens = [v for s in samples
              for v in s.metadata.get("token_versions", [s.weight_version] * s.response_length)]
    off = torch.tensor([v < step for v in tokens], dtype=torch.float)  # [tokens]
    m = {"async/staleness_mean": float(ages.mean()), "async/staleness_max": float(ages.max()),
         "async/offpolicy_token_frac": float(off.mean()) if len(off) else 0.0}
    if any("token_versions" in s.metadata for s in samples):
        spanning = sum(len(set(s.metadata["token_versions"])) > 1 for s in samples)
        m["async/partial_frac"] = spanning / len(samples)
        masked = sum(s.response_length - sum(s.loss_mask) for s in samples if s.loss_mask is not None)
        m["async/masked_token_frac"] = masked / max(1, len(tokens))
    return m


def start(run: Trainer, resumed: str | None = None) -> Pipeline:
    """The pipeline of `run` (cfg.async_steps > 0), with the batches a checkpoint at `resumed` holds."""
    if run.world > 1:
        raise ValueError("--async-steps with several ranks is not supported yet (one worker per rank, and "
                         "the ranks' batches in lockstep, are not built)")
    if run.cfg.engine != "hf":
        raise ValueError(f"--async-steps runs an HF engine in the worker; --engine {run.cfg.engine} is not "
                         "supported yet (pass --engine hf)")
    restored, file = {}, os.path.join(resumed, FILE) if resumed else ""
    if file and os.path.isfile(file):
        saved = torch.load(file, weights_only=True)  # verified by the checkpoint's manifest
        if saved["K"] == run.cfg.async_steps:
            restored = {x["batch"]: {**x, "samples": [Sample(**s) for s in x["samples"]]}
                        for x in saved["batches"]}
        else:  # their staleness was another K's: sample them again from the checkpoint's version
            run.logger.print(f"async: checkpoint saved with --async-steps {saved['K']}, now "
                             f"{run.cfg.async_steps}: its in-flight batches are dropped")
    return Pipeline(run, restored)
