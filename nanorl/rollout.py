"""Rollout: turn prompts into sampled responses.

Link 1 of the chain (rollout). A rollout engine takes prompt token ids and returns `Sample` records
(nanorl/trajectory.py): the response tokens, their status (completed when a stop token was sampled,
truncated when `max_new_tokens` ran out) and the log-probability of every sampled token *under exactly
the distribution it was sampled from* — the trainer later compares those with its own recompute (the
train/rollout logprob gap, TIS, ICEPOP):

    rollout_logprob = log softmax(logits / temperature)[token]              (default)
    rollout_logprob = log softmax(mask_support(logits / temperature))[token] (--keep-sampling-mask)

With keep-sampling-mask the trainer recomputes on that same support (nanorl/sampling.py). Two engines
implement the contract `RolloutEngine` (`generate`, `update_weights`, what they declare): `HFEngine`
(here; start there), a batched sampling loop over a Hugging Face causal LM with a KV cache that shares
the policy module with the trainer, so a weight "sync" is free and exact (with --async-steps the rollout
worker's HFEngine holds its own copy: nanorl/pipeline.py); and `VLLMEngine` (nanorl/vllm_engine.py).

Try it: `python -m pytest tests/test_rollout.py -q`.
"""
from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from nanorl.precision import autocast
from nanorl.sampling import sample_next, stack_steps
from nanorl.trajectory import Sample


@dataclass
class SamplingConfig:
    """How to sample. top_k=0 and top_p=1.0 switch those filters off; temperature=0 is greedy."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 8
    stop_token_ids: tuple[int, ...] = ()
    # record the kept top-k/top-p support per token (keep-sampling-mask)
    keep_support: bool = False
    # at most this many kept ids stored per token (nanorl/sampling.py)
    support_cap: int = 64
    seed: int | None = None

    def call(self, i: int) -> SamplingConfig:
        """This sampling for engine call i of a batch seeded `seed` (a batch may take several: DAPO's
        refill rounds, resumed partial samples): call 0 keeps the batch's seed, call i > 0 gets its
        own, drawn from a generator seeded by (seed, i), so no two calls share a random stream and a
        batch is a function of its seed on every engine (vLLM draws an unseeded request from its
        process-wide stream, which a resumed worker has not replayed). No seed: none for any call."""
        if self.seed is None or i == 0:
            return self
        g = torch.Generator().manual_seed(self.seed * 1009 + i)
        return replace(self, seed=int(torch.randint(2**31 - 1, (1,), generator=g)))


class RolloutEngine:
    """The contract every engine implements (HFEngine here, VLLMEngine in nanorl/vllm_engine.py): two
    methods it must define, what it declares, and the calls a trainer may make of any engine, which do
    nothing where the engine has nothing to do. The trainer and the rollout worker read only these.

    holds_own_weights: False: it samples from a torch module whose weights are the trainer's own or an
        exact copy (a sync is free and exact); True: it holds a copy of its own (vLLM), which the trainer
        streams into, `check_sync` compares, and `sleep` may free between rollouts; a version it holds
        needs no second load.
    max_model_len: the longest sequence, prompt + response, it accepts (None: no limit of its own).
    adapters: LoRA's adapter sync (nanorl/engine_weights.py AdapterSync) where the engine serves the
        trainer's adapters on its own base weights (vLLM, --lora-sync adapter); None: it loads weights.
    records_routing: its samples carry the MoE experts each token used (Sample.routed_experts, with
        the version that recorded them in Sample.routing_version) for routing replay (R3)."""
    holds_own_weights = False
    records_routing = False
    max_model_len = None
    adapters = None
    # the version last loaded (update_weights): what its samples carry, and an --agent episode that
    # failed before sampling (nanorl/agent.py)
    version = 0

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[Sample]:
        """`len(prompts) * n` samples; prompt i's n samples are consecutive with group_id = i."""
        raise NotImplementedError

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        """Load the trainer's current weights; samples generated afterwards carry `version`. An engine
        with weights of its own loads what `engine_weights.to_load(model, dtype, self.adapters)` hands
        it: the full tensors (LoRA: merged) under checkpoint names, one at a time, or the adapters."""
        raise NotImplementedError

    def sampled_module(self) -> torch.nn.Module | None:
        """The torch module it samples from (None: its weights live elsewhere)."""
        return None

    def rng(self) -> torch.Generator | None:
        """Its sampler's torch generator, which checkpoints save (None: it keeps its own stream)."""
        return None

    def sleep(self, level: int) -> None:
        """Free accelerator memory between the rollout and the next update_weights (--sleep-level)."""

    def check_sync(self, model: torch.nn.Module) -> dict[str, float]:
        """Compare what it samples from with `model`; raise on a mismatch, else return the gap's
        statistics (an engine sampling from the trainer's own weights: nothing to compare, {})."""
        return {}

    def close(self) -> None:
        """Release what it holds (vLLM: one engine per process at a time)."""


