"""Asynchronous RL (--async-steps K), the trainer's end: a rollout worker process
(nanorl/rollout_worker.py) samples and scores the next batches while the trainer trains on this one,
from weights at most K versions old; link 8 publishes each new version to it.

Start at `start` (train.py calls it) and `Pipeline.take` / `Pipeline.publish`. Key choices: a
process, not a thread (the tiny model's forwards hold the GIL: 1.40x vs 1.30x over synchronous,
measured); a deterministic staleness rule — batch b is sampled from version max(v0, b − K), so a
K > 0 run is a function of its seed; a checkpoint stores the batches already sampled ahead, so a
resume continues the very run. Several ranks: rank 0's worker samples every rank's prompts, rank 0
hands each rank its shard (`Follower` on the others), so R ranks train as one process on the union.
Versions go through shared memory, or with --engine vllm over a process group
(nanorl/weight_broadcast.py); with --fsdp every rank takes part in gathering each tensor of a version
from the shards, rank 0 writes it; with --lora-rank a version is the adapters alone (`version_state`).
DAPO's refill rounds run in the worker. --routing-replay: the worker's engine records each sample's
experts, which the trainer replays (`check_routing`). Design, metrics, measurements: docs/async.md.
Test: python -m pytest tests/test_pipeline.py -q
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import gc
import os
import pickle
import queue
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from nanorl import build, precision, weight_broadcast
from nanorl.distributed import full_tensors
from nanorl.partial_rollout import staleness_metrics
from nanorl.rollout import SamplingConfig, stop_token_ids
from nanorl.rollout_worker import WorkerSpec, _worker_main, sampled_from
from nanorl.shared_weights import SharedWeights, slot_layout
from nanorl.trajectory import TRAINS, Sample

FILE = "pipeline.pt"  # in a checkpoint directory: the batches a save finished (module docstring)


def start_method(device: str) -> str:
    """fork on CPU: the worker starts in ~0.1 s with everything imported. CUDA cannot fork: spawn
    re-imports torch and transformers (seconds) and re-runs a script that has no __main__ guard."""
    return "spawn" if torch.device(device).type == "cuda" or torch.cuda.is_initialized() else "fork"


def worker_device(device: str, environ: Mapping[str, str], count: int, current: int) -> tuple[str, dict]:
    """The rollout worker's device as its own process names it, and the environment it starts with.

    vLLM 0.32's in-process executor takes logical cuda:0 whatever device it is handed, so a worker
    meant for cuda:1 would put vLLM beside the trainer. The worker's process sees only its GPU
    (CUDA_VISIBLE_DEVICES, read once when CUDA initialises: set in the environment the spawned process
    starts with, before any import can touch CUDA) and calls it cuda:0. `device` is named as the
    trainer sees it: logical index i is the i-th entry of the trainer's own CUDA_VISIBLE_DEVICES
    (`environ`), if set; `count`: the CUDA devices the trainer sees; `current`: its current device
    (what a bare "cuda" means). A CPU device needs nothing: (device, {})."""
    d = torch.device(device)
    if d.type != "cuda":
        return device, {}
    index = current if d.index is None else d.index
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    entries = [x.strip() for x in visible.split(",")] if visible is not None else list(map(str, range(count)))
    if not 0 <= index < min(count, len(entries)):
        raise ValueError(f"--rollout-device {device}: the trainer's process sees {count} CUDA device(s)")
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": entries[index]}


@contextlib.contextmanager
def _environment(extra: dict):
    """os.environ with `extra` set while a process starts: a spawned process starts with the parent's
    environment of that moment. The trainer's own CUDA is initialised already: it is not affected."""
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
    episodes: Any  # EpisodeRunner (--env), AgentRunner (--agent) or None: .faults, the run totals
    logger: Any  # .print(str)
    counters: dict  # the run's counters: the worker's (DAPO's gave-up steps) are added to them
    plan: Any  # nanorl/plan.py Plan: whether the worker also samples ReMax's greedy baselines
    step: int  # the version the worker starts from
    rank: int  # this process's rank: rank 0 runs the worker
    world: int  # ranks: each trains its shard of every batch


