"""Rewards: score each sampled response.

Link 2 of the chain (reward). In RL with verifiable rewards (RLVR) a reward is a program that checks the
response against the label: 1 for the right answer, 0 otherwise, maybe a small bonus for the format:

    fn(prompt: str, response: str, label: str) -> float | dict[str, float] | SpanReward
    fn(prompt: str, response: str, label: str, sample: Sample) -> ...   (the Sample: ids, status, metadata)

A dict names several components (e.g. {"correct": 1.0, "format": 0.5}): logged separately, summed into
the sample's reward, normalised one by one by GDPO (nanorl/advantage.py); a key starting with "_" is
log-only (`split_log_only`). Built in: `exact`, `exact_format`, `math`, `format`, `math_format`, `code`,
`reasoning_gym` (a reasoning-gym task's own checker, nanorl/reasoning_tasks.py); a user function comes
from an explicit flag as `module:function` or `path/to/file.py:function` (`load_reward_fn`), never from
data. Start at `RewardRunner`. Key choice: user code must never take the run down — a function that
raises, returns NaN/None/a wrong type or runs past its time limit gives reward 0 for that sample, is
counted, and its first traceback is logged; with `timeout > 0` rewards run in worker processes (by
default math 10 s, reasoning_gym 30 s, code 120 s: `BOUNDED`), so a hanging or crashing function is
killed without touching the trainer. Ctrl-C during the reward calls: the first goes to the trainer
(finish the step, save), the second ends the run at once, its workers killed (`_ctrl_c_guard`).
"""
from __future__ import annotations

import importlib
import math
import multiprocessing as mp
import numbers
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager

from nanorl import code_reward, math_grader, reasoning_tasks
from nanorl.config import BOUNDED_REWARDS
from nanorl.plugins import check_call, load_checked
from nanorl.spans import SpanReward, place
from nanorl.trajectory import TRAINS

# ----------------------------------------------------------------------------- built-in rewards


def exact(prompt: str, response: str, label: str) -> float:
    """The default task: the response is exactly the answer (the engine strips the EOS token)."""
    return 1.0 if response.strip() == str(label).strip() else 0.0


def math_reward(prompt: str, response: str, label: str) -> float:
    """1 when the response's final answer (\\boxed{}, "####", "the answer is") is mathematically
    equal to the label's (a GSM8K solution, a MATH solution or a plain answer): nanorl/math_grader.py."""
    return float(math_grader.grade(response, str(label)))


def format_reward(prompt: str, response: str, label: str) -> float:
    """1 when the response puts a final answer in a closed \\boxed{...} (nested braces allowed)."""
    return 1.0 if math_grader.last_boxed(response) is not None else 0.0


def math_format(prompt: str, response: str, label: str) -> dict[str, float]:
    """Correctness and format as two named components (for GDPO, or just to log them apart)."""
    return {"correct": math_reward(prompt, response, label),
            "format": 0.2 * format_reward(prompt, response, label)}


def exact_format(prompt: str, response: str, label: str) -> dict[str, float]:
    """The default task with two components: the exact answer, and a small bonus for answering
    with digits only (GDPO normalises each component within its group on its own)."""
    return {"correct": exact(prompt, response, label),
            "format": 0.1 if re.fullmatch(r"-?\d+", response.strip()) else 0.0}


BUILTIN = {"exact": exact, "exact_format": exact_format, "math": math_reward, "format": format_reward,
           "math_format": math_format, "code": code_reward.code_reward,
           # a reasoning-gym task's own checker (--train-data reasoning_gym:NAME)
           "reasoning_gym": reasoning_tasks.reward}
# The verifier parses model output with SymPy, which adversarial output can keep busy for a long time:
# these run in worker processes with this per-call timeout unless --reward-timeout says otherwise.
BOUNDED = BOUNDED_REWARDS


def correct(reward) -> float:
    """Accuracy of one scored response: the "correct" component of a dict reward, else the reward."""
    return float(reward.get("correct", sum(reward.values())) if isinstance(reward, dict) else reward)


