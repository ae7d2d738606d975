"""The rollout worker of asynchronous RL (--async-steps K): a process of its own that samples and
scores batch b from weight version `sampled_from(b, K, v0)` while the trainer trains on an older
batch. nanorl/pipeline.py is the trainer's end, which starts it and reads what it sends.

Start at `_worker_main` (the process's loop) and `Worker.rollout` (one batch). Versions arrive in
shared memory (nanorl/shared_weights.py, the HF engine) or over a process group (weight_broadcast.Receiver,
--engine vllm); the worker holds its own model copy, engine, reward runner and (with a KL term) the
frozen reference, so everything but the policy update leaves the trainer's step. With --lora-rank the
copy is the frozen base with the run's adapters (a version brings only them), the reference that copy
with its adapters off, and vLLM gets from it what the synchronous sync hands over (merged or adapter).
ReMax's greedy baselines, --env's episodes and --agent's (its endpoint served here:
build.sample_source) are sampled here too, from the batch's own weights; DAPO's refill rounds
(--filter-groups, over-sampled with --over-sample) run here on the worker's own prompts. Partial rollouts
(--partial-rollout abort) buffer unfinished groups and resume them (nanorl/partial_rollout.py); with
--filter-groups they abort once the batch has its KEPT groups (partial_rollout.GroupFilter). Design and
measurements: docs/async.md.
Test: python -m pytest tests/test_pipeline.py tests/test_agent_async.py tests/test_async_lora.py -q
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import pickle
import queue
import signal
import time
import traceback
from multiprocessing import forkserver

import torch
import torch.multiprocessing as mp

from nanorl import build, lora, moe_replay, precision, rounds, weight_broadcast
from nanorl.data import Prompt, PromptFormat
from nanorl.distributed import Trained
from nanorl.logger import PhaseTimer
from nanorl.partial_rollout import AbortingRollout, GroupFilter, mask_older_tokens
from nanorl.plugins import Hooks
from nanorl.policy import frozen_copy, load_model
from nanorl.rewards import RewardRunner, load_reward_fn
from nanorl.rollout import SamplingConfig
from nanorl.scoring import Scoring, forward, score_batch
from nanorl.trajectory import Sample, collate


def sampled_from(b: int, K: int, v0: int) -> int:
    """The staleness rule: the weight version batch b is sampled from (nanorl/pipeline.py's docstring)."""
    return max(v0, b - K)


def batch_seed(seed: int, b: int) -> int:
    """The sampling seed of batch b: fixed by (run seed, batch), whatever ran before it."""
    return seed * 1_000_003 + b


@dataclasses.dataclass
class WorkerSpec:
    """What the worker process needs (picklable: the spawn start method sends it)."""
    cfg: object               # the run's Config: model, dtype, reward, KL, async flags
    device: str               # as the worker's process names it (cuda:0: pipeline.worker_device)
    sampling: SamplingConfig  # the run's sampling; the worker sets its per-batch seed
    start_version: int        # v0: the version the trainer starts from (0, or the resumed step)
    greedy_baselines: bool = False  # the estimator reads ReMax's baselines (plan.greedy_baselines)
    longest_prompt: int = 0   # --engine vllm: its max_model_len is sized from it (build.vllm_engine)
    world: int = 1            # trainer ranks: prompt g goes to rank g % world (pipeline.shards)
    loader: object = None     # --partial-rollout abort, --filter-groups: the worker draws its own prompts
    carry: dict | None = None  # what a checkpoint saved of them (a resume): the buffer, the loader


# ----------------------------------------------------------------------------- the worker process


class Worker:
    """The rollout side: its own model copy, engine, reward runner and (with a KL term) frozen
    reference model, one batch per request. With --engine vllm the weights arrive over a process group
    (weight_broadcast.Receiver, into host memory) and are copied into the model copy as a batch needs
    them; it streams them into vLLM and is what vLLM's sync check compares against: the worker's device
    holds the version it samples from twice (this copy and vLLM's; once with --sync-check-every 0),
    whatever --async-steps. Otherwise the HF engine samples from the model copy itself."""

    def __init__(self, spec: WorkerSpec, weights):
        cfg, dtype = spec.cfg, precision.compute_dtype(spec.cfg.memory.dtype)
        self.spec, self.cfg, self.weights = spec, cfg, weights
        # The starting --model in fp32 on the host, never on the trainer's GPU: the engine samples in
        # the compute dtype (autocast), so with bf16/fp16 it holds a frozen copy in that dtype (the
        # slots' dtype); with fp32 it is the loaded model itself, as before.
        base, self.tokenizer = load_model(cfg.model, "cpu", dtype)
        # --routing-replay: the engine records the experts of every token it samples and the reference
        # (a copy of this) replays them, as the trainer's own patched module does (build.load_policy)
        if cfg.memory.routing_replay:
            moe_replay.patch(base)
        if cfg.memory.fp32_lm_head:  # the trainer's numerics, so rollout logprobs match its recompute
            precision.keep_lm_head_fp32(base)
        # --lora-rank: the trainer's adapters on this frozen base, as build.load_policy puts them; each
        # version brings only the adapters (weight_broadcast.version_state), copied into these
        if cfg.lora.rank:
            lora.apply(base, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
        base.requires_grad_(False)
        # The reference is the starting --model, frozen, as the trainer's (train.py setup): scoring it
        # here takes its forward off the trainer's side of the step, where it would not overlap. With
        # LoRA it is this worker's model copy with its adapters off (below): the base, held once.
        score = functools.partial(forward, cfg)
        self.ref = None if not cfg.uses_reference or cfg.lora.rank else \
            Trained(frozen_copy(base, dtype).to(spec.device), None, score, dtype)
        # With vLLM this copy is what its sync check scores and what is streamed into vLLM: on the GPU
        # only when a check runs (--sync-check-every > 0) or it is LoRA's reference too; else in host
        # memory, vLLM copying each tensor over as it loads, and the worker's GPU holds no copy of its own
        kind = build.engine_class(cfg, spec.device)
        on_device = not kind.holds_own_weights or cfg.vllm.sync_check_every or \
            (cfg.lora.rank and cfg.uses_reference)
        home = spec.device if on_device else "cpu"
        # frozen_copy keeps the adapters (its deep copy takes PEFT's wrapper along: lora.peft_of)
        model = (base if dtype == torch.float32 else frozen_copy(base, dtype)).to(home)
        del base
        if cfg.lora.rank and cfg.uses_reference:
            self.ref = lora.Reference(lora.peft_of(model), Trained(model, None, score, dtype))
        self.scoring = Scoring(cfg, model, self.tokenizer)
        self.params = model.state_dict()  # views of the module's tensors: loading copies into them
        for names, dt, shape, _ in weights.layout:  # the trainer's layout must fit this model exactly
            for n in names:
                t = self.params.get(n)
                if t is None or t.dtype != dt or tuple(t.shape) != shape:
                    got = None if t is None else (t.dtype, tuple(t.shape))
                    raise RuntimeError(f"async worker: {n} is {got} here, the trainer sends {(dt, shape)}")
        # what one version carries (the full policy, or with LoRA its adapters), logged per batch
        self.version_mib = sum(math.prod(shape) * dt.itemsize for _, dt, shape, _ in weights.layout) / 2**20
        self.engine = build.worker_engine(cfg, kind, model, self.tokenizer.pad_token_id, dtype,
                                          spec.longest_prompt)
        if cfg.memory.routing_replay and not self.engine.records_routing:
            # the trainer would record its own routing (R2) while this reference scored unreplayed
            raise ValueError(f"--async-steps with --routing-replay needs an engine that records routing: "
                             f"{type(self.engine).__name__} on {spec.device} records none (vLLM records "
                             "it only on a GPU); use --engine hf, or run synchronously")
        self.sync_metrics = {}  # the last sync check's figures (vLLM), sent with the next batch
        self.rewards = RewardRunner(load_reward_fn(cfg.reward), timeout=cfg.reward_timeout, log=print)
        # --reward-model, --judge: their components beside --reward, scored here as the synchronous step
        # scores them (the trainer holds only their fault totals: pipeline.WorkerScored)
        self.scorers = build.make_scorers(cfg, spec.device, dtype, log=print)
        self.reward_weights, self.hooks = build.reward_weights(cfg), Hooks(cfg)
        # where samples come from, over this engine, chosen as train.py's setup chooses over the trainer's:
        # the engine, --env's multi-turn driver, or --agent's endpoint (served here, on 127.0.0.1 with
        # its own token, while a batch is sampled; closed with this process: _worker_main)
        fmt = PromptFormat(cfg.prompts.system_prompt, cfg.prompts.prompt_template, cfg.prompts.chat_template,
                           cfg.chat_template_dict)
        self.episodes, self.source = build.sample_source(cfg, self.engine, self.tokenizer, fmt)
        self.engine.version = -1  # nothing loaded yet
        self.partial = None  # --partial-rollout abort: the buffer of aborted groups and the prompt stream
        if cfg.pipeline.partial_rollout == "abort":
            # scored as rounds.scored scores: --reward, the reward model's and judge's components
            self.partial = AbortingRollout(self.source, self.engine,
                                           lambda p, s: rounds.score(self.sampler(-1, {}, []), p, s),
                                           spec.loader, cfg.prompts_per_step, cfg.samples_per_prompt,
                                           cfg.dapo.over_sample)
            if spec.carry is not None:
                self.partial.load_state_dict(spec.carry)
        self.loader = None  # --filter-groups: how many prompts a batch takes depends on its rewards
        if cfg.dapo.filter_groups and self.partial is None:  # with abort the buffer's rounds draw them
            self.loader = spec.loader
            if spec.carry is not None:
                self.loader.load_state_dict(spec.carry["loader"])

    @torch.no_grad()
    def load(self, version: int) -> None:
        if self.engine.holds_own_weights and version == self.engine.version:
            return  # vLLM holds it already, checked when it was loaded
        done = set()
        for k, view in self.weights.slot(version).items():
            t = self.params[k]
            if t.data_ptr() not in done:  # tied names: one tensor, copied once
                done.add(t.data_ptr())
                # from pinned host slots (weight_broadcast.Receiver) the copies queue up: one wait for all
                t.copy_(view, non_blocking=True)
        if next(self.scoring.model.parameters()).is_cuda:  # read out before the slot may be reused
            torch.cuda.synchronize()
        self.weights.release(version)
        # the synchronous run's load and check (stages.sync): vLLM streams the copy in and compares; the
        # HF engine samples from the copy itself (nothing to load, nothing to compare)
        model = self.scoring.model
        self.engine.update_weights(model, version)
        every = self.cfg.vllm.sync_check_every
        if every and version % every == 0:
            self.sync_metrics = {f"sync/{k}": v for k, v in self.engine.check_sync(model).items()}

    def rollout(self, b: int, prompts: list) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        need = sampled_from(b, cfg.pipeline.async_steps, self.spec.start_version)
        while not self.weights.wait_for(need, timeout=5.0):
            _exit_if_orphaned()
        t1 = time.perf_counter()
        self.load(need)
        t_load = time.perf_counter()
        faults, env_faults = dict(self.rewards.faults), dict(self.episodes.faults if self.episodes else {})
        scorer_faults = {name: dict(s.faults) for name, s in self.scorers.items()}
        sampling = dataclasses.replace(self.spec.sampling, seed=batch_seed(cfg.seed, b))
        carry, partial_metrics, refill = {}, {}, {}
        if self.partial is not None:  # the worker's own prompts: the buffer first, then fresh ones
            keep = None  # --filter-groups: the batch's groups are the KEPT ones, judged as they finish
            if cfg.dapo.filter_groups:
                refill = {"counters": {}, "notes": []}
                keep = GroupFilter(self.sampler(b, refill["counters"], refill["notes"]),
                                   cfg.dapo.max_gen_batches)
            prompts, samples, partial_metrics = self.partial.batch(sampling, keep)
            carry = {"carry": self.partial.state_dict()}  # a checkpoint resumes from the last one saved
        elif self.loader is not None:  # DAPO: rounds of the worker's own prompts until the batch is full
            prompts, samples, partial_metrics, refill = self.refilled(b, sampling)
            carry = {"carry": {"loader": self.loader.state_dict()}}
        else:
            samples = self.scored(b, prompts, cfg.samples_per_prompt, sampling)
        t2 = time.perf_counter()
        if cfg.pipeline.mask_offpolicy_in_partial_rollout:
            for s in samples:
                mask_older_tokens(s)
        if self.spec.greedy_baselines:
            for s, r in zip(samples, self.greedy_rewards(prompts)):
                s.greedy_baseline = r
        t3 = time.perf_counter()
        if self.ref is not None:  # on each rank's shard, as that rank's recompute would score it
            for r in range(self.spec.world):
                self.score_reference([s for s in samples if s.group_id % self.spec.world == r])
        new_faults = since(faults, self.rewards.faults)
        # load: the version into the engine (vLLM: its reload and sync check); generate: sampling + reward
        timing = {"async/engine_wait_s": t1 - t0, "async/load_s": t_load - t1,
                  "async/generate_s": t2 - t_load, "async/reward_s": t3 - t2,
                  "async/reference_s": time.perf_counter() - t3, "async/version_mib": self.version_mib,
                  **self.sync_metrics, **partial_metrics}
        self.sync_metrics = {}  # reported with the batch of the version it checked, once
        return {"batch": b, "prompt_ids": [p.ids for p in prompts], "samples": samples, "faults": new_faults,
                "env_faults": since(env_faults, self.episodes.faults) if self.episodes else {},
                "scorer_faults": {n: since(scorer_faults[n], s.faults) for n, s in self.scorers.items()},
                "metrics": timing, **carry, **refill}

    def refilled(self, b: int, sampling: SamplingConfig) -> tuple[list, list[Sample], dict, dict]:
        """--filter-groups: DAPO's dynamic sampling exactly as the synchronous step runs it (its first
        round, F× over-sampled with --over-sample; keep_trainable; the refill rounds: one call,
        rounds.dynamic_sampling), on this worker's prompts, engine and weights. Returns the kept groups'
        prompts (group ids 0..), their samples (--reward-postprocess applied before the filter read
        them, as in the step), the rounds' metrics (dapo/*, groups_kept_frac, dropped_frac), and the run
        counters and notes they added (a step that ran out of rounds), which the trainer adds to its own
        (pipeline.accept)."""
        notes, counters, metrics = [], {}, {}
        prompts = self.loader.next_batch()
        # the first round took the batch's seed; each later round takes its own (SamplingConfig.call)
        kept = rounds.dynamic_sampling(self.sampler(b, counters, notes), prompts, sampling, PhaseTimer(),
                                       metrics)
        # a kept group may have lost samples (failed ones, --sample-filter): its prompt from any of them
        ids = {s.group_id: s.prompt_ids for s in kept}
        kept_prompts = [Prompt(ids[g], "", "") for g in sorted(ids)]
        return kept_prompts, kept, metrics, {"counters": counters, "notes": notes}

    def sampler(self, b: int, counters: dict, notes: list) -> rounds.Sampler:
        """What drawing samples reads (rounds.Sampler): this worker's parts, one rank (it samples the
        union of the ranks' prompts); `counters` and `notes` collect what they add."""
        return rounds.Sampler(self.cfg, self.source, self.engine, self.loader,
                              self.rewards, self.scorers, self.reward_weights, self.tokenizer, self.hooks, 1,
                              counters, b, Notes(notes))

    def scored(self, b: int, prompts: list, n: int, sampling: SamplingConfig) -> list[Sample]:
        """n scored samples per prompt, as the synchronous step makes them (rounds.scored):
        the engine's, scored by --reward with the reward model's and judge's components beside it, or
        --env's or --agent's episodes, which the environment or the agent scored."""
        return rounds.scored(self.sampler(b, {}, []), prompts, n, sampling)

    def greedy_rewards(self, prompts: list) -> list[float]:
        """ReMax's baseline of each sample (in row order): the reward of its prompt's greedy response,
        sampled here from the same weights as the batch (train.py's stages.greedy_baselines, which
        reads it, samples it from the trainer's: the same version in a synchronous run)."""
        greedy = self.scored(-1, prompts, 1, dataclasses.replace(
            self.spec.sampling, temperature=0.0, top_k=0, top_p=1.0, keep_support=False, seed=None))
        n = self.cfg.samples_per_prompt
        return [greedy[g].total_reward for g in range(len(prompts)) for _ in range(n)]

    @torch.no_grad()
    def score_reference(self, samples: list[Sample]) -> None:
        """Reference logprobs of every response token, as train.py's recompute would score them (the
        same collated batch and micro-batches): Sample.ref_logprobs, read by `ref_logprobs`."""
        batch = collate(samples, self.tokenizer.pad_token_id).to(self.spec.device)
        support = batch.sampling_support if self.cfg.sampling.keep_sampling_mask else None
        lp = score_batch(self.scoring, self.ref, batch, support)[0].cpu()  # [B, T]
        for s, row in zip(samples, lp):
            s.ref_logprobs = row[:s.response_length].tolist()


@dataclasses.dataclass
class Notes:
    """A logger whose lines are kept (`lines`), to go to the trainer with the batch."""
    lines: list

    def print(self, line: str) -> None:
        self.lines.append(line)


def since(before: dict, now: dict) -> dict:
    """The fault counts added since `before` (a run total's increments, sent to the trainer)."""
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


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


def _own_forkserver() -> None:
    """Forget the trainer's forkserver, which the fork copied as multiprocessing's module-level handle.
    Reward pools start by forkserver once vLLM is loaded (nanorl/rewards.py pool_start_method); asking
    the inherited server for a process calls os.waitpid on a process that is not this one's child:
    ChildProcessError (ECHILD) at the first reward of an async vLLM run whose trainer had scored one.
    Cleared, the first pool here starts a server of its own. (multiprocessing keeps no public reset.)"""
    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        os.close(server._forkserver_alive_fd)  # the trainer's server stops with the trainer, not with us
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None


def _worker_main(spec: WorkerSpec, weights, requests, results) -> None:
    # Ctrl-C reaches the whole process group; the trainer handles it (finishes the step and saves,
    # which needs this worker).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Not daemonic (a daemonic process cannot start the reward runner's worker pool), so it ends
    # itself: on SIGTERM (close(), the trainer's exit: `_stop_at_exit`) and when orphaned.
    signal.signal(signal.SIGTERM, _leave)
    torch.set_num_threads(spec.cfg.memory.threads or 1)
    _own_forkserver()
    # The one GPU the trainer left visible (pipeline.worker_device), current before anything allocates:
    # a kernel launched on the current device (Triton's, nanorl/entropy.py) must find its tensors there
    if torch.device(spec.device).type == "cuda":
        torch.cuda.set_device(torch.device(spec.device))
    _PARENT.append(os.getppid())
    worker = None
    try:
        if isinstance(weights, weight_broadcast.ChannelSpec):  # --engine vllm: over a process group
            weights = weight_broadcast.Receiver(weights)
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
    if worker is not None:  # its reward (and tool) worker processes: this exit would wait for them
        worker.rewards.close()
        for scorer in worker.scorers.values():  # a judge's threads, a reward model
            scorer.close()
        if worker.episodes is not None:
            worker.episodes.close()
    results.close()
    results.join_thread()  # what was put reaches the pipe before exit (close() reads it off)
    # Out now, not through the interpreter's teardown: with --engine vllm this process holds process
    # groups (its weight channel, vLLM's own) whose destructors wait on the trainer's end, which waits
    # for this exit — it hung until gloo's 30-minute timeout (seen in CI), deaf to SIGTERM meanwhile.
    _leave()