class Pipeline:
    """The trainer's end: submits prompt batches, takes scored ones, publishes weights, saves what
    is in flight. Batches are taken in order, one per step. Batch t+K+1's prompts are submitted as t
    is taken: the worker then always holds its next request, so its idle time is waiting for weights."""

    def __init__(self, run: Trainer, restored: dict[int, dict]):
        cfg, self.run, self.K = run.cfg, run, run.cfg.pipeline.async_steps
        # as the trainer names it
        device = cfg.pipeline.rollout_device or str(next(run.model.parameters()).device)
        ctx = mp.get_context(start_method(device))
        # a bare "cuda" is the current device (0 before CUDA initialises)
        current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        inside, env = worker_device(device, os.environ, torch.cuda.device_count(), current)
        dtype, trainer_device = precision.compute_dtype(cfg.memory.dtype), next(run.model.parameters()).device
        # an engine with weights of its own (vLLM) takes each version over a process group
        # (nanorl/weight_broadcast.py); the HF engine samples from the worker's module, loaded from
        # shared memory
        self.broadcast = build.engine_class(cfg, device).holds_own_weights
        if self.broadcast:
            layout, size = slot_layout(run.model, dtype)
            backend = weight_broadcast.backend_for(trainer_device, torch.device(device))
            channel = weight_broadcast.ChannelSpec(weight_broadcast.free_port(), backend, layout, size,
                                                   slots=self.K + 2, device=device)
            self.weights, to_worker = weight_broadcast.Sender(channel, trainer_device), channel
        else:  # versions in shared memory
            self.weights = to_worker = SharedWeights(run.model, self.K, ctx, dtype)
            self.weights.publish(run.model, run.step)
        self.v0 = run.step
        sampling = SamplingConfig(temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k,
                                  top_p=cfg.sampling.top_p,
                                  max_new_tokens=cfg.max_new_tokens,
                                  keep_support=cfg.sampling.keep_sampling_mask,
                                  stop_token_ids=stop_token_ids(run.model, run.tokenizer),
                                  support_cap=cfg.sampling.support_cap)
        # The worker draws nothing: this loader, a copy of the trainer's, draws batch b's prompts ahead;
        # rl_step draws the same ones from run.loader and `take` checks they agree (unless the worker
        # draws its own: `own_prompts`).
        self.own_prompts = own_prompts(cfg)
        self.loader = copy.copy(run.loader)
        self.loader.load_state_dict(run.loader.state_dict())  # its own order list and position
        self.loader.rank, self.loader.world = 0, 1  # every rank's prompts: the worker samples the union
        self.ready, self.submitted, self.metrics, carry = {}, run.step, {}, None
        for b in range(run.step, run.step + self.K):
            if b in restored:  # finished before the checkpoint: its prompts are already drawn
                self.ready[b] = restored[b]
                carry = restored[b].get("carry")
                if not self.own_prompts:
                    self.loader.next_batch()
                self.submitted = b + 1
            else:
                break
        spec = WorkerSpec(cfg, inside, sampling, run.step, greedy_baselines=run.plan.greedy_baselines,
                          longest_prompt=max(len(p.ids) for p in run.loader.prompts), world=run.world,
                          loader=self.loader if self.own_prompts else None, carry=carry)
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        # daemon=False: the worker runs bounded rewards (--reward math's default timeout) in a process
        # pool, which a daemonic process may not start; the trainer's exit still ends it (_stop_at_exit)
        self.proc = ctx.Process(target=_worker_main, args=(spec, to_worker, self.requests, self.results),
                                daemon=False, name="nanorl-rollout")
        # Objects the fork inherits stay out of the child's garbage collector: an inherited process
        # group (a vLLM engine closed earlier in this process, a previous run's weight channel) would
        # be collected there, and its destructor joins threads that only exist here (it hung: seen
        # with vLLM in the worker after a vLLM test in the same pytest process).
        gc.freeze()
        try:
            with _environment(env):  # the worker's GPU, the only one it sees (worker_device)
                self.proc.start()
        finally:
            gc.unfreeze()
        _stop_at_exit(self.proc)
        if self.broadcast:  # the worker opens its end first thing; the first version goes at once
            self.weights.connect()
            self.weights.publish(run.model, run.step)
        self._fill(run.step + self.K)

    def _fill(self, upto: int) -> None:
        """Submit every batch up to `upto` (never past the run's last step)."""
        while self.submitted <= min(upto, self.run.cfg.steps - 1):
            self.requests.put((self.submitted, None if self.own_prompts else self.loader.next_batch()))
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
        """Batch `step`'s scored samples (blocking), checked against the staleness bound; with several
        ranks this rank's shard, the others' sent to them (`shards`)."""
        self._fill(step + self.K + 1)  # prompts only: the worker waits for batch b's version itself
        need, latest = sampled_from(step, self.K, self.v0), self.weights.newest()
        if latest < need:  # the worker would wait for it forever, and this for the worker
            raise RuntimeError(f"async rollout: batch {step} is sampled from version {need}, but the newest "
                               f"published is {latest}: publish() the weights after every step")
        start = time.perf_counter()
        while step not in self.ready:
            self._receive()
        got = self.ready.pop(step)
        if self.run.world > 1:
            got = _scatter(shards(got, self.run.world))
        self.metrics = accept(self.run, step, prompts, got, waited=time.perf_counter() - start)
        return got["samples"]

    def publish(self, model: torch.nn.Module, version: int) -> None:
        try:
            self.weights.publish(model, version)
        except RuntimeError:  # a broken transfer (vLLM worker): the worker's own error says why
            self.proc.join(10.0)
            while True:
                try:
                    self._receive()  # raises the worker's error, or that it died
                except queue.Empty:
                    break
            raise

    @staticmethod
    def ref_logprobs(samples: list[Sample], batch) -> torch.Tensor:
        """[B, T] reference logprobs of `batch` (collated from `samples`), scored by the worker."""
        out = torch.zeros(batch.response_ids.shape)  # [B, T], 0 on padding as score_batch gives
        for b, s in enumerate(samples):
            out[b, :s.response_length] = torch.tensor(s.ref_logprobs)
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
            # SIGTERM runs the worker's handler only between bytecodes: a worker blocked in C (a
            # collective, a futex) never sees it, so it is killed if still there
            self.proc.join(10.0)
        if self.proc.is_alive():
            print("async rollout: the worker did not end on SIGTERM; killed")
            self.proc.kill()
        self.proc.join()
        _RUNNING.discard(self.proc)
        if isinstance(self.weights, weight_broadcast.Sender):  # its group's threads end here, not later
            self.weights.close()


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