def stop_token_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """Where a response ends: the tokenizer's EOS and every EOS of the model's generation config
    (instruct models end turns with their own, e.g. Qwen's <|im_end|>)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)  # an id, a list or None
    ids = [tokenizer.eos_token_id] + (eos if isinstance(eos, list) else [eos])
    return tuple(sorted({i for i in ids if i is not None}))


def sampling_generator(engine_generator: torch.Generator, device: torch.device) -> torch.Generator:
    """The generator one generate() call samples from. On the CPU: the engine's own, whose state a
    checkpoint saves. Elsewhere (CUDA) torch draws on the device, from a generator there: one seeded from
    a draw of the engine's CPU generator, so a per-batch seed (async, exact resume) fixes the device's
    samples too. Its stream differs from the CPU one; CPU runs stay bit-identical to before."""
    if device.type == "cpu":
        return engine_generator
    return device_generator(engine_generator, device)


def device_generator(cpu_generator: torch.Generator, device: torch.device) -> torch.Generator:
    seed = int(torch.randint(2**62, (1,), generator=cpu_generator))
    return torch.Generator(device=device).manual_seed(seed)


def stop_cut(response: list[int], stop_token_ids) -> tuple[int, bool]:
    """(length, stopped): a response ends after its first stop token, which it keeps (the model learns
    to stop), or runs to its end (truncated)."""
    hit = next((i for i, t in enumerate(response) if t in stop_token_ids), None)
    return (len(response), False) if hit is None else (hit + 1, True)


def aborted_sample(prompt: list[int], group: int, version: int) -> Sample:
    """A request aborted before it sampled a token (over-sampling: the caller had enough)."""
    return Sample(prompt_ids=list(prompt), response_ids=[], rollout_logprobs=[], status="aborted",
                  weight_version=version, group_id=group)


@dataclass
class HFEngine(RolloutEngine):
    """Batched sampling with a KV cache on a Hugging Face causal LM (the trainer's own module).

    Prompts are left-padded so every row's next token sits in the last column; each decode step
    feeds one token per row, with position ids counted from each row's first real token. A row stops
    at its first stop token; the loop ends when every row has stopped or `max_new_tokens` is reached.
    `record_routing` records the MoE experts of every prompt and response token (nanorl/moe_replay.py).
    The module trains in train() mode (activation checkpointing needs it): it generates in eval()
    mode, under autocast in `compute_dtype` as the trainer's forwards run (nanorl/precision.py).
    Only the last position's logits are computed (`logits_to_keep=1`): a prefill of 512 prompts ×
    300 tokens would otherwise materialise 47 GB of logits over a 152k vocabulary.
    """
    model: torch.nn.Module
    pad_id: int
    version: int = 0
    record_routing: bool = False
    compute_dtype: torch.dtype = torch.float32
    # rows per forward; larger requests are generated in chunks
    max_batch: int = 512
    generator: torch.Generator = field(default_factory=torch.Generator)

    @property
    def records_routing(self) -> bool:
        return self.record_routing

    def sampled_module(self) -> torch.nn.Module:
        return self.model

    def rng(self) -> torch.Generator:
        return self.generator

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        # Same process, same module: the engine *is* the trainer's model, so there is nothing to copy
        # and no way for the two to drift apart. (vLLM needs a real copy: nanorl/vllm_engine.py.)
        # With --fsdp the trainer's weights are sharded, so the engine holds its own full copy and
        # every rank all-gathers the shards into it here (all ranks call this together), one tensor at
        # a time: gathering the whole state dict first would hold a second full model per rank.
        if model is not self.model:
            from nanorl.distributed import iter_full_tensors
            own = self.model.state_dict()
            if set(own) != set(dict(model.state_dict())):
                raise ValueError("HFEngine.update_weights: the trainer's model and the engine's differ in "
                                 "names")
            with torch.no_grad():
                for name, full in iter_full_tensors(model):
                    own[name].copy_(full)
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                 until: Callable[[list[Sample]], bool] | None = None) -> list[Sample]:
        """until (over-sampling with abort, rounds.oversampled_round): called with the n Samples of each
        group whose rows have all stopped, between decode steps (groups still running at the last step
        come back in the result only); the result holds those very Samples. True aborts every
        unfinished request: it comes back with status "aborted" and the tokens it had (none in a chunk
        not started)."""
        if self.record_routing and until is not None:  # the routing of unfinished rows is still open
            raise ValueError("HFEngine: record_routing with until (over-sampling) is not supported")
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        rows = [(g, p) for g, p in enumerate(prompts) for _ in range(n)]
        out, was_training = [], self.model.training
        device = next(self.model.parameters()).device
        # no checkpointing (it would turn the KV cache off), no dropout
        self.model.eval()
        try:
            generator = sampling_generator(self.generator, device)
            with autocast(device, self.compute_dtype):
                # with until, chunks hold whole groups (it is handed a group's n samples at once)
                size = self.max_batch if until is None else max(n, self.max_batch // n * n)
                for start in range(0, len(rows), size):
                    chunk = rows[start:start + size]
                    if until is not None and out and any(x.status == "aborted" for x in out):
                        out += [aborted_sample(p, g, self.version) for g, p in chunk]
                        continue
                    out += self._generate_rows(chunk, sampling, generator, device, until)
        finally:
            self.model.train(was_training)
        return out

    def _generate_rows(self, rows: list[tuple[int, list[int]]], sp: SamplingConfig,
                       generator: torch.Generator, device: torch.device, until=None) -> list[Sample]:
        from transformers import DynamicCache

        B, P = len(rows), max(len(p) for _, p in rows)
        # [B, P] left-padded
        ids = torch.tensor([[self.pad_id] * (P - len(p)) + p for _, p in rows], device=device)
        attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for _, p in rows], device=device)  # [B, P]
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, P] positions count from each row's first token
        stop = torch.tensor(sorted(set(sp.stop_token_ids)), dtype=torch.long, device=device)
        cache = DynamicCache()
        steps = []  # per decode step: (token [B], logprob [B], support [B, K] or None)
        done = torch.zeros(B, dtype=torch.bool, device=device)  # [B] row has sampled a stop token
        step_ids, step_pos = ids, pos
        first, copy = self._shared_prefill(rows, device)
        stopping = _GroupsStopping(rows, until) if until is not None else None
        with self._recorder() as rec:
            for i in range(sp.max_new_tokens):
                # each distinct prompt's prefill once, then copied
                if i == 0 and first is not None:
                    logits = self._next_logits(cache, ids[first], attn[first], pos[first])[copy]  # [B, V]
                    cache.reorder_cache(copy)  # [U, ...] -> [B, ...]: row b takes copy[b]'s
                else:
                    logits = self._next_logits(cache, step_ids, attn, step_pos)  # [B, V]
                tok, lp, sup = sample_next(logits, sp.temperature, sp.top_k, sp.top_p, generator=generator,
                                           record_support=sp.keep_support, support_cap=sp.support_cap)
                tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)  # [B] finished rows pad
                steps.append((tok, lp, sup))
                done = done | torch.isin(tok, stop)
                if bool(done.all()):
                    break
                # groups whose rows have all stopped, to the caller as they finish
                if stopping is not None and stopping.report(
                        done, lambda: self._samples(rows, steps, sp, rec, P)):
                    break
                step_ids = tok[:, None]  # [B, 1]
                step_pos = step_pos[:, -1:] + 1  # [B, 1]
                attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype, device=device)], dim=1)
        samples = self._samples(rows, steps, sp, rec, P)
        return samples if stopping is None else stopping.result(samples, done)

    def _next_logits(self, cache, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One forward on top of the KV cache (which it extends): the next-token logits [B, V], in fp32
        for sampling."""
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                         use_cache=True, **self._last_logits_only)
        return out.logits[:, -1].float()

    def _samples(self, rows, steps, sp, rec, P) -> list[Sample]:
        """One Sample per row from the decode steps so far (each cut after its first stop token)."""
        tokens = torch.stack([tok for tok, _, _ in steps], 1).cpu()  # [B, R]
        logps = torch.stack([lp for _, lp, _ in steps], 1).float().cpu()  # [B, R]
        experts = rec.experts if rec is not None else None  # [B, P+R-1, L, k] or None
        # [B, R, K], -1 padded
        support = stack_steps([sup for _, _, sup in steps]) if sp.keep_support else None
        samples = []
        for b, (g, prompt) in enumerate(rows):
            resp = tokens[b].tolist()
            length, stopped = stop_cut(resp, sp.stop_token_ids)
            s = Sample(prompt_ids=list(prompt), response_ids=resp[:length],
                       rollout_logprobs=logps[b, :length].tolist(), group_id=g,
                       status="completed" if stopped else "truncated", weight_version=self.version)
            if sp.keep_support:
                s.sampling_support = support[b, :length].to(torch.int32).cpu()  # [R, K]
            # drop the left padding: position 0 is the first prompt token
            if experts is not None:
                s.routed_experts = experts[b, P - len(prompt):P + length - 1].clone()
                s.routing_version = self.version
            samples.append(s)
        return samples

    def _shared_prefill(self, rows, device):
        """The n samples of a prompt share its prefill: (first row of each distinct prompt [U], the row
        each row copies [B]), or (None, None) when no two consecutive rows share a prompt. The prefill is
        most of a short rollout's compute (16 prompts × 8 samples of a 6-token prompt and ≤4 new tokens:
        768 of 1152 token forwards); run once per prompt it is 96. The same numbers, not an
        approximation: a prompt's prefill does not depend on which row it sits in. Not with routing
        recorded (the recorder expects every row's prompt tokens)."""
        # on the host, from the rows' group ids: no device sync per chunk
        groups = [g for g, _ in rows]
        starts = [b == 0 or g != groups[b - 1] for b, g in enumerate(groups)]  # [B] starts a run of a prompt
        if all(starts) or self.record_routing:
            return None, None
        firsts = [b for b, first in enumerate(starts) if first]                  # [U]
        copies = [n - 1 for n in itertools.accumulate(starts)]                   # [B] its run in [U]
        return torch.tensor(firsts, device=device), torch.tensor(copies, device=device)

    @functools.cached_property
    def _last_logits_only(self) -> dict:
        """`logits_to_keep=1` where the model's forward takes it (transformers >= 4.50 causal LMs)."""
        takes = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        return {"logits_to_keep": 1} if takes else {}

    def _recorder(self):
        """A routing recorder around the decode loop when asked for, else a no-op context."""
        if not self.record_routing:
            return nullcontext(None)
        from nanorl import moe_replay
        return moe_replay.record(self.model)


