"""How a step's samples are drawn and scored (links 1-2 of the chain), shared by the trainer's `rollout`
stage (nanorl/stages.py) and the async rollout worker (nanorl/rollout_worker.py), which draws the same
rounds on its own engine.

Start at `Sampler`, the record of what drawing reads, then `OneRound` (generate → score →
post-process, then the samples that train) and `DynamicSampling` (DAPO: the same first round, F×
over-sampled with --over-sample, then refill rounds until the step holds groups with reward variance;
`dynamic_sampling` is the whole of it in one call). Key choice: which of these a run draws with is
chosen once, at set-up (train.py), so the rollout stage tests no flag for it; with --async-steps and
--filter-groups the worker ran DAPO's rounds and the trainer takes its batch as it is (`FromWorker`).
Test: python -m pytest tests/test_dapo.py tests/test_async_dapo.py -q
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from nanorl import dapo, distributed, spans
from nanorl.rewards import score_samples
from nanorl.rollout import SamplingConfig
from nanorl.trajectory import TRAINS


@dataclasses.dataclass
class Sampler:
    """What drawing a step's samples reads: train.py builds it from its Run each step, the async worker
    from its own parts (one rank: it samples the union of the ranks' prompts)."""
    cfg: Any           # nanorl/config.py Config: samples per prompt, DAPO's rounds
    source: Any        # where samples come from (nanorl/sources.py)
    engine: Any        # the rollout engine (over-sampling aborts through it)
    loader: Any        # the prompt stream (refill and over-sampled rounds draw from it)
    rewards: Any       # --reward's runner
    scorers: dict      # reward model / judge components
    reward_weights: dict | None
    tokenizer: Any
    hooks: Any         # --reward-postprocess, --sample-filter
    world: int         # ranks that draw the same rounds
    counters: dict     # run totals (dapo_gave_up)
    step: int
    logger: Any        # its `print` says a step that ran out of rounds
    # how a step draws its samples (stages.rollout): one round unless set-up chose DAPO's (train.py)
    rounds: OneRound = dataclasses.field(default_factory=lambda: OneRound())
    # what runs on the step's samples after the filters and refills, chosen at set-up (`finishers`)
    finishers: list = dataclasses.field(default_factory=list)


def finishers(cfg, tokenizer) -> list:
    """(metric name, fn(samples) -> float) pairs that stages.rollout runs, in order, on the samples that
    train: DAPO's soft overlong punishment (after the filter, which reads correctness), then
    --mask-think's masking (the reasoning conditions the answer and takes no loss: nanorl/spans.py)."""
    out = []
    if cfg.dapo.overlong_buffer:
        out.append(("overlong_penalty_mean", functools.partial(
            dapo.apply_overlong_penalty, max_new_tokens=cfg.max_new_tokens, share=cfg.dapo.overlong_buffer,
            factor=cfg.dapo.overlong_penalty)))
    if cfg.prompts.mask_think:
        out.append(("think_masked_frac", functools.partial(spans.mask_think, tokenizer=tokenizer)))
    return out


def generate(sampler: Sampler, prompts, n: int, sampling: SamplingConfig) -> list:
    """n samples per prompt, consecutive, from the sample source (nanorl/sources.py): the engine's
    responses, --env's episodes, or --async-steps' batch sampled ahead by the worker."""
    return sampler.source.generate(sampler.step, prompts, n, sampling)


def score(sampler: Sampler, prompts, samples) -> list:
    """The reward of every sample (prompt i's n samples are consecutive): --reward's, and with a reward
    model or a judge their components beside it (`with_components`)."""
    if sampler.source.rewarded:  # the environment / the worker scored them
        return [s.reward for s in samples]
    rewards = score_samples(sampler.rewards, sampler.tokenizer, prompts, samples)
    if not sampler.scorers:
        return rewards
    return scored_components(sampler.scorers, sampler.tokenizer, prompts, samples, rewards,
                             sampler.reward_weights)


def scored_components(scorers: dict, tokenizer, prompts, samples, rewards, weights: dict | None) -> list:
    """`rewards` with each scorer's score of its sample beside it (`with_components`). Every scorer is
    called even with no prompt: a rank with none still joins a sharded reward model's forwards
    (evaluation's rank whose slice of a set is empty, nanorl/evaluation.py)."""
    n = len(samples) // len(prompts) if prompts else 0
    ids = [s.response_ids for s in samples]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True) if ids else []
    prompt_texts = [p.text for p in prompts for _ in range(n)]
    labels = [p.label for p in prompts for _ in range(n)]
    scored = {name: s.score(prompt_texts, texts, labels) for name, s in scorers.items()}
    return with_components(rewards, scored, samples, weights)


