"""gpu_check.py stages 3-6: train.py itself, run as a user runs it, on the device.

Stage 3 (`readme_stage`): the README's GPU command line on a random-init model of the real format,
attention calls audited; 4 (`fsdp_stage`): one FSDP2 rank, 3 steps saved every step equal to 2 steps
+ resume + 1; 5 (`async_stage`): --async-steps 1 and 3 under ulimit -n 1024; 6 (`moe_stage`): a
Qwen3-MoE shape with routing replay, the batch on the GPU. Start at `rehearsal_argv` (the flags the
runs share) and `train_subprocess`. Criteria: `crit_run` (the run finished its steps, every number
finite, no reward fault, trainer and engine agree), `crit_resume`, `crit_async`. A stage whose
dependency is absent (math-verify, torch.distributed or NCCL, the MoE model class) is skipped with the
reason (`need_*`).
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import pathlib
import resource
import subprocess
import sys
import time

import torch

# random_batch, micro_batch_loss (never `bench`: bench imports this file)
from gpu_checks.common import ROOT, Check, finite, fmt_s, math_reward_or_skip

# README's
PROMPT_TEMPLATE = "{prompt} Please reason step by step, and put your final answer within \\boxed{}."


def rehearsal_argv(paths: dict, out_dir: str, engine: str, max_new_tokens: int = 1024, steps: int = 3,
                   reward: str = "math") -> list[str]:
    """README's GPU command line (--algo grpo ... --reward math --max-new-tokens 1024 --dtype bfloat16;
    tests/test_gpu_check.py compares) on a real-shape model and GSM8K-format data, `steps` steps of 4 × 4."""
    return ["--algo", "grpo", "--model", paths["model"], "--train-data", paths["train"], "--test-data",
            f"gsm8k={paths['test']}", "--input-key", "question,problem", "--label-key", "answer",
            "--prompt-template",
            PROMPT_TEMPLATE, "--reward", reward, "--engine", engine,
            "--max-new-tokens", str(max_new_tokens), "--dtype", "bfloat16", "--steps", str(steps),
            "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-limit", "4", "--out-dir", out_dir,
            "--quiet"]


@contextlib.contextmanager
def attention_audit():
    """Count every attention call transformers dispatches (AttentionInterface's global mapping: sdpa,
    flash, flex) by the dtype it computes in: autocast's when autocast is on for the query's device
    (sdpa runs in it; the flash path casts to it), else the query's. Yields the Counter."""
    from transformers.modeling_utils import AttentionInterface
    mapping, calls = AttentionInterface._global_mapping, collections.Counter()
    saved = dict(mapping)

    def wrapped(fn):
        def audited(module, query, *args, **kwargs):
            kind = query.device.type
            on = torch.is_autocast_enabled(kind)
            calls[str(torch.get_autocast_dtype(kind) if on else query.dtype)] += 1
            return fn(module, query, *args, **kwargs)
        return audited
    mapping.update({k: wrapped(f) for k, f in saved.items()})
    try:
        yield calls
    finally:
        mapping.update(saved)


def read_steps(out_dir: str) -> dict[int, dict]:
    path = pathlib.Path(out_dir, "metrics.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return step_rows(lines)


def train_in_process(argv: list[str]) -> dict:
    """train.main(argv) here (so the attention hook sees its forwards); rc 1 and the error if it raises."""
    import train
    try:
        out = train.main(argv)
        return dict(rc=0 if out["step"] else 1, error="")
    except Exception as e:  # noqa: BLE001  (a finding of the stage, reported by crit_run)
        return dict(rc=1, error=f"{type(e).__name__}: {e}")


def train_subprocess(c: Check, argv: list[str], nofile: int | None = None, torchrun: bool = False) -> dict:
    """train.py argv in a fresh process (a process group of its own; `nofile`: RLIMIT_NOFILE's soft limit,
    as `ulimit -n` sets it), within the stage's time left."""
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                               str(29600 + os.getpid() % 300)] if torchrun else []) + ["train.py", *argv]
    limit = None if nofile is None else (lambda: resource.setrlimit(
        resource.RLIMIT_NOFILE, (min(nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),) * 2))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, preexec_fn=limit,
                          timeout=max(10, c.deadline - time.monotonic()))
    return dict(rc=proc.returncode, error=(proc.stderr or proc.stdout)[-2000:], stdout=proc.stdout)