def own_prompts(cfg) -> bool:
    """Whether the worker draws its own prompts from a copy of the loader, the trainer's going unused:
    how many a batch takes depends on its buffer (--partial-rollout abort) or its rewards (DAPO's
    refill rounds, --filter-groups)."""
    return cfg.pipeline.partial_rollout == "abort" or cfg.dapo.filter_groups


def accept(run: Trainer, step: int, prompts, got: dict, waited: float) -> dict:
    """Check a scored batch (or shard) before it trains, add the worker's faults to the run totals;
    returns the step's async metrics."""
    K, abort = run.cfg.pipeline.async_steps, run.cfg.pipeline.partial_rollout == "abort"
    if not own_prompts(run.cfg) and got["prompt_ids"] != [p.ids for p in prompts]:
        raise RuntimeError(f"async rollout: batch {step} was sampled for other prompts than the trainer's")
    # the bound this module promises, never trusted silently; a resumed sample's oldest tokens are
    # one batch older (nanorl/partial_rollout.py)
    oldest = step - K - abort
    for s in got["samples"]:
        if not oldest <= s.weight_version <= step:
            raise RuntimeError(f"async rollout: a sample of version {s.weight_version} reached step {step} "
                               f"(--async-steps {K} allows versions {oldest}..{step})")
    if run.cfg.memory.routing_replay:  # every training forward replays the routing the batch carries
        check_routing(got["samples"], step)
    run.rewards.faults.update(got["faults"])  # the worker's reward faults, as run totals
    for name, faults in got.get("scorer_faults", {}).items():  # its reward model's / judge's
        run.scorers[name].faults.update(faults)
    if run.episodes is not None:  # and its environments' or agent's (env_error, tool_timeout; agent_faults)
        run.episodes.faults.update(got["env_faults"])
    for k, v in got.get("counters", {}).items():  # DAPO's steps that ran out of rounds
        run.counters[k] = run.counters.get(k, 0) + v
    for note in got.get("notes", []):
        run.logger.print(note)
    return {**got["metrics"], **staleness_metrics(got["samples"], step), "async/trainer_wait_s": waited}


def check_routing(samples: list[Sample], step: int) -> None:
    """--routing-replay: each sample that trains carries the experts its own sampling forward chose
    (the worker's engine records them: Sample.routed_experts), recorded under the version that sampled
    it; the trainer replays them in every forward of the step (π_old included: scoring.routing_forward)."""
    for s in samples:
        if s.routed_experts is None and s.status in TRAINS:
            raise RuntimeError(f"async rollout with --routing-replay: a sample of batch {step} carries no "
                               "routed experts (its source records none): there is no rollout routing to "
                               "replay")
        if s.routed_experts is not None and s.routing_version != s.weight_version:
            raise RuntimeError(f"async rollout: a sample of version {s.weight_version} reached step {step} "
                               f"with routing recorded under version {s.routing_version}")