def load_reward_fn(spec: str):
    """A built-in name, `package.module:function`, or `path/to/file.py:function` (signature checked:
    nanorl/plugins.py REWARD_SIGNATURE)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: expected one of {sorted(BUILTIN)}, 'module:function' "
                         "or 'file.py:function'")
    return load_checked(spec, "reward")


def score_samples(runner, tokenizer, prompts, samples) -> list:
    """Rewards of `samples` (the n responses of each prompt, consecutive) through `runner`. Log-only
    fields ("_" keys) are moved into each sample's metadata (named in Sample.log_only)."""
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    n = len(samples) // len(prompts)
    out = runner([p.text for p in prompts for _ in range(n)], texts,
                 [p.label for p in prompts for _ in range(n)],
                 samples=samples if runner.wants_sample else None)
    for s, failed in zip(samples, getattr(runner, "faulted", [])):
        if failed and s.status in TRAINS:  # no reward to learn from: it leaves the step (stages.py)
            s.status = "reward_fault"
    # a SpanReward: its spans mapped to the sample's tokens (credits, loss mask: nanorl/spans.py)
    return [place(SpanReward(split_log_only(r.reward, s), r.credit, r.masked), s, tokenizer)
            if isinstance(r, SpanReward) else split_log_only(r, s) for r, s in zip(out, samples)]


def split_log_only(reward, sample):
    """The trained part of `reward`; its "_" keys go to sample.metadata, without the "_".

    A key starting with "_" is LOG-ONLY: never summed or trained on, it is moved into Sample.metadata under
    the name without the "_" ({"_conf": 0.7} → metadata["conf"]), where --reward-postprocess and a user
    advantage can read it, and logged every step under that name (nanorl/plugins.py). The choice: a prefix
    needs no second return value and survives the worker processes unchanged.
    """
    if not isinstance(reward, dict) or not any(k.startswith("_") for k in reward):
        return reward
    logged = {k[1:]: v for k, v in reward.items() if k.startswith("_")}
    sample.metadata.update(logged)
    sample.log_only = sorted(set(sample.log_only or ()) | set(logged))
    # may be {}: a dict, total 0
    return {k: v for k, v in reward.items() if not k.startswith("_")}


# ----------------------------------------------------------------------------- the safe runner


# Larger rewards are bugs, and would overflow the float32 group statistics (a std squares them).
MAX_ABS_REWARD = 1e9


def _checked(value) -> float | dict[str, float] | SpanReward:
    """A reward value must be a finite real number (numpy scalars too), a flat dict of them, or a
    SpanReward of those (`_checked_spans`)."""
    if isinstance(value, SpanReward):
        return _checked_spans(value)
    if isinstance(value, dict):
        return {str(k): _number(v) for k, v in value.items()}
    return _number(value)


def _checked_spans(value: SpanReward) -> SpanReward:
    """Its reward a number or a dict of them, its spans (start, end) integers with 0 <= start <= end,
    its credits finite numbers."""
    def where(a, b) -> tuple[int, int]:
        whole = all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (a, b))
        if not whole or not 0 <= a <= b:
            raise ValueError(f"SpanReward: a span must be (start, end) with 0 <= start <= end, got {(a, b)}")
        return int(a), int(b)
    if isinstance(value.reward, SpanReward):
        raise TypeError("SpanReward: its reward must be a float or a dict of floats, not a SpanReward")
    credit = tuple((*where(a, b), _number(v)) for a, b, v in value.credit)
    return SpanReward(_checked(value.reward), credit, tuple(where(a, b) for a, b in value.masked))


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward must be a float or a dict of floats, got {type(value).__name__}")
    if not (isinstance(value, numbers.Integral) or math.isfinite(value)) or abs(value) > MAX_ABS_REWARD:
        raise ValueError(f"reward is not finite or above {MAX_ABS_REWARD:g} in magnitude: {value}")
    return float(value)


def _call(fn, prompt, response, label, sample=None):
    """Runs in the worker (or in-process): the reward, or ("error", kind, traceback text)."""
    try:
        value = fn(prompt, response, label) if sample is None else fn(prompt, response, label, sample=sample)
        return ("ok", _checked(value))
    # user code: any failure (even sys.exit) is a counted zero
    except (Exception, SystemExit) as e:
        return ("error", type(e).__name__, traceback.format_exc())


# the reward function inside a worker: inherited through fork, or found by `_portable`
_WORKER_FN = None


