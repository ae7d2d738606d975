"""bench.py: the CI smoke run (`python bench.py --quick --json ...`) and its bookkeeping.

No speed thresholds: CI machines differ. What is checked is that every entry runs, the correctness
checks inside the bench pass (loop vs chunked GAE, loop vs vectorised group advantages, reference vs
total_loss), and the figures it reports are self-consistent (order statistics, ratios, shares).
Run: python -m pytest tests/test_bench.py -q
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench  # noqa: E402
import bench_components  # noqa: E402

ENTRIES = {"gae", "group_adv", "policy_loss", "logprob", "scaling", "grpo_step", "rollout", "trainer",
           "train_memory", "weight_sync", "eval_sharded", "padding", "ksm", "routing_replay", "reward_model",
           "async_steps", "default", "default_threads", "distill", "lora_memory", "real_model"}


@pytest.mark.slow
def test_quick_run_reports_every_entry(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # time torch, not the interpreter
    env["OMP_NUM_THREADS"] = "1"  # vLLM (when installed) binds its threads before torch.set_num_threads runs
    proc = subprocess.run([sys.executable, "bench.py", "--quick", "--threads", "1", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    # An entry whose optional package is missing is skipped (README install: no vLLM), every other one runs
    skipped = {n for n, (module, _) in bench.NEEDS.items() if importlib.util.find_spec(module) is None}
    skipped |= {"real_model"} if bench.smollm2_path() is None else set()
    assert set(data["skipped"]) == skipped and all(f"skipped {n}: needs" in proc.stdout for n in skipped)
    assert set(bench.Bench.ENTRIES) == ENTRIES and {r["bench"] for r in rows} == ENTRIES - skipped
    assert data["failed"] == []
    assert sum(n.startswith("ok: gae") for n in data["notes"]) == 2  # both lengths checked
    m = data["machine"]
    assert m["cpu"] and m["torch_threads"] == 1 and m["torch"] == torch.__version__
    assert "×base" in proc.stdout and "machine: cpu=" in proc.stdout

    base = {(r["bench"], r["case"]): r for r in rows if r["baseline"]}
    # the guarded checks below must have rows to check: timed rows, and non-baseline rows with a speedup
    assert any("q1" in r for r in rows) and any(r.get("speedup") is not None for r in rows)
    for r in rows:
        if "q1" in r:  # timed rows: order statistics of >= 3 repetitions
            assert r["reps"] >= 3 and 0 < r["min"] <= r["q1"] <= r["median"] <= r["q3"] <= r["max"]
        if r.get("speedup") is not None:
            b = base[(r["bench"], r["case"])]
            assert math.isclose(r["speedup"], b["median"] / r["median"], rel_tol=1e-9)
    for name in ("gae", "group_adv", "policy_loss", "logprob", "trainer"):  # every case has its baseline
        cases = {r["case"] for r in rows if r["bench"] == name}
        assert cases and all((name, c) in base for c in cases), name
    # measured (Linux), never negative
    assert all(r["peak_mib"] >= 0 for r in rows if r["bench"] == "logprob")
    for axis in ("T", "B"):  # scaling series: one row per size, each with its ns/token
        assert sum(r["case"] == f"total_loss vs {axis}" and "ns/token" in r["note"] for r in rows) == 3

    phases = {r["impl"]: r["median"] for r in rows if r["bench"] == "grpo_step"}
    assert set(phases) == {"generate", "reward", "logprob", "advantage", "train", "sync", "whole step"}
    assert phases["generate"] + phases["train"] <= phases["whole step"] * 1.5  # medians of parts vs whole

    ev = {r["impl"]: r for r in rows if r["bench"] == "eval_sharded"}  # 1 and 2 ranks, same greedy accuracy
    assert set(ev) == {"1 rank", "2 ranks"} and all(r["median"] > 0 for r in ev.values())
    assert "ok: eval_sharded: 2-rank greedy accuracy == 1-rank" in data["notes"]
    # 2 models × (time, 2 peaks)
    sync = {(r["case"], r["impl"]): r for r in rows if r["bench"] == "weight_sync"}
    assert "weight_sync" in skipped or len(sync) == 6 and all(r.get("peak_mib") is not None
                                                              for (c, _), r in sync.items() if "peak" in c)
    mem = {r["impl"]: r for r in rows if r["bench"] == "train_memory"}  # 2 × 2 configurations, one case
    assert set(mem) == {f"checkpointing {c}, {layout}" for c in ("off", "on")
                        for layout in ("padded", "packed")}
    assert mem["checkpointing off, padded"]["baseline"] and len({r["case"] for r in mem.values()}) == 1
    for r in mem.values():
        assert r["median"] > 0 and r["peak_mib"] >= 0 and "KiB/token" in r["note"]
        assert math.isclose(r["bytes_per_token"], r["peak_mib"] * 2**20 / r["tokens"])
    assert any("flash-attn" in n for n in data["notes"])  # the packed caveat is stated

    modes = {r["impl"]: r for r in rows if r["bench"] == "async_steps"}  # same task, sync vs K = 1, 2
    vllm = {"sync, vLLM", "async K=1, vLLM", "async K=1, TIS 2, vLLM"}  # where vllm is installed
    assert set(modes) - vllm == {"sync", "async K=1", "async K=2", "async K=1, TIS 2", "sync, lr 1.5e-4",
                                 "async K=1, lr 1.5e-4", "sync, LoRA r8, lr 1e-3",
                                 "async K=1, LoRA r8, lr 1e-3"} and modes["sync"]["baseline"]
    # a LoRA version carries the adapters alone: a fraction of the full policy's bytes
    assert 0 < modes["async K=1, LoRA r8, lr 1e-3"]["version_mib"] < modes["async K=1"]["version_mib"] / 10
    assert set(modes) & vllm in (set(), vllm)
    assert all(r["steps_per_s"] > 0 and r["steps_run"] == 3 and "steps/s" in r["note"]
               for r in modes.values())

    seeds = [r for r in rows if r["bench"] == "default"]  # quick: seed 0, 3 steps of train.py --algo grpo
    assert [r["impl"] for r in seeds] == ["seed 0"] and 0 <= seeds[0]["accuracy_end"] <= 1
    assert {"generate", "train", "step"} <= set(seeds[0]["phase_ms"]) and seeds[0]["train_s"] > 0
    threads = {(r["case"], r["impl"]): r for r in rows if r["bench"] == "default_threads"}
    assert set(threads) == {(c, f"{n} thread(s)") for c in ("machine as it is", "one core busy")
                            for n in (1, 2)}

    real = {(r["case"].split(": ")[1], r["impl"]): r for r in rows if r["bench"] == "real_model"}
    # each phase beside its plain-PyTorch reference on the same tokens, and the whole step
    assert "real_model" in skipped or set(real) == {
        ("generate", "plain generate"), ("generate", "nanorl generate"), ("logprob", "plain forward"),
        ("logprob", "nanorl logprob"), ("train", "plain fwd+bwd+AdamW"), ("train", "nanorl train"),
        ("whole step", "nanorl rl_step")} and all(r["median"] > 0 for r in real.values())

    shares = {r["impl"]: r["padding_share"] for r in rows if r["bench"] == "padding"}
    assert shares["token budget, packed"] == 0.0
    assert all(0 < s < 1 for k, s in shares.items() if "packed" not in k)


def test_peak_mib_sees_a_large_cpu_allocation():
    alloc = lambda: torch.ones(64 << 20, dtype=torch.uint8)  # noqa: E731  64 MiB written, then freed
    peak = bench.peak_mib(alloc, "cpu")
    assert peak is None or 60 <= peak <= 200  # None off Linux
    b = bench.Bench(quick=True, device=torch.device("cpu"), budget=0.0, threads=1, workdir="")
    again = b.peak_mib(alloc)  # the method is the same measurement on the bench's device
    assert (peak is None) == (again is None) and (again is None or 60 <= again <= 200)


def test_group_adv_loop_baseline_hand_computed():
    # one group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3); RLOO: r_i - mean of the other three
    scores, index, mask = torch.tensor([1.0, 0, 0, 1, 5]), torch.tensor([0, 0, 0, 0, 1]), torch.ones(5, 2)
    grpo = bench_components.group_adv_loop(scores, mask, index)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(grpo[:, 0], torch.tensor([a, -a, -a, a, 0.0]))  # group of one -> 0
    rloo = bench_components.group_adv_loop(scores, mask, index, leave_one_out=True)
    torch.testing.assert_close(rloo[:, 1], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 0.0]))


def test_loss_reference_matches_total_loss():
    x = bench_components.rl_inputs(3, 17, "cpu", seed=1)
    torch.testing.assert_close(bench_components.loss_nanorl(x)[0], bench_components.loss_reference(x)[0],
                               rtol=1e-5, atol=1e-6)


def test_table_ratio_is_baseline_over_impl():
    rows = [dict(bench="b", case="c", impl="slow", baseline=True, median=2.0),
            dict(bench="b", case="c", impl="fast", baseline=False, median=0.5, q1=0.4, q3=0.6)]
    text = bench.table(rows)
    assert "4×" in text and "base" in text and rows[1]["speedup"] == 4.0


def test_an_entry_without_its_package_is_skipped_and_only_fails_when_asked_for(monkeypatch, capsys):
    monkeypatch.setitem(bench.NEEDS, "padding", ("no_such_module_nanorl", "pip install no-such-module"))
    assert bench.missing_dependencies(["gae", "padding"]) == {
        "padding": "needs no_such_module_nanorl, not installed (install: pip install no-such-module)"}
    # --only naming it: the run cannot do what was asked, so it says so and exits non-zero
    assert bench.main(["--quick", "--only", "padding"]) == 1
    out = capsys.readouterr().out
    assert "skipped padding: needs no_such_module_nanorl" in out and "cannot run here: padding" in out


def test_allocated_peak_mib_counts_what_is_live_at_once():
    """Three 4 MiB tensors live at the peak, then all freed: 12 MiB exactly (the profiler's allocation
    events, not resident memory), and a step that allocates nothing adds nothing."""
    def three_live():
        a = torch.ones(1 << 20)  # 4 MiB fp32
        b = a * 2
        c = b + a
        del a, b
        return float((c * 2).sum())  # c and c * 2 live: 8 MiB, below the peak of 12

    assert bench.allocated_peak_mib(three_live) == 12.0
    assert bench.allocated_peak_mib(lambda: None) == 0.0