def shards(got: dict, world: int) -> list[dict]:
    """A batch of every rank's prompts → one batch per rank, as each rank's own loader shards prompts
    (rank r: prompts r, r + world, ...; data.PromptLoader) with group ids renumbered from 0. The
    worker's fault counts, counters and notes go with rank 0's shard only, so the run totals (summed
    over ranks) count each once."""
    out = []
    for r in range(world):
        samples = [dataclasses.replace(s, group_id=s.group_id // world)
                   for s in got["samples"] if s.group_id % world == r]
        out.append({**got, "prompt_ids": got["prompt_ids"][r::world], "samples": samples,
                    **({} if r == 0 else {"faults": {}, "env_faults": {}, "scorer_faults": {}, "counters": {},
                                           "notes": []})})
    return out


def _scatter(per_rank: list[dict] | None) -> dict:
    """Rank 0 sends rank r its shard (the others pass None); every rank returns its own."""
    import torch.distributed as dist
    mine = [None]
    dist.scatter_object_list(mine, per_rank, src=0)
    return mine[0]


class Follower:
    """The pipeline end of a rank > 0: rank 0's worker samples its prompts with everyone's, rank 0
    sends it its shard (`shards`); it writes no version (every rank holds the same weights after a
    step, and rank 0's version is the one the worker loads) and saves nothing (rank 0's checkpoint
    holds the whole batches in flight). With --fsdp each tensor of a version is gathered from every
    rank's shard (distributed.full_tensors): this rank takes part in every gather of rank 0's publish,
    the first version's included, in rank 0's layout and order, and keeps nothing."""

    def __init__(self, run: Trainer):
        self.run, self.metrics, self.layout = run, {}, None
        if run.cfg.memory.fsdp:
            dtype = precision.compute_dtype(run.cfg.memory.dtype)
            self.layout = slot_layout(run.model, dtype)[0]
        # rank 0's Pipeline publishes the starting version as it starts
        self.publish(run.model, run.step)

    def take(self, step: int, prompts) -> list[Sample]:
        start = time.perf_counter()
        got = _scatter(None)
        self.metrics = accept(self.run, step, prompts, got, waited=time.perf_counter() - start)
        return got["samples"]

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Rank 0 publishes `version` alone; with --fsdp this rank's shards go into its gathers."""
        if self.layout is not None:
            for _ in full_tensors(model.state_dict(), self.layout):
                pass

    ref_logprobs = staticmethod(Pipeline.ref_logprobs)

    def save(self, path: str, step: int) -> None:
        """Nothing: rank 0's pipeline.pt holds every rank's batches in flight (checkpoint.save calls
        every rank's)."""

    def close(self) -> None:
        pass


class WorkerScored:
    """The trainer's side of a reward component (--reward-model, --judge) that the rollout worker
    scores: its fault totals (logged as reward_faults/<name>/..., saved in checkpoints), nothing else."""

    def __init__(self):
        self.faults = Counter()

    def score(self, prompts, responses, labels) -> list:
        raise RuntimeError("async rollout: the rollout worker scores this reward component")

    def close(self) -> None:
        """Nothing held here."""


def start(run: Trainer, resumed: str | None = None) -> Pipeline | Follower:
    """The pipeline of `run` (cfg.pipeline.async_steps > 0), with the batches a checkpoint at `resumed`
    holds."""
    if run.rank > 0:  # rank 0's worker samples this rank's prompts too
        return Follower(run)
    restored, file = {}, os.path.join(resumed, FILE) if resumed else ""
    if file and os.path.isfile(file):
        saved = torch.load(file, weights_only=True)  # verified by the checkpoint's manifest
        if saved["K"] == run.cfg.pipeline.async_steps:
            restored = {x["batch"]: {**x, "samples": [Sample(**s) for s in x["samples"]]}
                        for x in saved["batches"]}
        else:  # their staleness was another K's: sample them again from the checkpoint's version
            run.logger.print(f"async: checkpoint saved with --async-steps {saved['K']}, now "
                             f"{run.cfg.pipeline.async_steps}: its in-flight batches are dropped")
    return Pipeline(run, restored)