class _GroupsStopping:
    """HFEngine.generate's `until` (over-sampling with abort, rounds.oversampled_round) over one chunk of
    rows: between decode steps it hands `until` the n Samples of each group whose rows have all stopped,
    and the chunk's result holds those very Samples (the caller may have scored them)."""

    def __init__(self, rows: list[tuple[int, list[int]]], until: Callable[[list[Sample]], bool]):
        self.until = until
        self.members: dict[int, list[int]] = {}  # group → its rows (reported once all have stopped)
        for b, (g, _) in enumerate(rows):
            self.members.setdefault(g, []).append(b)
        self.reported, self.given, self.aborted = set(), {}, False  # given: the Samples `until` saw, by row

    def report(self, done: torch.Tensor, samples_so_far: Callable[[], list[Sample]]) -> bool:
        """Hand `until` the groups that stopped since the last step (done [B]); True: abort the rest."""
        stopped = done.tolist()
        ready = [g for g, bs in self.members.items()
                 if g not in self.reported and all(stopped[b] for b in bs)]
        if ready:
            self.reported.update(ready)
            so_far = samples_so_far()
            self.given.update({b: so_far[b] for g in ready for b in self.members[g]})
            self.aborted = bool(self.until([so_far[b] for g in ready for b in self.members[g]]))
        return self.aborted

    def result(self, samples: list[Sample], done: torch.Tensor) -> list[Sample]:
        # the rows `until` saw come back as the very Samples it saw (it may have scored them)
        samples = [self.given.get(b, s) for b, s in enumerate(samples)]
        if self.aborted:  # the requests still running when the caller had enough
            stopped = done.tolist()
            for b, s in enumerate(samples):
                if not stopped[b]:
                    s.status = "aborted"
        return samples
