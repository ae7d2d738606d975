"""slime's partial rollouts with abort (--partial-rollout abort), inside the async rollout worker, or
without --async-steps in the synchronous step (K = 0: nanorl/sources.py Partial, the same batches).

Each batch keeps F × G groups in flight (G = --prompts-per-step, F = --over-sample): first the groups a
previous batch aborted (the buffer, oldest first), each unfinished sample resumed from prompt + its
tokens so far under this batch's weights; then fresh prompts. Once G groups have finished, the requests
still running are aborted: their groups go to the buffer with every token they had, its rollout logprob
and its version (Sample.token_versions), and the next batch resumes them first. TIS / MIS correct
the old tokens per token through their own rollout logprobs; --mask-offpolicy-in-partial-rollout masks
them instead (`mask_older_tokens`). Kimi k1.5 §2.6.2 (arXiv:2501.12599); slime's buffer.

The generation is the worker's sample source's (`Source.start` / `Source.resume`, nanorl/sources.py): a
response over the engine, or with --env an episode (aborted between turns or inside one, resumed at its
last turn, its environment replayed: nanorl/episodes.py, docs/async.md).

With --filter-groups (DAPO's dynamic sampling, slime's dynamic filter) `GroupFilter` judges each group as
it finishes, resumed ones too, and the abort waits for G KEPT groups; a batch still short draws rounds
of G fresh prompts, aborted the same way (docs/from-slime-verl.md, "nanorl/dapo.py").

Start at `AbortingRollout.batch`. Key choices: a batch resumes every buffered group to the end (they
are the first of its G), so no token is more than K + 1 versions old; the buffer holds at most G groups
(with F = 2 it never holds more; with F > 2 the groups cut beyond G are dropped and counted); the
worker draws its own prompts (how many depends on the buffer), and the buffer, the prompts drawn but
not started and the loader's position go into each batch's payload, so a checkpoint resumes the very
run. The HF engine aborts between its decode steps, vLLM through its request loop (VLLMEngine._until).
Test: python -m pytest tests/test_partial_rollout.py tests/test_sync_partial.py -q
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from nanorl import dapo, rounds
from nanorl.data import Prompt
from nanorl.trajectory import Sample


def mask_older_tokens(s: Sample) -> None:
    """--mask-offpolicy-in-partial-rollout: loss mask 0 on the tokens sampled under an older version
    than the sample's newest (combined with any mask it has)."""
    versions = s.token_versions
    newest, old = max(versions), s.loss_mask or [1] * len(versions)
    s.loss_mask = [int(m and v == newest) for m, v in zip(old, versions)]


def staleness_metrics(samples: list[Sample], step: int) -> dict:
    """How far behind the trainer (version `step`) a batch is: per sample and per token. No metric for
    a batch (or a rank's shard) with no sample, which DAPO's refill can leave when its rounds run out."""
    if not samples:
        return {}
    ages = torch.tensor([step - s.weight_version for s in samples], dtype=torch.float)  # [N]
    tokens = [v for s in samples
              for v in s.token_versions or [s.weight_version] * s.response_length]
    off = torch.tensor([v < step for v in tokens], dtype=torch.float)  # [tokens]
    m = {"async/staleness_mean": float(ages.mean()), "async/staleness_max": float(ages.max()),
         "async/offpolicy_token_frac": float(off.mean()) if len(off) else 0.0}
    if any(s.token_versions is not None for s in samples):
        spanning = sum(len(set(s.token_versions)) > 1 for s in samples)
        m["async/partial_frac"] = spanning / len(samples)
        masked = sum(s.response_length - sum(s.loss_mask) for s in samples if s.loss_mask is not None)
        m["async/masked_token_frac"] = masked / max(1, len(tokens))
    routed = [step - s.routing_version for s in samples if s.routing_version is not None]
    if routed:  # --routing-replay: versions behind the trainer of the routing it replays (check_routing)
        m["async/staleness_routing_mean"] = sum(routed) / len(routed)
        m["async/staleness_routing_max"] = float(max(routed))
    return m


