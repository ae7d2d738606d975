"""slime's partial rollouts with abort (--partial-rollout abort), inside the async rollout worker.

Each batch keeps F × G groups in flight (G = --prompts-per-step, F = --over-sample): first the groups a
previous batch aborted (the buffer, oldest first), each unfinished sample resumed from prompt + its
tokens so far under this batch's weights; then fresh prompts. Once G groups have finished, the requests
still running are aborted: their groups go to the buffer with every token they had, its rollout logprob
and its version (Sample.token_versions), and the next batch resumes them first. TIS / MIS correct
the old tokens per token through their own rollout logprobs; --mask-offpolicy-in-partial-rollout masks
them instead (rollout_worker.mask_older_tokens). Kimi k1.5 §2.6.2 (arXiv:2501.12599); slime's buffer.

Start at `AbortingRollout.batch`. Key choices: a batch resumes every buffered group to the end (they
are the first of its G), so no token is more than K + 1 versions old; the buffer holds at most G groups
(with F = 2 it never holds more; with F > 2 the groups cut beyond G are dropped and counted); the
worker draws its own prompts (how many depends on the buffer), and the buffer, the prompts drawn but
not started and the loader's position go into each batch's payload, so a checkpoint resumes the very
run. The HF engine aborts between its decode steps, vLLM through its request loop (VLLMEngine._until).
Test: python -m pytest tests/test_partial_rollout.py -q
"""
from __future__ import annotations

import dataclasses

import torch

from nanorl.data import Prompt
from nanorl.rewards import score_samples
from nanorl.rollout import stop_cut
from nanorl.trajectory import Sample


class AbortingRollout:
    """The worker's batches under --partial-rollout abort: `batch` makes one, `state_dict` is what a
    checkpoint needs to make the next ones as an uninterrupted run would."""

    def __init__(self, engine, rewards, tokenizer, loader, groups: int, n: int, over_sample: int):
        self.engine, self.rewards, self.tokenizer, self.loader = engine, rewards, tokenizer, loader
        self.G, self.n, self.F = groups, n, over_sample
        self.buffer: list[tuple[Prompt, list[Sample]]] = []  # aborted groups, oldest first
        self.pending: list[Prompt] = []  # drawn from the loader, not started yet

    def batch(self, sampling) -> tuple[list[Prompt], list[Sample], dict]:
        """G finished groups (their n samples consecutive, group ids 0..G-1, scored): the buffered ones
        resumed first, then fresh ones; the rest of the F × G in flight aborted into the buffer."""
        version, carried, self.buffer = self.engine.version, self.buffer, []
        calls = iter(range(2))  # engine calls of this batch: each its own seed (SamplingConfig.call)
        # 1. the buffer first (slime's data source pops it before new prompts), resumed to the end
        done = self._resume(carried, sampling, calls)
        # 2. fresh prompts: F x G groups in flight in all; abort once G have finished
        need, fresh = self.G - len(done), self.F * self.G - len(carried)
        cut, dropped = [], 0
        if need > 0:
            pool = self._draw(fresh)
            order: list[int] = []  # pool index of each group, in the order its rows all stopped

            def enough(groups: list[Sample]) -> bool:  # called with the groups whose rows all stopped
                order.extend(s.group_id for s in groups[::self.n])
                return len(order) >= need
            samples = self.engine.generate([p.ids for p in pool], self.n, sampling.call(next(calls)),
                                           until=enough)
            for s in samples:
                s.token_versions = [version] * len(s.response_ids)
            groups = [(pool[i // self.n], samples[i:i + self.n]) for i in range(0, len(samples), self.n)]
            # the first G to finish make the batch (slime's order); groups that ran to the last decode
            # step finish after every group reported before it
            rank = {g: i for i, g in enumerate(order)}
            complete = sorted((x for x in groups if all(s.status != "aborted" for s in x[1])),
                              key=lambda x: rank.get(x[1][0].group_id, len(rank)))
            cut = [x for x in groups if any(s.status == "aborted" for s in x[1])]
            # finished beyond the batch's G (several groups can stop at the same decode step) lead the
            # buffer, already whole; then the cut ones, up to G groups in all
            done += complete[:need]
            self.buffer = (complete[need:] + cut)[:self.G]
            dropped = len(complete[need:] + cut) - len(self.buffer)
        prompts, out = [p for p, _ in done], []
        for gid, (_, g) in enumerate(done):
            out += [dataclasses.replace(s, group_id=gid) for s in g]
        for s, r in zip(out, score_samples(self.rewards, self.tokenizer, prompts, out)):
            s.reward = r
        metrics = {"async/resumed_groups": len(carried),
                   "async/resumed_tokens": sum(len(s.response_ids) for _, g in carried for s in g),
                   "async/aborted_groups": len(cut),
                   "async/aborted_tokens": sum(len(s.response_ids) for _, g in cut for s in g),
                   "async/buffered_groups": len(self.buffer), "async/dropped_groups": dropped}
        return prompts, out, metrics

    def _resume(self, carried: list, sampling, calls) -> list[tuple[Prompt, list[Sample]]]:
        """The buffered groups, each unfinished sample continued under the engine's weights from prompt
        + its tokens so far to its own remaining budget, finished ones as they were. One engine call for
        all: each row is cut at its budget afterwards (its first k tokens do not depend on how long the
        call runs; a vLLM worker's max_model_len leaves room for that: build.vllm_engine)."""
        todo = [s for _, g in carried for s in g if s.status == "aborted"]
        if not todo:
            return list(carried)
        left = [sampling.max_new_tokens - len(s.response_ids) for s in todo]
        new = self.engine.generate([s.prompt_ids + s.response_ids for s in todo], 1, dataclasses.replace(
            sampling.call(next(calls)), max_new_tokens=max(left)))
        joined = iter([_joined(s, x, k, sampling, self.engine.version) for s, x, k in zip(todo, new, left)])
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


def _joined(old: Sample, new: Sample, left: int, sampling, version: int) -> Sample:
    """An aborted sample's tokens, then up to `left` tokens sampled after it (cut after a stop)."""
    resp = new.response_ids[:left]
    k, stopped = stop_cut(resp, set(sampling.stop_token_ids))
    support = None
    if sampling.keep_support:  # [R, K] each, -1 padded to the wider of the two
        parts = [t for t in (old.sampling_support, new.sampling_support[:k]) if t is not None]
        width = max(t.shape[1] for t in parts)
        support = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in parts])
    return dataclasses.replace(
        old, response_ids=old.response_ids + resp[:k],
        rollout_logprobs=old.rollout_logprobs + new.rollout_logprobs[:k],
        status="completed" if stopped else "truncated", sampling_support=support,
        token_versions=old.token_versions + [version] * k)
