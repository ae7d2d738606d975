"""Evaluation: held-out accuracy on one or more eval sets, sharded over ranks. Link: beside the chain
(the same engine and reward, on prompts never trained on, no update).

Start at `evaluate(sets, engine, sampling, seed, ...)`; `load_eval_sets` reads `--test-data`
("gsm8k=gsm8k_test.jsonl,HuggingFaceH4/MATH-500@test"; a set without `name=` is named after its source).
Per set: `eval/<name>/accuracy` (greedy), `eval/<name>/pass@k` (k samples at the eval temperature: the
share with one correct), and of the greedy responses what a step's rollout/ logs (nanorl/metrics.py
reward_metrics): `response_length_mean`, `reward_mean`, `truncated_frac`, `reward/<component>` (a dict
reward's, the reward model's and judge's: nanorl/rounds.py scored_components) and the --log-metadata /
log-only metadata fields (nanorl/metrics.py); `eval/accuracy` and `eval/pass@k` pooled over
all sets' prompts (the headline); `perf/time/eval`, the slowest rank's. With `--env` each sample is an
episode scored by its environment (nanorl/env.py), plus `tool_use_rate`. Key choices: each rank scores
its slice of every set (prompts r, r+N, ...) and the counts are summed, so no rank waits while another
evaluates and the greedy numbers equal one rank's; it runs under `checkpoint.isolated_rng`, so it never
shifts training's random stream.

    python -m pytest tests/test_eval.py -q
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nanorl import checkpoint, distributed, reasoning_tasks
from nanorl.data import PromptFormat, build_prompts, load_rows, parse_source
from nanorl.metrics import metadata_sums, pooled_means, with_fields
from nanorl.rewards import correct, score_samples
from nanorl.rollout import SamplingConfig
from nanorl.rounds import scored_components


@dataclass
class EvalSet:
    """One eval set: its name in the metric names, and its prompts ([Prompt], nanorl/data.py)."""
    name: str
    prompts: list


def set_name(source: str) -> str:
    """`gsm8k_test.jsonl` → gsm8k_test; `openai/gsm8k:main@test` → gsm8k_main_test;
    `reasoning_gym:basic_arithmetic?size=50` → reasoning_gym_basic_arithmetic (its options left out)."""
    name, config, split = parse_source(source, "test")
    if name.endswith((".jsonl", ".json", ".parquet")):
        return os.path.splitext(os.path.basename(name))[0]
    config = config and config.partition("?")[0]
    parts = [os.path.basename(name.rstrip("/")), config, split if "@" in source else None]
    return "_".join(p for p in parts if p)


def load_eval_sets(spec: str, tokenizer, input_key: str, label_key: str, max_prompt_len: int,
                   fmt: PromptFormat, limit: int = 0, seen: set[str] | None = None) -> list[EvalSet]:
    """The eval sets of `--test-data` ("[name=]source,..."), each cut to `limit` prompts (0 = all).
    seen: the train set's prompt texts, dropped from reasoning-gym sets (nanorl/reasoning_tasks.py)."""
    sets = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, eq, source = item.partition("=")
        # a name is a plain word: in reasoning_gym:task?size=50 the "=" is an option's
        eq = eq and not any(c in name for c in ":?&/")
        name, source = (name, source) if eq else (set_name(item), item)
        if any(s.name == name for s in sets):
            raise ValueError(f"--test-data: two eval sets are named {name!r}; name them apart as name=source")
        prompts = build_prompts(load_rows(source, split="test"), tokenizer, input_key, label_key,
                                max_prompt_len, source=source, fmt=fmt)[0]
        # reasoning-gym sets from near seeds share items: held out means never trained on
        if seen is not None and reasoning_tasks.is_source(source):
            prompts = reasoning_tasks.drop_seen(prompts, seen, name)
        sets.append(EvalSet(name, prompts[:limit] if limit else prompts))
    return sets


@dataclass(frozen=True)
class EvalSampling:
    """How every eval prompt is sampled: once greedily (accuracy, response length), then `pass_k` times
    at `temperature` with top_k / top_p (pass@k); both up to max_new_tokens, ending at stop_token_ids."""
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    pass_k: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def from_config(cls, cfg, stop_token_ids: tuple[int, ...]) -> EvalSampling:
        """A run's eval sampling: --eval-max-new-tokens and --eval-temperature, 0 meaning training's
        value; training's top_k and top_p. stop_token_ids: nanorl/rollout.py stop_token_ids(model, tok)."""
        return cls(max_new_tokens=cfg.evaluation.eval_max_new_tokens or cfg.max_new_tokens,
                   stop_token_ids=tuple(stop_token_ids), pass_k=cfg.evaluation.pass_k,
                   temperature=cfg.evaluation.eval_temperature or cfg.sampling.temperature,
                   top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p)