def readme_stage(c: Check) -> dict:
    """3: the README GPU line, HF engine, 3 steps, attention calls audited."""
    out = pathlib.Path(c.workdir, "run_readme").as_posix()
    argv = rehearsal_argv(c.real_format("dense"), out, "hf", c.sizes.max_new_tokens)
    with attention_audit() as calls:
        t = time.perf_counter()
        r = train_in_process(argv + c.threads)
        took = time.perf_counter() - t
    r.update(steps=read_steps(out), want_steps=3, attn=dict(calls))
    last = r["steps"].get(3, {})
    c.row("3 README", f"train.py README GPU line, --engine hf, {c.sizes.dense['num_hidden_layers']}-layer "
                      "real shape",
          f"{fmt_s(last.get('perf/time/step', float('nan')))} last step",
          f"whole run {fmt_s(took)}; attention "
          f"calls {dict(calls)}; mismatch ratio_mean {last.get('train/mismatch/ratio_mean')}", argv=argv)
    return r


def fsdp_stage(c: Check) -> dict:
    """4: one FSDP2 rank (NCCL on CUDA, gloo on CPU): 3 steps saved each step == 2 + resume + 1."""
    out = pathlib.Path(c.workdir, "run_fsdp")
    argv = ["--fsdp", "--dtype", "bfloat16", "--steps", "3", "--save-every", "1", "--prompts-per-step", "8",
            "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "8", "--quiet", "--out-dir",
            str(out), *c.threads]
    first = train_subprocess(c, argv, torchrun=True)
    done = read_steps(out)
    import shutil
    shutil.rmtree(out / "checkpoints" / "step_000003", ignore_errors=True)
    again = train_subprocess(c, argv + ["--resume", "latest"], torchrun=True)
    redone = read_steps(out)
    # CUDA kernels may reorder sums between two processes (atomics in backward): a relative 1e-4
    r = dict(rc={"first": first["rc"], "resumed": again["rc"]}, first=done.get(3, {}),
             again=redone.get(3, {}),
             rel_tol=0.0 if c.device.type == "cpu" else 1e-4, resumed="at step 2" in again["stdout"],
             error=first["error"] if first["rc"] else again["error"])
    c.row("4 FSDP", "torchrun 1 rank, --fsdp bf16, built-in task: 3 steps vs 2 + resume + 1",
          f"exit {first['rc']}, {again['rc']}", f"{len(r['first'])} metrics at step 3")
    return r


def async_stage(c: Check) -> dict:
    """5: --async-steps 1 and 3 on the real shape under ulimit -n 1024."""
    res = {}
    for K in (1, 3):
        out = pathlib.Path(c.workdir, f"run_async{K}").as_posix()
        argv = rehearsal_argv(c.real_format("dense"), out, "hf", c.sizes.moe_new_tokens, steps=2,
                              reward=c.reward()) + ["--async-steps", str(K), *c.threads]
        r = train_subprocess(c, argv, nofile=1024)
        r.update(steps=read_steps(out), want_steps=2)
        res[f"K{K}"] = r
        c.row("5 async", f"--async-steps {K}, ulimit -n 1024, {c.sizes.dense['num_hidden_layers']}-layer "
                         "real shape",
              f"exit {r['rc']}", f"{len(r['steps'])} steps; reward {c.reward()}")
    return res


def moe_stage(c: Check) -> dict:
    """6 (B2): --routing-replay on a Qwen3-MoE shape, HF engine (records routing: R3), attention audited:
    the replayed recompute with the batch on the GPU; --reward math where math-verify imports, else the
    stand-in reward (no extra wheel needed)."""
    out = pathlib.Path(c.workdir, "run_moe").as_posix()
    argv = rehearsal_argv(c.real_format("moe"), out, "hf", c.sizes.moe_new_tokens, steps=2,
                          reward=c.reward()) + ["--routing-replay", *c.threads]
    with attention_audit() as calls:
        r = train_in_process(argv)
    r.update(steps=read_steps(out), want_steps=2, attn=dict(calls), need=("routing/disagreement",))
    last = r["steps"].get(2, {})
    c.row("6 MoE", f"--routing-replay, {c.sizes.moe['num_experts']} experts top "
                   f"{c.sizes.moe['num_experts_per_tok']}",
          f"replay mode {last.get('routing/replay_mode')}",
          f"disagreement {last.get('routing/disagreement')}, attention calls {dict(calls)}")
    return r


