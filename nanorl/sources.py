"""Where a step's samples come from, chosen once: the trainer's own engine, the multi-turn episode driver
over it (--env), a user's agent behind an endpoint over it (--agent), or the asynchronous rollout worker
(--async-steps), or without it the trainer's engine over-sampled with partial rollouts (--partial-rollout
abort: `Partial`). build.sample_source picks one (in train.setup, and in the async worker over its own
engine) and the stages (nanorl/stages.py) ask it, never which one it is.

Start at `Source`: `generate` and what a source says it did beyond sampling — `rewarded` (the samples
come back scored: the environment scored its episodes, the worker scored its batch), `local` (sampled
here, in this step: DAPO's over-sampling and refill rounds and ReMax's greedy baselines run here; the
worker runs them with its batch), `start` / `resume` (--partial-rollout abort: a response or an
episode aborted and resumed, nanorl/partial_rollout.py), its metrics, the versions it must be handed
(`publish`) and the reference logprobs it brings (`ref_logprobs`, the worker's). Key choice: the stages'
branches on the source are these declarations, read where they matter, so adding a source touches this
file and train.setup only. Test: python -m pytest tests/test_golden.py -q (every source, bit for bit)
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import torch

from nanorl.env import episode_metrics
from nanorl.partial_rollout import AbortingRollout, GroupFilter, mask_older_tokens, staleness_metrics
from nanorl.rollout import SamplingConfig, stop_cut
from nanorl.trajectory import Sample

NO_AGENT_ABORT = ("--partial-rollout abort with --agent is not supported: an agent's episode runs in the "
                  "user's function, which cannot be stopped and resumed between its calls")
WORKER_SAMPLES = ("the trainer's end of the async worker does not sample: the worker's own source runs the "
                  "partial rollouts (nanorl/rollout_worker.py)")
PARTIAL_SAMPLES = ("the synchronous partial-rollout source is not aborted or resumed itself: its `inner` "
                   "source is (sources.Partial)")


class Source:
    """What the stages read of a sample source (the engine's by default)."""
    rewarded = False  # samples come back with their rewards: nothing to score in the step
    local = True  # sampled in this process during the step (not ahead, by the async worker)

    def __init__(self, engine):
        self.engine = engine

    def generate(self, step: int, prompts: list, n: int, sampling: SamplingConfig) -> list[Sample]:
        """n samples per prompt, consecutive, group_id = the prompt's index."""
        return self.engine.generate([p.ids for p in prompts], n, sampling)

    def start(self, prompts: list, n: int, sampling: SamplingConfig, until) -> list[Sample]:
        """--partial-rollout abort (nanorl/partial_rollout.py): `generate`, aborting what is unfinished
        once `until`, handed the n samples of each group as it finishes, says so; an aborted sample comes
        back with status "aborted" and what it had, for `resume`."""
        return self.engine.generate([p.ids for p in prompts], n, sampling, until=until)

    def resume(self, prompts: list, samples: list[Sample], sampling: SamplingConfig) -> list[Sample]:
        """Aborted samples (of `start`, each with its prompt) continued to their end under the engine's
        current weights: each its old tokens, logprobs, token versions, then the new ones, of this version.
        One engine call for all: each row is cut at its own budget left afterwards (its first k tokens do
        not depend on how long the call runs; a vLLM worker's max_model_len leaves room for that:
        build.vllm_engine)."""
        left = [sampling.max_new_tokens - len(s.response_ids) for s in samples]
        if max(left) == 0:  # cut at the last decode step (the HF engine's): each truncated as it is (slime's)
            return [replace(s, status="truncated") for s in samples]
        new = self.engine.generate([s.prompt_ids + s.response_ids for s in samples], 1,
                                   replace(sampling, max_new_tokens=max(left)))
        return [_joined(s, x, k, sampling, self.engine.version) for s, x, k in zip(samples, new, left)]

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        """What the source logs of a step's samples (before any filter)."""
        return {}

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Version `version` of the trainer's weights, for a source that samples elsewhere."""

    def ref_logprobs(self, samples: list[Sample], batch) -> torch.Tensor:
        raise ValueError("this sample source brings no reference logprobs: the trainer scores them")

    def close(self) -> None:
        """Release what it holds (the worker process)."""


class Episodes(Source):
    """--env: multi-turn episodes over the engine; the environment answers between turns and scores
    each episode (the Samples mask the environment's tokens out: nanorl/env.py)."""
    rewarded = True

    def __init__(self, episodes):
        self.episodes = episodes

    def generate(self, step: int, prompts: list, n: int, sampling: SamplingConfig) -> list[Sample]:
        return self.episodes.generate(prompts, n, sampling)

    def start(self, prompts: list, n: int, sampling: SamplingConfig, until) -> list[Sample]:
        """Episodes aborted at a turn boundary: `until` is asked after every round of turns
        (EpisodeRunner.generate)."""
        return self.episodes.generate(prompts, n, sampling, until=until)

    def resume(self, prompts: list, samples: list[Sample], sampling: SamplingConfig) -> list[Sample]:
        """Each aborted episode played on from its next turn (EpisodeRunner.resume: its environment
        replayed through the recorded turns); the tokens it adds, the environment's too, are this
        version's."""
        version = self.episodes.engine.version
        out = self.episodes.resume(prompts, samples, sampling)
        for old, s in zip(samples, out):
            s.token_versions = old.token_versions + [version] * (s.response_length - old.response_length)
        return out

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        # turns, tool use, how episodes ended; env faults as run totals
        faults = {f"env_faults/{k}": v for k, v in self.episodes.faults.items()}
        return {**episode_metrics(samples), **faults}


class Agents(Source):
    """--agent: the user's agent function per episode, talking to the engine through an OpenAI-compatible
    endpoint; it returns each episode's reward (the Samples mask what the model did not write:
    nanorl/agent.py). An episode whose calls do not chain becomes one Sample per call."""
    rewarded = True

    def __init__(self, runner):
        self.runner = runner

    def generate(self, step: int, prompts: list, n: int, sampling: SamplingConfig) -> list[Sample]:
        return self.runner.rollout(prompts, n, sampling)

    def start(self, prompts: list, n: int, sampling: SamplingConfig, until) -> list[Sample]:
        raise ValueError(NO_AGENT_ABORT)

    def resume(self, prompts: list, samples: list[Sample], sampling: SamplingConfig) -> list[Sample]:
        raise ValueError(NO_AGENT_ABORT)

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        # per episode (a split one has several samples): model calls, failures, splits; faults as run totals
        eps = {s.episode["episode"]: s.episode for s in samples if s.episode is not None}
        n = max(1, len(eps))
        return {"agent/episodes": len(eps),
                "agent/calls_per_episode": sum(e["calls"] for e in eps.values()) / n,
                "agent/failed_frac": sum(e["end"] != "done" for e in eps.values()) / n,
                "agent/split_frac": sum(e["split"] for e in eps.values()) / n,
                **{f"agent_faults/{k}": v for k, v in self.runner.faults.items()}}


class Worker(Source):
    """--async-steps: batches sampled and scored ahead by the rollout worker (nanorl/pipeline.py), from
    weight versions the trainer publishes; with --env or --agent its episodes (the worker chose their
    source as the trainer did: build.sample_source), with a KL term its reference logprobs, with
    --filter-groups its refill rounds, with ReMax its greedy baselines, with --reward-model / --judge
    their components (the trainer keeps their fault totals). `inner`: the trainer's own source, which
    logs what it would of these samples (episodes' metrics; fault totals, the worker's added to them)."""
    rewarded, local = True, False

    def __init__(self, pipeline, inner: Source):
        self.pipeline, self.inner = pipeline, inner

    def generate(self, step: int, prompts: list, n: int, sampling: SamplingConfig) -> list[Sample]:
        return self.pipeline.take(step, prompts)

    def start(self, prompts: list, n: int, sampling: SamplingConfig, until) -> list[Sample]:
        raise ValueError(WORKER_SAMPLES)

    def resume(self, prompts: list, samples: list[Sample], sampling: SamplingConfig) -> list[Sample]:
        raise ValueError(WORKER_SAMPLES)

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        # staleness and who waited for whom, then (--env, --agent) the episodes' own
        return {**self.pipeline.metrics, **self.inner.metrics(samples)}

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self.pipeline.publish(model, version)

    def ref_logprobs(self, samples: list[Sample], batch) -> torch.Tensor:
        return self.pipeline.ref_logprobs(samples, batch)

    def close(self) -> None:
        self.pipeline.close()


class Partial(Source):
    """--partial-rollout abort without --async-steps (slime's partial rollouts, synchronous): each step
    keeps F × G groups in flight on the trainer's engine (F = --over-sample, G = --prompts-per-step),
    takes the first G that finish (with --filter-groups the first G kept, judged by the `keep` it makes
    for the step: partial_rollout.GroupFilter) and aborts the rest into a buffer, every unfinished sample
    with its tokens, rollout logprobs and per-token versions; the next step resumes those first, under
    the weights it samples with. The async worker's batch (partial_rollout.AbortingRollout over `inner`,
    the run's own source: responses, or --env's episodes), run in the step: no token is more than one
    version old. The step's prompts (drawn by train.rl_step) join those drawn and not started yet, the
    rest come from the same loader, so no prompt is skipped. Its samples come back scored (by --reward,
    or the environment), group ids 0..G-1. `save` / `load`: the buffer in a checkpoint."""
    rewarded = True
    FILE = "partial_rollout.pt"  # in a checkpoint directory: the buffer, the prompts not started, the loader

    def __init__(self, rollout: AbortingRollout, inner: Source, keep: Callable[[], GroupFilter] | None,
                 mask_older: bool, rank: int = 0):
        self.rollout, self.inner, self.keep, self.mask_older = rollout, inner, keep, mask_older
        # several ranks: each aborts and resumes its own prompts' groups (its loader shard), so each
        # saves its own buffer (rank 0's under FILE, rank r's under partial_rollout.rank<r>.pt)
        self.file = self.FILE if rank == 0 else f"partial_rollout.rank{rank}.pt"
        self.last: dict[str, float] = {}  # the last step's metrics

    def generate(self, step: int, prompts: list, n: int, sampling: SamplingConfig) -> list[Sample]:
        if n != self.rollout.n or len(prompts) != self.rollout.G:
            raise ValueError(f"--partial-rollout abort: a step of {len(prompts)} prompts x {n} samples, the "
                             f"buffer holds groups for {self.rollout.G} x {self.rollout.n}")
        self.rollout.pending += prompts
        _, samples, metrics = self.rollout.batch(sampling, self.keep() if self.keep is not None else None)
        if self.mask_older:  # --mask-offpolicy-in-partial-rollout: the previous version's tokens
            for s in samples:
                mask_older_tokens(s)
        # per-token staleness against the version the step trains from
        self.last = {**metrics, **staleness_metrics(samples, step)}
        return samples

    def start(self, prompts: list, n: int, sampling: SamplingConfig, until) -> list[Sample]:
        raise ValueError(PARTIAL_SAMPLES)

    def resume(self, prompts: list, samples: list[Sample], sampling: SamplingConfig) -> list[Sample]:
        raise ValueError(PARTIAL_SAMPLES)

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        # resumed / aborted / buffered groups and tokens, partial_frac, masked_token_frac, staleness;
        # then (--env) the episodes' own
        return {**self.last, **self.inner.metrics(samples)}

    def save(self, path: str, step: int) -> None:
        """This rank's buffer after step `step`, into checkpoint directory `path` (checkpoint.save)."""
        torch.save(self.rollout.state_dict(), os.path.join(path, self.file))

    def load(self, path: str) -> None:
        """This rank's buffer in a checkpoint directory (checkpoint.resume); one saved by a run without
        it (another mode, fewer ranks) has none: this rank starts with an empty buffer, as a fresh run
        would."""
        file = os.path.join(path, self.file)
        if os.path.isfile(file):
            self.rollout.load_state_dict(torch.load(file, weights_only=True))  # verified by the manifest


def _joined(old: Sample, new: Sample, left: int, sampling: SamplingConfig, version: int) -> Sample:
    """An aborted sample's tokens, then up to `left` tokens sampled after it (cut after a stop)."""
    resp = new.response_ids[:left]
    k, stopped = stop_cut(resp, set(sampling.stop_token_ids))
    support = None
    if sampling.keep_support:  # [R, K] each, -1 padded to the wider of the two
        parts = [t for t in (old.sampling_support, new.sampling_support[:k]) if t is not None]
        width = max(t.shape[1] for t in parts)
        support = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in parts])
    return replace(
        old, response_ids=old.response_ids + resp[:k],
        rollout_logprobs=old.rollout_logprobs + new.rollout_logprobs[:k],
        status="completed" if stopped else "truncated", sampling_support=support,
        token_versions=old.token_versions + [version] * k)
