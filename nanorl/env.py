"""Environments: what acts between the model's turns and scores the episode (--env).

Link 1 of the chain (rollout) as episodes, and link 2 (reward). An agent episode alternates two writers
on ONE token sequence: the policy writes a turn (a tool call, an answer), the environment answers (the
tool's output), the policy continues, until the environment says done or a cap is hit. This file is
the environment's side: start at `Env` (what an environment implements: `reset`, `step`, and `call`
for its tools) with its `Action` and `Step`; `ToolRunner` runs tools bounded in a forked worker; `ENDS`
maps an episode's end reason to its Sample status; `turn_reward_tensor` and `episode_metrics` are what
the trainer reads of finished episodes. The driver that plays episodes over a rollout engine is
nanorl/episodes.py (`EpisodeRunner`). Key choices: no end reason raises (an episode ends with a
status; env_error, tool_timeout and aborted ones are scored, counted and left out of the update,
nanorl/trajectory.py TRAINS); a tool call that hangs is a `ToolTimeout`, not a hung run. Tools and
limits: docs/from-slime-verl.md, "nanorl/env.py".

Test: python -m pytest tests/test_env.py -q
"""
from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanorl.rewards import exit_with_parent
from nanorl.trajectory import Sample

ENDS = {"done": "completed", "truncated": "truncated", "token_cap": "truncated", "turn_cap": "truncated",
        "env_error": "env_error", "tool_timeout": "tool_timeout", "aborted": "aborted"}


# ----------------------------------------------------------------------------- the interface
@dataclass
class Action:
    """One model turn as the environment sees it."""
    # the sampled ids, its stop token included
    ids: list[int]
    # the same ids decoded, special tokens skipped (what a parser reads)
    text: str
    # 0-based index of this model turn
    turn: int


class Step(NamedTuple):
    """What `Env.step` returns (a plain 4-tuple works too)."""
    # text: framed by the chat template and encoded once; ids: used as given; None only with done
    observation: str | list[int] | None
    reward: float | dict = 0.0
    done: bool = False
    # "tool_calls": n is counted; "mask_turn": True keeps the model turn it answers out of the loss
    # (e.g. train only the final answer, S0 §4.5); the rest is kept in Sample.episode
    info: dict = {}


class Env:
    """One episode's environment; a new instance per episode (so state never leaks between them)."""
    # chat role of the observations (the template frames them as this role)
    role = "tool"
    # default seconds per tool call (-1 in the config picks this); 0 = in-process
    tool_timeout = 10.0
    # set by the driver before reset
    tools: "ToolRunner"

    def reset(self, prompt) -> str | list[int] | None:
        """prompt: a nanorl.data.Prompt (ids, text, label). → None to start from the prompt as the data
        pipeline rendered it, a string to replace its text (rendered the same way), or ids."""
        return None

    def step(self, action: Action) -> Step:
        raise NotImplementedError

    def call(self, fn, *args):
        """fn(*args) under the run's tool limits (ToolRunner's docstring); raises ToolTimeout."""
        return self.tools(fn, *args)


# ----------------------------------------------------------------------------- bounded tool calls
class ToolTimeout(RuntimeError):
    """A tool call ran past its time limit; its worker process was killed."""


class ToolRunner:
    """Runs tool functions: in-process (timeout 0) or in one forked worker with a per-call timeout.

    An environment runs untrusted or slow code through `self.call(fn, *args)`: with a timeout > 0 the call
    runs in a forked worker process that is killed when it hangs (a thread could not be stopped); with
    timeout 0 it runs in-process (trusted, fast built-ins). `fn` must be a module-level function (the worker
    gets it by name). Tool calls of one turn run one after another, each bounded.
    """

    def __init__(self, timeout: float = 0.0):
        if timeout < 0:
            raise ValueError(f"ToolRunner: timeout must be >= 0, got {timeout}")
        self.timeout, self._pool = timeout, None

    def __call__(self, fn, *args):
        if self.timeout == 0:
            return fn(*args)
        # fork: the worker inherits every imported module, so fn resolves by name; it ends with the run
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=mp.get_context("fork"),
                                             initializer=exit_with_parent)
        future = self._pool.submit(fn, *args)
        try:
            # an exception inside fn is re-raised here
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            # a hung worker never returns: kill it, the next call forks a fresh one
            self.close()
            raise ToolTimeout(f"tool {getattr(fn, '__name__', fn)!r} ran past {self.timeout:g} s") from None
        except BrokenProcessPool as e:
            self.close()
            raise RuntimeError(f"tool {getattr(fn, '__name__', fn)!r}: its worker process died") from e

    def close(self) -> None:
        if self._pool is not None:
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                proc.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


# ----------------------------------------------------------------------------- what the trainer reads
def turn_reward_tensor(samples: list[Sample], T: int) -> torch.Tensor | None:
    """[B, T] rewards on each model turn's last trained token (loss mask 1; else the episode's last
    one); None when every episode is rewarded on its last turn only — then the usual placement of
    the total on the last valid token is the same thing, and the trainer passes scores."""
    if not any(any(_total(r) != 0 for r in (s.episode or {}).get("turn_rewards", [])[:-1])
               for s in samples):
        return None
    out = torch.zeros(len(samples), T)
    for b, s in enumerate(samples):
        env, mask = s.episode or {}, s.loss_mask or [1] * s.response_length
        valid = [t for t, m in enumerate(mask) if m]
        for (start, end), r in zip(env.get("spans", []), env.get("turn_rewards", [])):
            inside = [t for t in valid if start <= t < end]
            if inside or valid:
                out[b, (inside or valid)[-1]] += _total(r)
    return out


def _total(r) -> float:
    return float(sum(r.values())) if isinstance(r, dict) else float(r)


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """env/... per step: turns, tool use, environment-token share, and how episodes ended."""
    info = [s.episode for s in samples if s.episode is not None]
    if not info:
        return {}
    n, tokens = len(info), sum(s.response_length for s in samples)
    env_tokens = sum(s.response_length - sum(s.loss_mask or []) for s in samples if s.episode is not None)
    ended = Counter(x["end"] for x in info)
    return {"env/turns_mean": sum(x["turns"] for x in info) / n,
            "env/tool_calls_mean": sum(x["tool_calls"] for x in info) / n,
            "env/tool_use_rate": sum(x["tool_calls"] > 0 for x in info) / n,
            "env/env_token_frac": env_tokens / max(1, tokens),
            **{f"env/end/{k}": ended[k] / n for k in ENDS}}