def exit_with_parent(poll_s: float = 1.0) -> None:
    """In a pool worker: exit once the process that started it is gone. A trainer killed by SIGKILL
    runs no cleanup, and its workers, waiting on a queue whose write end they hold themselves, would
    wait forever (holding the terminal's pipes and a core's worth of imports). Re-parenting shows it."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="nanorl-exit-with-parent").start()


def _set_worker_fn(fn) -> None:
    global _WORKER_FN
    exit_with_parent()
    # Ctrl-C reaches the terminal's whole process group: the trainer decides (`_ctrl_c_guard`) and
    # kills the workers; a worker's own KeyboardInterrupt would come back as the call's result
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_FN = _found(fn) if isinstance(fn, tuple) else fn


def pool_start_method() -> str:
    """How reward workers start. 'fork' copies this process as it is: the reward function needs no
    pickling (a closure works) and a worker is up in milliseconds. But a forked child of a process
    that has initialised CUDA cannot use (or cleanly drop) that context, and vLLM runs threads (its
    engine core, tokenizer pools) whose locks a fork can copy held: there 'forkserver' — workers
    forked from a server process started once, which never touched CUDA or vLLM, with this module
    preloaded; the function goes by name (`_portable`). Measured on CPU (2-core EPYC, 1 torch thread,
    train.py's imports in the parent): a fresh pool's first call took 12-13 ms with fork (0.28-0.32 s
    for `math`: math-verify's import) and with forkserver 2.1-2.2 s for the first pool (the server's
    start) and 1.0-1.2 s for each later one (2.0-2.6 s without the preloads below): a replacement
    pool after every timeout. So fork stays wherever it is safe."""
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_initialized()
    return "forkserver" if cuda or "vllm" in sys.modules else "fork"


def _portable(fn):
    """What a forkserver worker is sent to find `fn` again: a module-level function by (module name,
    file, name); a function of a file nanorl.plugins loaded (registered under a name only this
    process knows) is then loaded again from its file. Anything else must pickle as it is."""
    name, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    module = sys.modules.get(name) if name else None
    if module is not None and qual and "<" not in qual and getattr(module, qual, None) is fn:
        return (name, getattr(module, "__file__", None), qual)
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"reward function {fn!r}: this process has CUDA initialised or vLLM loaded, so "
                         "reward workers start by forkserver, which needs the function by name; define it at "
                         "module level (--reward module:fn or file.py:fn), or run it in-process "
                         f"(--reward-timeout 0): {e}") from e
    return fn


def _found(where: tuple):
    name, path, qual = where
    try:
        # this process's own main module is not the trainer's script
        if name == "__main__":
            raise ImportError(name)
        module = importlib.import_module(name)
    except ImportError:
        if not path:
            raise
        from nanorl.plugins import load_file
        module = load_file(path, "reward")
    return getattr(module, qual)


@contextmanager
def _ctrl_c_guard(timeout: float):
    """While the reward calls run: the first Ctrl-C goes to the handler in place (train.py's: finish
    the step, save) with a note; a second raises KeyboardInterrupt, which ends a call hung in-process
    and, in `_in_workers`, kills the pool. Without it a user reward that never returns made Ctrl-C a
    no-op: train.py's handler only sets a flag the loop reads after the step. Only in the main thread
    (the only one signal handlers run in) and only over a Python handler other than Python's default
    (which already raises); SIG_IGN (an async rollout worker: its parent decides) stays ignored."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    if not callable(previous) or previous is signal.default_int_handler:
        yield
        return
    pressed = []

    def handler(signum, frame):
        pressed.append(signum)
        if len(pressed) > 1:
            raise KeyboardInterrupt
        previous(signum, frame)
        wait = f"up to {timeout:g} s each" if timeout > 0 else "no time limit: --reward-timeout 0"
        # os.write: a print inside a signal handler can hit a print in progress (reentrant call)
        os.write(2, f"Ctrl-C during the reward calls ({wait}): the run stops and saves after this step; "
                    "Ctrl-C again stops it now, without saving\n".encode())

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _call_in_worker(prompt, response, label, sample=None):
    return _call(_WORKER_FN, prompt, response, label, sample)


class RewardRunner:
    """Scores responses with one reward function, counting faults instead of crashing.

    timeout > 0: calls run in `workers` processes (started by `pool_start_method`: fork, where the
    function need not be importable by name, unless CUDA or vLLM make it unsafe) and a call that has not
    returned after `timeout` seconds scores 0; the pool is then replaced, since a hung worker cannot be
    interrupted. timeout == 0: calls run in-process
    (fastest, for trusted built-ins).
    """

    def __init__(self, fn, timeout: float = 0.0, workers: int = 1, log=print):
        self.fn, self.timeout, self.workers, self.log = fn, timeout, workers, log
        self.wants_sample = "sample" in check_call(fn, "reward", "fn(prompt, response, label[, sample])",
                                                   args=3, available={"sample"})
        # kind -> count, over the whole run (checkpointed with the trainer)
        self.faults = Counter()
        self._pool = None
        self._logged = False
        self.faulted: list[bool] = []  # the last call's failed calls, in order

    def __call__(self, prompts: list[str], responses: list[str], labels: list,
                 samples=None) -> list[float | dict]:
        if self.wants_sample and samples is None:
            raise ValueError("this reward takes `sample`: pass the Samples (samples=...)")
        if samples is not None and not self.wants_sample:
            raise ValueError("samples given to a reward without a `sample` parameter")
        samples = samples if samples is not None else [None] * len(prompts)
        with _ctrl_c_guard(self.timeout):
            if self.timeout <= 0:
                results = [_call(self.fn, *job) for job in zip(prompts, responses, labels, samples)]
            else:
                results = self._in_workers(prompts, responses, labels, samples)
        out = [res[1] if res[0] == "ok" else self._fault(res[1], res[2]) for res in results]
        # which calls failed (the last call's): score_samples marks those samples reward_fault
        self.faulted = [res[0] != "ok" for res in results]
        # a failed sample scores a dict of zeros: one kind per batch
        if any(isinstance(r, dict) for r in out):
            names = list(dict.fromkeys(k for r in out if isinstance(r, dict) for k in r if k[:1] != "_"))
            for i, r in enumerate(out):
                if isinstance(r, float):
                    self._fault("MixedTypes", f"reward returned {r!r} where other responses got a dict")
                    self.faulted[i] = True
                # trained names only
                out[i] = r if isinstance(r, dict) else dict.fromkeys(names, 0.0)
        return [0.0 if r is None else r for r in out]

    def _fault(self, kind: str, text: str) -> None:
        self.faults[kind] += 1
        # the first traceback tells the user what is wrong; then just count
        if not self._logged:
            self._logged = True
            self.log(f"reward function failed ({kind}); the sample scores 0, leaves the step (status "
                     f"reward_fault) and is counted. First error:\n{text}")

    def _in_workers(self, prompts, responses, labels, samples):
        """Each call gets `timeout` seconds from when it starts waiting; after a timeout or a dead
        worker the pool is replaced and the calls still pending are resubmitted to the new one.
        A Sample goes to the worker pickled (a copy): what the reward writes into it is lost."""
        jobs = list(zip(prompts, responses, labels, samples))
        results, i = [None] * len(jobs), 0
        while i < len(jobs):
            if self._pool is None:
                method = pool_start_method()
                ctx = mp.get_context(method)
                if method == "forkserver":
                    # imported once by the server (no effect once it runs). Each worker still re-runs
                    # the main script's top level (Python 3.11 never preloads "__main__": its preload
                    # data lacks the main path), so the heavy imports a trainer's script makes are
                    # preloaded too (halves a worker's start: pool_start_method's figures).
                    heavy = [m for m in ("torch", "transformers", "numpy", "reasoning_gym")
                             if m in sys.modules]
                    ctx.set_forkserver_preload(["nanorl.rewards", *heavy])
                fn = self.fn if method == "fork" else _portable(self.fn)
                self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_set_worker_fn,
                                                 initargs=(fn,))
            futures = {j: self._pool.submit(_call_in_worker, *jobs[j]) for j in range(i, len(jobs))}
            for j, f in futures.items():
                try:
                    results[j] = f.result(timeout=self.timeout)
                    i = j + 1
                except (FutureTimeout, BrokenProcessPool) as e:
                    kind = "Timeout" if isinstance(e, FutureTimeout) else "WorkerCrash"
                    results[j] = ("error", kind, f"reward call {kind.lower()} (limit {self.timeout}s)")
                    i = j + 1
                    # the pool is stuck or dead: replace it, resubmit the rest
                    self.close()
                    break
                except BaseException:
                    # Ctrl-C (or any error) while waiting: a hung worker left alive would block the
                    # interpreter's exit forever (concurrent.futures joins its workers at exit)
                    self.close()
                    raise
        return results

    def close(self):
        if self._pool is not None:
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                # a hung worker never returns: kill it rather than wait forever
                proc.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