class AbortingRollout:
    """The worker's batches under --partial-rollout abort: `batch` makes one, `state_dict` is what a
    checkpoint needs to make the next ones as an uninterrupted run would."""

    def __init__(self, source, engine, score, loader, groups: int, n: int, over_sample: int):
        # source (nanorl/sources.py): single responses over the engine, or --env's episodes (aborted at a
        # turn boundary, resumed at their next turn); its start / resume are the only generation here.
        # score(prompts, samples) -> rewards: as the synchronous step scores (rounds.score: --reward with
        # the reward model's / judge's components beside it; an environment's episodes come scored)
        self.source, self.engine, self.score, self.loader = source, engine, score, loader
        self.G, self.n, self.F = groups, n, over_sample
        self.buffer: list[tuple[Prompt, list[Sample]]] = []  # aborted groups, oldest first
        self.pending: list[Prompt] = []  # drawn from the loader, not started yet

    def batch(self, sampling, keep: GroupFilter | None = None) -> tuple[list[Prompt], list[Sample], dict]:
        """G finished groups (their n samples consecutive, group ids 0..G-1, scored): the buffered ones
        resumed first, then fresh ones; the rest of the F × G in flight aborted into the buffer. With
        `keep` (--filter-groups) G KEPT groups: every group is judged as it finishes, resumed ones too,
        the abort waits for G with reward variance, and rounds of G fresh prompts follow while the batch
        is short (DAPO's refill, at most --max-gen-batches rounds in all)."""
        version, carried, self.buffer = self.engine.version, self.buffer, []
        calls = itertools.count()  # engine calls of this batch: each its own seed (SamplingConfig.call)
        # 1. the buffer first (slime's data source pops it before new prompts), resumed to the end
        done = self._resume(carried, sampling, calls)
        if keep is not None and done:  # slime's dynamic filter sees a resumed group as any other
            resumed = [p for p, _ in done]
            done = [(p, g) for p, g in zip(resumed, keep(resumed, [g for _, g in done])) if g is not None]
        # 2. fresh prompts: F x G groups in flight in all; abort once the batch has its G
        cut, surplus, made = [], [], 0  # made: generation rounds (the first holds the resume)
        while len(done) < self.G and made < (1 if keep is None else keep.max_rounds):
            count = self.F * self.G - len(carried) if made == 0 else self.G
            new, surplus, cut = self._round(self._draw(count), self.G - len(done), sampling.call(next(calls)),
                                            version, keep)
            done += new
            made += 1
        # finished beyond the batch's G (several groups can stop at the same decode step) lead the buffer,
        # already whole; then the cut ones, up to G groups in all. With the filter the finished ones are
        # scored and judged already: slime drops them (its "unused samples"), and so does nanorl
        spill = cut if keep is not None else surplus + cut
        self.buffer = spill[:self.G]
        prompts, out = [p for p, _ in done], []
        for gid, (_, g) in enumerate(done):
            out += [dataclasses.replace(s, group_id=gid) for s in g]
        if keep is None:  # the filter scored each group as it finished
            for s, r in zip(out, self.score(prompts, out)):
                s.reward = r
        metrics = {"async/resumed_groups": len(carried),
                   "async/resumed_tokens": sum(len(s.response_ids) for _, g in carried for s in g),
                   "async/aborted_groups": len(cut),
                   "async/aborted_tokens": sum(len(s.response_ids) for _, g in cut for s in g),
                   "async/buffered_groups": len(self.buffer),
                   "async/dropped_groups": len(spill) - len(self.buffer)}
        if keep is not None:
            metrics.update(keep.metrics(len(done), self.G, max(made, 1), len(surplus)))
        return prompts, out, metrics

    def _round(self, pool: list[Prompt], need: int, sampling, version: int, keep: GroupFilter | None):
        """One engine call, a group per prompt of `pool`, aborted once `need` groups are in: finished
        ones, or with `keep` kept ones (judged as they finish). Returns the batch's `need` groups in the
        order they came in (slime's), the surplus finished beyond them, and the cut groups: each a list of
        (prompt, samples)."""
        order: list[int] = []  # pool index of each group counted in, in the order it came in
        seen, kept = set(), {}  # groups handed to `counted`; with `keep`, the samples that train of each

        def counted(groups: list[list[Sample]]) -> None:
            if not groups:
                return
            ids = [g[0].group_id for g in groups]
            seen.update(ids)
            if keep is None:
                order.extend(ids)
                return
            for i, trains in zip(ids, keep([pool[i] for i in ids], groups)):
                if trains is not None:
                    kept[i] = trains
                    order.append(i)

        def enough(stopped: list[Sample]) -> bool:  # called with the groups whose rows all stopped
            counted([stopped[i:i + self.n] for i in range(0, len(stopped), self.n)])
            return len(order) >= need
        samples = self.source.start(pool, self.n, sampling, enough)
        for s in samples:
            s.token_versions = [version] * len(s.response_ids)
        groups = [samples[i:i + self.n] for i in range(0, len(samples), self.n)]
        cut = [(pool[i], g) for i, g in enumerate(groups) if any(s.status == "aborted" for s in g)]
        # groups that ran to the last decode step were not handed to `until`: they come in after every
        # group reported before them
        counted([g for i, g in enumerate(groups) if i not in seen and all(s.status != "aborted" for s in g)])
        ordered = [(pool[i], kept.get(i, groups[i])) for i in order]
        return ordered[:need], ordered[need:], cut

    def _resume(self, carried: list, sampling, calls) -> list[tuple[Prompt, list[Sample]]]:
        """The buffered groups, each unfinished sample continued under the engine's weights to its end
        (Source.resume: a response from prompt + its tokens so far, an episode from its next turn), finished
        ones as they were."""
        todo = [(p, s) for p, g in carried for s in g if s.status == "aborted"]
        if not todo:
            return list(carried)
        call = sampling.call(next(calls))
        joined = iter(self.source.resume([p for p, _ in todo], [s for _, s in todo], call))
        return [(p, [next(joined) if s.status == "aborted" else s for s in g]) for p, g in carried]

    def _draw(self, count: int) -> list[Prompt]:
        while len(self.pending) < count:
            self.pending += self.loader.next_batch()
        pool, self.pending = self.pending[:count], self.pending[count:]
        return pool

    def state_dict(self) -> dict:
        """Plain lists and tensors (a checkpoint loads it with weights_only=True)."""
        return {"buffer": [{"prompt": dataclasses.asdict(p), "samples": [dataclasses.asdict(s) for s in g]}
                           for p, g in self.buffer],
                "pending": [dataclasses.asdict(p) for p in self.pending], "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = [(Prompt(**x["prompt"]), [Sample(**s) for s in x["samples"]]) for x in state["buffer"]]
        self.pending = [Prompt(**p) for p in state["pending"]]
        self.loader.load_state_dict(state["loader"])


class GroupFilter:
    """--filter-groups with --partial-rollout abort: DAPO's filter (slime's dynamic sampling filter) on each
    group as it finishes, resumed ones too, as the synchronous step judges a round's groups: scored
    (rounds.score), --reward-postprocess'd, its samples that train (rounds.keep_trainable), kept if their
    rewards differ. `AbortingRollout.batch` aborts the rest once G groups are KEPT, not G finished."""

    def __init__(self, sampler: rounds.Sampler, max_rounds: int):
        self.sampler, self.max_rounds = sampler, max_rounds
        self.groups = self.samples = 0  # judged
        self.dropped: dict[str, int] = {}  # samples that left their group, by why (keep_trainable)

    def __call__(self, prompts: list[Prompt], groups: list[list[Sample]]) -> list[list[Sample] | None]:
        """Each group's samples that train, or None for a group the batch does not keep."""
        flat = [s for g in groups for s in g]
        for s, r in zip(flat, rounds.score(self.sampler, prompts, flat)):
            s.reward = r
        self.sampler.hooks.postprocess(flat)  # before the filter reads the rewards, as in the step
        counts: dict = {}
        trains = {id(s) for s in rounds.keep_trainable(self.sampler, flat, counts)}
        for k, v in counts.items():
            if k.startswith("dropped/"):
                self.dropped[k] = self.dropped.get(k, 0) + v
        self.groups, self.samples = self.groups + len(groups), self.samples + len(flat)
        out = []
        for g in groups:
            mine = [s for s in g if id(s) in trains]
            out.append(mine if dapo.has_signal([s.total_reward for s in mine]) else None)
        return out

    def metrics(self, found: int, wanted: int, made: int, surplus: int) -> dict:
        """The batch's DAPO figures, as the synchronous step names them (a batch short of `wanted` groups
        after its `made` rounds is counted and said: rounds.ran_out); dapo/surplus_groups: kept beyond
        `wanted`, dropped."""
        if found < wanted:
            rounds.ran_out(self.sampler, found, wanted, made)
        return {"groups_kept_frac": found / max(self.groups, 1), "dapo/gen_rounds": made,
                "dapo/surplus_groups": surplus,
                "dropped_frac": sum(self.dropped.values()) / max(self.samples, 1), **self.dropped}