def with_components(rewards, scored: dict, samples, weights: dict | None) -> list[dict]:
    """Each sample's reward as named components: --reward's own (a number is the component `correct`,
    which rollout/accuracy reads), then each scorer's (`rm`, `judge`), unweighted — the weights apply in
    Sample.total_reward, so each component is logged as it was scored (rollout/reward/<name>). A scorer
    that failed on a sample (None) makes it a reward_fault: it leaves the step (keep_trainable)."""
    out = []
    for i, (reward, s) in enumerate(zip(rewards, samples)):
        comps = dict(reward) if isinstance(reward, dict) else {"correct": float(reward)}
        for name, values in scored.items():
            if values[i] is None and s.status in TRAINS:
                s.status = "reward_fault"
            comps[name] = 0.0 if values[i] is None else float(values[i])
        unknown = sorted(set(weights or {}) - set(comps))
        if unknown:
            raise ValueError(f"--reward-weights names {unknown}, not components of the reward "
                             f"({sorted(comps)})")
        s.reward_weights = weights
        out.append(comps)
    return out


def scored(sampler: Sampler, prompts, n: int, sampling: SamplingConfig) -> list:
    """n samples per prompt with their rewards (`generate`, then `score`)."""
    samples = generate(sampler, prompts, n, sampling)
    for s, r in zip(samples, score(sampler, prompts, samples)):
        s.reward = r
    return samples


def keep_trainable(sampler: Sampler, samples, metrics: dict) -> list:
    """The samples that train: failed ones (a status outside trajectory.TRAINS: aborted, env_error,
    tool_timeout, reward_fault) and those --sample-filter rejects leave the step here, after the rewards
    and before the advantages. Counted as rollout/dropped_frac (this step's share, summed over refill
    rounds) and rollout/dropped/<why>. Ranks may keep unequal numbers: the update runs in lockstep anyway
    (nanorl/scoring.py micro_batches)."""
    keep = sampler.hooks.keeps(samples)
    why = [s.status if s.status not in TRAINS else "filtered" if not k else None
           for s, k in zip(samples, keep)]
    dropped = [w for w in why if w is not None]
    metrics["dropped_frac"] = metrics.get("dropped_frac", 0.0) + len(dropped) / max(1, len(samples))
    for w in dropped:
        metrics[f"dropped/{w}"] = metrics.get(f"dropped/{w}", 0) + 1
    return [s for s, w in zip(samples, why) if w is None]


class OneRound:
    """One round: `samples_per_prompt` samples of each prompt, scored, --reward-postprocess'd over the
    whole step's groups (with --async-steps too: the worker's batch), then the samples that train."""

    def round(self, sampler: Sampler, prompts, sampling: SamplingConfig, timer, metrics: dict) -> list:
        with timer("generate"):
            samples = generate(sampler, prompts, sampler.cfg.samples_per_prompt, sampling)
        with timer("reward"):
            for s, r in zip(samples, score(sampler, prompts, samples)):
                s.reward = r
            sampler.hooks.postprocess(samples)
        return samples

    def keep(self, sampler: Sampler, samples, metrics: dict) -> list:
        return keep_trainable(sampler, samples, metrics)

    def refill(self, sampler: Sampler, prompts, samples, sampling, timer, metrics: dict) -> list:
        return samples


class DynamicSampling(OneRound):
    """DAPO's dynamic sampling (nanorl/dapo.py): the first round (F× over-sampled with --over-sample,
    its groups scored as they stop, the rest aborted), then rounds of fresh prompts until the step holds
    len(prompts) groups whose rewards differ, at most --max-gen-batches rounds."""

    def round(self, sampler: Sampler, prompts, sampling: SamplingConfig, timer, metrics: dict) -> list:
        if sampler.cfg.dapo.over_sample == 1:
            return super().round(sampler, prompts, sampling, timer, metrics)
        with timer("generate"):  # scored (and post-processed) group by group while sampling
            return oversampled_round(sampler, prompts, sampling, metrics)

    def refill(self, sampler: Sampler, prompts, samples, sampling, timer, metrics: dict) -> list:
        return refill_groups(sampler, prompts, samples, sampling, timer, metrics)


class FromWorker(OneRound):
    """--async-steps with --filter-groups: the worker ran DAPO's rounds (`dynamic_sampling`),
    post-processed and filtered each; its batch trains as it comes. Also synchronous --partial-rollout
    abort with --filter-groups: the source judged each group as it finished (sources.Partial)."""

    def round(self, sampler: Sampler, prompts, sampling: SamplingConfig, timer, metrics: dict) -> list:
        with timer("generate"):  # scored and filtered by the worker
            return generate(sampler, prompts, sampler.cfg.samples_per_prompt, sampling)

    def keep(self, sampler: Sampler, samples, metrics: dict) -> list:
        return samples