def need_math() -> str | None:
    return math_reward_or_skip()


def need_fsdp() -> str | None:
    import torch.distributed as dist
    if not dist.is_available():
        return "torch.distributed not available"
    if torch.cuda.is_available() and not dist.is_nccl_available():
        return "NCCL not available"
    return None


def need_moe() -> str | None:
    import transformers
    return None if hasattr(transformers, "Qwen3MoeConfig") else "transformers has no Qwen3MoeConfig"


# Each takes a stage's measured results (plain numbers and dicts) and returns the reasons it fails:
# [] passes. tests/test_gpu_check.py feeds each one a planted fault.
MISMATCH_TOL, ESS_MIN = 0.05, 0.9


def step_rows(lines: list[dict]) -> dict[int, dict]:
    """metrics.jsonl lines → {step: metrics} of the training steps (lines with a train/ or rollout/
    metric: a step whose samples all left it — failed, filtered — logs no train/ metric but is a step)."""
    out = {}
    for x in lines:
        if any(k.startswith(("train/", "rollout/")) for k in x):
            out.setdefault(x["step"], {}).update(x)
    return out


def crit_run(r: dict) -> list[str]:
    """Stages 3, 5, 6: a train.py run finished its steps, every number finite, no reward fault, trainer
    and engine agree (train/mismatch/*); with `attn` (a {dtype: calls} audit) every attention call in
    bf16; with `need` every named metric logged on every step."""
    bad = [] if r.get("rc", 0) == 0 else [f"exit status {r['rc']}: {r.get('error', '')[-300:]}"]
    steps = r["steps"]
    if sorted(steps) != list(range(1, r["want_steps"] + 1)):
        bad.append(f"steps logged {sorted(steps)}, want 1..{r['want_steps']}")
    for s, m in sorted(steps.items()):
        nan = [k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)]
        faults = {k: v for k, v in m.items() if "reward_faults/" in k and v}
        if nan:
            bad.append(f"step {s}: not finite: {nan[:5]}")
        if faults:
            bad.append(f"step {s}: reward faults {faults}")
        if not any(k.startswith("train/") for k in m):
            dropped = {k: v for k, v in m.items() if k.startswith("rollout/dropped")}
            bad.append(f"step {s}: no update (every sample left the step: {dropped})")
            continue
        mean, ess = m.get("train/mismatch/ratio_mean"), m.get("train/mismatch/ratio_ess")
        if not (finite(mean) and abs(mean - 1) <= MISMATCH_TOL and finite(ess) and ess >= ESS_MIN):
            bad.append(f"step {s}: mismatch ratio_mean {mean}, ess {ess} (want |mean − 1| <= {MISMATCH_TOL}, "
                       f"ess >= {ESS_MIN})")
        missing = [k for k in r.get("need", ()) if k not in m]
        if missing:
            bad.append(f"step {s}: missing {missing}")
    if "attn" in r:
        calls = r["attn"]
        if not calls:
            bad.append("attention audit: no attention call seen (not dispatched through AttentionInterface)")
        elif set(calls) != {"torch.bfloat16"}:
            bad.append(f"attention audit: calls by compute dtype {dict(calls)}, want bf16 only")
    return bad


def crit_resume(r: dict) -> list[str]:
    """Stage 4: the resumed run's last step equals the uninterrupted run's, metric by metric (perf/
    aside: the machine, not the math), within rel_tol; both runs exited 0."""
    bad = [f"{k} exit status {rc}" for k, rc in r["rc"].items() if rc != 0]
    a, b = r["first"], r["again"]
    if not a or a.keys() - {"step"} != b.keys() - {"step"} and not bad:
        bad.append(f"resumed step logs other metrics: {sorted(a.keys() ^ b.keys())[:5]}")
    for k, v in a.items():
        w = b.get(k)
        if k.startswith("perf/") or not isinstance(v, (int, float)) or w is None:
            continue
        if not abs(v - w) <= r["rel_tol"] * max(abs(v), abs(w), 1e-12):
            bad.append(f"resume mismatch {k}: {v!r} vs {w!r}")
    if not r.get("resumed"):
        bad.append("the second run did not resume from the step-2 checkpoint")
    return bad


def crit_async(r: dict) -> list[str]:
    return [f"{k}: {why}" for k, run in r.items() for why in crit_run(run)]
