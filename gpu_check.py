"""gpu_check.py — the one-shot device check: what a lent GPU machine runs once, in ~6 minutes.

    python gpu_check.py --json gpu_check.json  # one CUDA device (same as: python bench.py --gpu --json ...)
    python gpu_check.py --cpu                  # the CPU dry run, every stage at tiny sizes (test_gpu_check)
    python gpu_check.py --help                 # the stages, in run order, with their time limits

Made for one CUDA device without vLLM, flash-attn or network: models are real shapes with random weights
built in memory (nanorl/task.py). Eleven stages run in order of value, each under its own time limit: 1 step
(fwd+bwd+AdamW of the Qwen2.5-0.5B shape: time, MFU, peak memory), 2 head (the Triton fused head against
torch and fp32), then what issue 45 fixes and only a GPU shows: 7 B1 (the async vLLM worker's weight
channel on one GPU, two processes), 8 M4 (the memory plan against a 7B shape's measured peak), 6 MoE
(B2: routing replay's recompute with the batch on the GPU), 9 M2 (the fused head on a second GPU), 10
TF32 (the fp32 sync bound); then 4 FSDP (save/resume equivalence), 5 async, 3 README (train.py with the
README's GPU line), 11 N2 (vLLM's model runner and its sync check across sleep; skipped without vLLM).
A stage whose dependency is absent is skipped with the reason, a stage that raises or runs out of time
is a FAIL row, and the next stage runs; the table is printed and written (--table).
Each stage's pass criterion is a pure function over its measured results (`crit_*`), so tests feed it
planted faults. --cpu runs every stage's code with the device parts stood in for (the host's shared
memory for CUDA IPC, tensor bytes for the allocator, the torch path for a second GPU). Start at `main`,
then `run_stage`; the stages live in gpu_checks/, one module per group (common: sizes and the shared
`Check`; step_and_head: 1-2; train_runs: 3-6; weights_and_memory: 7-8; head_and_sync: 9-11). Sizes and
criteria of stages 1-6: docs/from-slime-verl.md, "gpu_check.py"; MFU: `step_flops`. Rewards: --reward
math needs math-verify (not on the device image: docs/bench_results.md); without it stage 3 is skipped
and 5 and 6 use a stand-in reward.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import pathlib
import re
import signal
import sys
import tempfile
import time

import torch

from gpu_checks.common import FULL, SMOKE, Check, machine
from gpu_checks.head_and_sync import (
    crit_device_head,
    crit_runner,
    crit_tf32,
    device_head_stage,
    need_second_gpu,
    need_vllm,
    runner_stage,
    tf32_stage,
)
from gpu_checks.step_and_head import crit_heads, crit_step, head_stage, step_stage
from gpu_checks.train_runs import (
    async_stage,
    crit_async,
    crit_resume,
    crit_run,
    fsdp_stage,
    moe_stage,
    need_fsdp,
    need_math,
    need_moe,
    readme_stage,
)
from gpu_checks.weights_and_memory import crit_memory, crit_transport, memory_stage, transport_stage
from nanorl import precision

# (label, stage, criterion, time limit in s on the device, dependency check → skip reason or None)
STAGES = (("1 step", step_stage, crit_step, 100, None),
          ("2 head", head_stage, crit_heads, 70, None),
          ("7 B1", transport_stage, crit_transport, 60, None),
          ("8 M4", memory_stage, crit_memory, 150, None),
          ("6 MoE", moe_stage, crit_run, 60, need_moe),
          ("9 M2", device_head_stage, crit_device_head, 60, need_second_gpu),
          ("10 TF32", tf32_stage, crit_tf32, 45, None),
          ("4 FSDP", fsdp_stage, crit_resume, 60, need_fsdp),
          ("5 async", async_stage, crit_async, 60, None),
          ("3 README", readme_stage, crit_run, 150, need_math),
          # last: vLLM in this process stays loaded
          ("11 N2", runner_stage, crit_runner, 120, need_vllm))


@contextlib.contextmanager
def time_limit(limit: int):
    """Raise TimeoutError in the running stage after `limit` seconds (SIGALRM: main thread, Unix)."""
    def stop(signum, frame):
        raise TimeoutError(f"still running after {limit} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(max(1, limit))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def table(rows: list) -> str:
    head = ("section", "what", "value", "note")
    lines = [tuple(str(r[k]) for k in head) for r in rows]
    widths = [max(len(x[i]) for x in lines + [head]) for i in range(len(head))]
    fmt = lambda x: " | ".join(v.ljust(w) for v, w in zip(x, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in lines])


def run_stage(c: Check, label: str, stage, criterion, limit: int, need) -> dict:
    """One stage: skipped with its reason, or run under its limit and judged by its criterion."""
    why = None if c.device.type == "cuda" or c.smoke else "no CUDA (use --smoke on a CPU)"
    why = why or (need() if need else None)
    if why:
        c.row(label, "stage", "SKIP", why)
        return dict(status="skip", reasons=[why])
    c.deadline = time.monotonic() + limit
    try:
        with time_limit(limit):
            results = stage(c)
        reasons = criterion(results)
    # One broken stage (an OOM, a kernel that fails to compile, a missing package) must not hide the
    # figures of the others: its error is its finding.
    except Exception as e:  # noqa: BLE001
        results, reasons = None, [f"{type(e).__name__}: {str(e)[:400]}"]
    c.row(label, "pass criterion", "FAIL" if reasons else "PASS", "; ".join(reasons)[:600])
    return dict(status="fail" if reasons else "pass", reasons=reasons, results=results)


def stage_list() -> str:
    """--help's list: each stage in run order, its time limit on the device and its first doc line."""
    def first(doc: str) -> str:  # its first sentence, on one line
        words = re.sub(r"^\d+:? ", "", " ".join(doc.split()).split(". ")[0])  # the label says it
        return words if len(words) <= 92 else words[:89] + "..."
    lines = [f"  {label:<9} {limit:>4} s  {first(stage.__doc__)}" for label, stage, _, limit, _ in STAGES]
    return "stages, in run order (--only takes their numbers):\n" + "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, epilog=stage_list(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true",
                   help="the CPU dry run: tiny sizes, every stage on the host (CUDA hidden), the device "
                        "parts stood in for")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, every stage, on this machine's device (figures mean nothing)")
    p.add_argument("--json", default="", help="also write machine, sizes, rows and each stage's results here")
    p.add_argument("--table", default="gpu_check.txt", help="write the printed table here too")
    p.add_argument("--only", default="", help="comma-separated stage numbers to run (e.g. 1,2); default all")
    p.add_argument("--budget", type=int, default=360,
                   help="seconds for the whole run; later stages are skipped")
    args = p.parse_args(argv)
    if args.cpu:  # before CUDA starts: this process and every child see no GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    smoke = args.smoke or args.cpu
    device = torch.device("cuda" if not args.cpu and torch.cuda.is_available() else "cpu")
    # TF32 for the fp32 matmuls, as train.py sets it
    precision.setup_device(device)
    info = machine(device)
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), file=sys.stderr, flush=True)
    start, sizes, stages = time.monotonic(), SMOKE if smoke else FULL, {}
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    with tempfile.TemporaryDirectory(prefix="nanorl-gpu-check-") as workdir:
        c = Check(sizes, device, workdir, smoke=smoke)
        for label, stage, criterion, limit, need in STAGES:
            left = int(args.budget - (time.monotonic() - start))
            if only and label.split()[0] not in only:
                continue
            print(f"[{time.monotonic() - start:5.0f} s] {label} ...", file=sys.stderr, flush=True)
            if left <= 0:
                c.row(label, "stage", "SKIP", "out of time (--budget)")
                stages[label] = dict(status="skip", reasons=["out of time"])
                continue
            # smoke: CPU sizes, but a busy CPU is slower than the device: limits at 3×
            stages[label] = run_stage(c, label, stage, criterion, min(limit * (3 if smoke else 1), left),
                                      need)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    failed = [f"{k}: {'; '.join(v['reasons'])}" for k, v in stages.items() if v["status"] == "fail"]
    total = round(time.monotonic() - start, 1)
    report = table(c.rows) + f"\nfailed: {failed or 'none'}\nseconds: {total}"
    print(report, flush=True)
    if args.table:
        pathlib.Path(args.table).write_text(report + "\n")
    if args.json:
        out = dict(machine=info, smoke=smoke, sizes=dataclasses.asdict(sizes), rows=c.rows,
                   stages=stages,
                   failed=failed, seconds=total)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