def dynamic_sampling(sampler: Sampler, prompts, sampling: SamplingConfig, timer, metrics: dict) -> list:
    """DAPO's generate → score → filter → refill in one call (the async worker's batch): the groups
    with reward variance, group ids 0.., from `DynamicSampling`'s rounds."""
    rounds = DynamicSampling()
    samples = rounds.round(sampler, prompts, sampling, timer, metrics)
    samples = rounds.keep(sampler, samples, metrics)
    return rounds.refill(sampler, prompts, samples, sampling, timer, metrics)


def refill_groups(sampler: Sampler, prompts, samples, sampling, timer, metrics) -> list:
    """DAPO dynamic sampling (nanorl/dapo.py): keep the groups whose rewards differ and generate rounds
    of fresh prompts until this rank holds len(prompts) of them, at most max_gen_batches rounds."""
    cfg, first, calls = sampler.cfg, [samples], [0]

    def draw(wanted: bool) -> list:
        if first:
            return first.pop()
        more = sampler.loader.next_batch()  # every rank advances its prompt stream alike
        if not wanted:
            return []
        calls[0] += 1  # a seeded batch (the async worker's): each round its own seed
        with timer("generate"):
            new = generate(sampler, more, cfg.samples_per_prompt, sampling.call(calls[0]))
        with timer("reward"):
            for s, r in zip(new, score(sampler, more, new)):
                s.reward = r
            sampler.hooks.postprocess(new)  # before the filter reads the rewards, as in the step
        return keep_trainable(sampler, new, metrics)

    def any_short(short: bool) -> bool:  # all ranks draw the same rounds
        return short if sampler.world == 1 else int(distributed.all_reduce(torch.tensor([int(short)]))) > 0

    kept, rounds, generated, gave_up = dapo.dynamic_sampling(draw, len(prompts), cfg.dapo.max_gen_batches,
                                                             any_short)
    found = len({s.group_id for s in kept})
    metrics.update({"groups_kept_frac": found / max(generated, 1), "dapo/gen_rounds": rounds})
    if gave_up:
        ran_out(sampler, found, len(prompts), rounds)
    return kept


def ran_out(sampler: Sampler, found: int, wanted: int, rounds: int) -> None:
    """A step whose rounds ran out before it held `wanted` groups with reward variance: counted
    (dapo_gave_up) and said; it trains on the `found` it has."""
    sampler.counters["dapo_gave_up"] = sampler.counters.get("dapo_gave_up", 0) + 1
    sampler.logger.print(f"step {sampler.step}: dynamic sampling found {found} of {wanted} groups "
                         f"with reward variance in {rounds} generation rounds (--max-gen-batches "
                         f"{sampler.cfg.dapo.max_gen_batches}); training on those. Raise --max-gen-batches, "
                         "or use easier data / a stronger start.")


def oversampled_round(sampler: Sampler, prompts, sampling, metrics: dict) -> list:
    """--over-sample F: one generation round of F× the step's prompts (F − 1 more batches from the
    loader, as refill rounds draw them). Each group is scored (and --reward-postprocess'd) as soon as
    all its samples stop; once len(prompts) groups with reward variance are in, every request still
    running is aborted. Returns every sample, the aborted ones (and the rest of their groups: a group
    trains whole or not at all) with status "aborted", which keep_trainable drops. The HF engine
    aborts between its decode steps, vLLM through its request loop (VLLMEngine._until). Logged:
    dapo/aborted_tokens (sampled, then thrown away), dapo/aborted_groups, dapo/oversampled_groups."""
    cfg, wanted = sampler.cfg, len(prompts)
    n = cfg.samples_per_prompt
    pool = list(prompts) + [p for _ in range(cfg.dapo.over_sample - 1) for p in sampler.loader.next_batch()]
    found = [0]

    def scored_groups(groups: list) -> None:  # whole groups, consecutive: prompt i's n samples
        if not groups:
            return
        for s, r in zip(groups, score(sampler, [pool[s.group_id] for s in groups[::n]], groups)):
            s.reward = r
        sampler.hooks.postprocess(groups)

    def enough(done: list) -> bool:
        scored_groups(done)
        found[0] += sum(dapo.has_signal([s.total_reward for s in done[i:i + n]])
                        for i in range(0, len(done), n))
        return found[0] >= wanted
    samples = sampler.engine.generate([p.ids for p in pool], n, sampling, until=enough)
    groups = [samples[i:i + n] for i in range(0, len(samples), n)]
    cut = [g for g in groups if any(s.status == "aborted" for s in g)]
    for g in cut:
        for s in g:
            s.status = "aborted"
    # the groups still unscored, at the end
    scored_groups([s for g in groups if g[0].status != "aborted" and g[0].reward is None for s in g])
    metrics.update({"dapo/aborted_tokens": sum(s.response_length for g in cut for s in g),
                    "dapo/aborted_groups": len(cut), "dapo/oversampled_groups": len(pool)})
    return samples