def evaluate(sets: list[EvalSet], engine, sampling: EvalSampling, seed: int, rewards=None, tokenizer=None,
             episodes=None, rank: int = 0, world: int = 1, scorers: dict | None = None,
             reward_weights: dict | None = None, log_metadata: list[str] = ()) -> dict:
    """Every eval set's metrics (see the module docstring); {} when there is none. All `world` ranks
    call it, each scoring its slice. engine: the rollout engine (generate; its generator is seeded with
    seed + rank for the call, then every stream is put back). rewards, tokenizer: score the engine's
    samples (nanorl/rewards.py score_samples); episodes: --env's multi-turn driver (nanorl/env.py)
    instead, whose environment scores them. scorers, reward_weights: the reward model / judge components
    (nanorl/build.py make_scorers) beside --reward on the greedy samples, as a step scores them;
    log_metadata: --log-metadata's patterns (nanorl/metrics.py metadata_metrics)."""
    if not sets:
        return {}
    if episodes is None and (rewards is None or tokenizer is None):
        raise ValueError("evaluate: needs rewards and tokenizer to score the engine's samples (or episodes)")
    start = time.perf_counter()
    scorer = Scorer(engine, rewards, tokenizer, episodes, scorers or {}, reward_weights, list(log_metadata))
    # never shifts training's stream
    with checkpoint.isolated_rng(engine, seed=seed + rank):
        slices = [_score_slice(scorer, sampling, s.prompts[rank::world]) for s in sets]
    # [S, 7] summed over ranks
    counts = distributed.all_reduce(torch.stack([c for c, _ in slices]))
    # components and metadata: their keys may differ by rank
    parts = distributed.all_gather([f for _, f in slices])
    k, out, env = sampling.pass_k, {}, episodes is not None
    for i, (s, row) in enumerate(zip(sets, counts.tolist())):
        n, greedy, passed, length, tools, truncated, reward = row
        mine = {"accuracy": greedy / n, f"pass@{k}": passed / n, "response_length_mean": length / n,
                "reward_mean": reward / n, "truncated_frac": truncated / n}
        # --env: the share of greedy episodes that called a tool
        if env:
            mine["tool_use_rate"] = tools / n
        fields = with_fields(mine, pooled_means([p[i] for p in parts]), "eval metric names")
        out.update({f"eval/{s.name}/{f}": v for f, v in fields.items()})
    n, greedy, passed, _, tools, _, _ = counts.sum(0).tolist()
    if env:
        out["eval/tool_use_rate"] = tools / n
    seconds = distributed.all_reduce(torch.tensor([time.perf_counter() - start]), dist.ReduceOp.MAX)
    pooled = {"eval/accuracy": greedy / n, f"eval/pass@{k}": passed / n}
    return {**pooled, **out, "perf/time/eval": float(seconds)}


@dataclass
class Scorer:
    """Scored samples from an engine (or the --env driver over it), by --reward: evaluation's (the
    step and the async rollout worker score through stages.generate + score). components: the reward
    model / judge (name → scorer) added to the greedy samples' rewards, as rounds.score adds them."""
    engine: object
    rewards: object
    tokenizer: object
    episodes: object
    components: dict = field(default_factory=dict)
    reward_weights: dict | None = None
    log_metadata: list = field(default_factory=list)

    def scored(self, prompts, n: int, sampling: SamplingConfig) -> tuple[list, int]:
        """(n scored samples per prompt, how many of them were truncated): the engine's, scored by the
        reward; with --env the episodes of the multi-turn driver, which the environment scored
        (nanorl/env.py). Truncation is counted before scoring: a reward fault rewrites the status."""
        if self.episodes is not None:
            samples = self.episodes.generate(prompts, n, sampling)
            return samples, sum(s.status == "truncated" for s in samples)
        samples = self.engine.generate([p.ids for p in prompts], n, sampling)
        truncated = sum(s.status == "truncated" for s in samples)
        for s, r in zip(samples, score_samples(self.rewards, self.tokenizer, prompts, samples)):
            s.reward = r
        return samples, truncated

    def add_components(self, prompts, samples) -> None:
        """The reward model's / judge's component beside each sample's reward (none with --env: its
        environment scored them, as in a step). Called on every rank, even with no prompt."""
        if not self.components or self.episodes is not None:
            return
        rewards = [s.reward for s in samples]
        for s, r in zip(samples, scored_components(self.components, self.tokenizer, prompts, samples, rewards,
                                                   self.reward_weights)):
            s.reward = r


def _score_slice(scorer: Scorer, sampling: EvalSampling, prompts) -> tuple[torch.Tensor, dict]:
    """([prompts, greedy correct, pass@k hits, greedy response tokens, greedy episodes that called a
    tool, greedy responses truncated, greedy reward sum] of this rank's slice, and its greedy samples'
    per-field sums (metadata_sums' layout): `reward/<component>` (0 where a reward lacks it, as
    metrics.reward_metrics counts it) and the --log-metadata / log-only metadata fields)."""
    # more ranks than prompts: this rank adds nothing (only a sharded reward model's forwards)
    if not prompts:
        scorer.add_components([], [])
        return torch.zeros(7, dtype=torch.float64), {}
    greedy, truncated = scorer.scored(prompts, 1, SamplingConfig(
        temperature=0.0, max_new_tokens=sampling.max_new_tokens, stop_token_ids=sampling.stop_token_ids))
    # accuracy reads --reward's own verdict, before the reward model / judge components join it
    right = [correct(s.reward) >= 1.0 for s in greedy]
    scorer.add_components(prompts, greedy)
    sampled, _ = scorer.scored(prompts, sampling.pass_k, SamplingConfig(
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens, stop_token_ids=sampling.stop_token_ids))
    # [prompts, k]
    hits = torch.tensor([correct(s.reward) >= 1.0 for s in sampled]).view(len(prompts), sampling.pass_k)
    length = sum(s.response_length for s in greedy)
    tools = sum((s.episode or {}).get("tool_calls", 0) > 0 for s in greedy)
    counts = [len(prompts), sum(right), float(hits.any(1).sum()), length, tools,
              truncated, sum(s.total_reward for s in greedy)]
    fields = {}
    for key in dict.fromkeys(c for s in greedy if isinstance(s.reward, dict) for c in s.reward):
        fields[f"reward/{key}"] = [sum(float(s.reward.get(key, 0.0)) if isinstance(s.reward, dict) else 0.0
                                       for s in greedy), len(greedy), 0]
    fields.update(metadata_sums(greedy, scorer.log_metadata))
    return torch.tensor(counts, dtype=torch.float64), fields
