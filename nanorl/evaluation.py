"""Evaluation: held-out accuracy on one or more eval sets, sharded over ranks (beside the chain).

    rollout → reward → logprob recompute → advantage → loss → backward → optimizer step → weight sync
    ^^^^^^^   ^^^^^^  (the same engine and reward, on prompts never trained on, no update)

`--test-data gsm8k=gsm8k_test.jsonl,HuggingFaceH4/MATH-500@test` names several eval sets (a set
without `name=` is named after its file or dataset). For each set, every `eval_every` steps:
- `eval/<name>/accuracy`: greedy decoding, the share of prompts answered correctly;
- `eval/<name>/pass@k`: k samples per prompt at `eval_temperature`, the share with one correct;
- `eval/<name>/response_length_mean`: mean greedy response length in tokens;
and `eval/accuracy`, `eval/pass@k` pooled over the prompts of all sets (the run's headline number),
and `perf/time/eval`, the slowest rank's seconds.
Eval responses may be longer than training's (`--eval-max-new-tokens`). With `--env` every eval
sample is an episode of the multi-turn driver, scored by its environment (nanorl/env.py), and
`eval/<name>/tool_use_rate` (`eval/tool_use_rate` pooled) is the share of greedy episodes that
called a tool.

With N ranks every rank scores its own slice of every set (prompts r, r+N, ...) with its own engine,
and the counts are summed over ranks: the wall time falls with N, no rank waits in a collective while
another evaluates, and the greedy numbers equal one rank's exactly (the sampled ones are another
draw). Evaluation runs under `isolated_rng`, so it never shifts training's random stream.

    python -m pytest tests/test_eval.py -q
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanorl import checkpoint, distributed
from nanorl.data import PromptFormat, build_prompts, load_rows, parse_source
from nanorl.rewards import correct, score_samples
from nanorl.rollout import SamplingConfig, stop_token_ids


@dataclass
class EvalSet:
    name: str
    prompts: list  # [Prompt]


def set_name(source: str) -> str:
    """`gsm8k_test.jsonl` → gsm8k_test; `openai/gsm8k:main@test` → gsm8k_main_test."""
    name, config, split = parse_source(source, "test")
    if name.endswith((".jsonl", ".json", ".parquet")):
        return os.path.splitext(os.path.basename(name))[0]
    parts = [os.path.basename(name.rstrip("/")), config, split if "@" in source else None]
    return "_".join(p for p in parts if p)


def load_eval_sets(spec: str, tokenizer, input_key: str, label_key: str, max_prompt_len: int,
                   fmt: PromptFormat, limit: int = 0) -> list[EvalSet]:
    """The eval sets of `--test-data` ("[name=]source,..."), each cut to `limit` prompts (0 = all)."""
    sets = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, eq, source = item.partition("=")
        name, source = (name, source) if eq else (set_name(item), item)
        if any(s.name == name for s in sets):
            raise ValueError(f"--test-data: two eval sets are named {name!r}; name them apart as name=source")
        prompts = build_prompts(load_rows(source, split="test"), tokenizer, input_key, label_key,
                                max_prompt_len, source=source, fmt=fmt)[0]
        sets.append(EvalSet(name, prompts[:limit] if limit else prompts))
    return sets


def evaluate(run) -> dict:
    """Every eval set's metrics (see the module docstring); {} when there is none. All ranks call it."""
    if not run.eval_sets:
        return {}
    start = time.perf_counter()
    with checkpoint.isolated_rng(run, seed=run.cfg.seed + run.rank):  # never shifts training's stream
        counts = torch.stack([_score_slice(run, s.prompts[run.rank::run.world]) for s in run.eval_sets])
    distributed.all_reduce(counts)  # [S, 5] summed over ranks
    k, out, env = run.cfg.pass_k, {}, getattr(run, "episodes", None) is not None
    for s, (n, greedy, passed, length, tools) in zip(run.eval_sets, counts.tolist()):
        out.update({f"eval/{s.name}/accuracy": greedy / n, f"eval/{s.name}/pass@{k}": passed / n,
                    f"eval/{s.name}/response_length_mean": length / n})
        if env:  # --env: the share of greedy episodes that called a tool
            out[f"eval/{s.name}/tool_use_rate"] = tools / n
    n, greedy, passed, _, tools = counts.sum(0).tolist()
    if env:
        out["eval/tool_use_rate"] = tools / n
    seconds = distributed.all_reduce(torch.tensor([time.perf_counter() - start]), dist.ReduceOp.MAX)
    return {"eval/accuracy": greedy / n, f"eval/pass@{k}": passed / n, **out, "perf/time/eval": float(seconds)}


def _scored(run, prompts, n: int, sampling: SamplingConfig) -> list:
    """n scored samples per prompt: the engine's, scored by the reward; with --env the episodes of the
    multi-turn driver, which the environment scored (nanorl/env.py)."""
    if getattr(run, "episodes", None) is not None:
        return run.episodes.generate(prompts, n, sampling)
    samples = run.engine.generate([p.ids for p in prompts], n, sampling)
    for s, r in zip(samples, score_samples(run.rewards, run.tokenizer, prompts, samples)):
        s.reward = r
    return samples


def _score_slice(run, prompts) -> torch.Tensor:
    """[prompts, greedy correct, pass@k hits, greedy response tokens, greedy episodes that called a
    tool] of this rank's slice."""
    if not prompts:  # more ranks than prompts: this rank adds nothing (no collective inside)
        return torch.zeros(5, dtype=torch.float64)
    cfg, stop = run.cfg, stop_token_ids(run.model, run.tokenizer)
    max_new = cfg.eval_max_new_tokens or cfg.max_new_tokens
    greedy = _scored(run, prompts, 1, SamplingConfig(temperature=0.0, max_new_tokens=max_new, stop_token_ids=stop))
    right = [correct(s.reward) >= 1.0 for s in greedy]
    sampled = _scored(run, prompts, cfg.pass_k, SamplingConfig(
        temperature=cfg.eval_temperature or cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
        max_new_tokens=max_new, stop_token_ids=stop))
    hits = torch.tensor([correct(s.reward) >= 1.0 for s in sampled])
    hits = hits.view(len(prompts), cfg.pass_k)  # [prompts, k]
    length = sum(s.response_length for s in greedy)
    tools = sum(s.metadata.get("env", {}).get("tool_calls", 0) > 0 for s in greedy)
    return torch.tensor([len(prompts), sum(right), float(hits.any(1).sum()), length, tools], dtype=torch.float64)
