"""gpu_check.py: its --smoke run on a CPU (every section runs or says why it is skipped, none raises),
the MFU FLOP count against a hand computation, the GPU peak table, and the rehearsal's command line
against the README's GPU line. The GPU figures themselves need a GPU: `python bench.py --gpu`.
Run: python -m pytest tests/test_gpu_check.py -q
"""
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gpu_check  # noqa: E402
from nanorl.config import Config  # noqa: E402

SECTIONS = {"1 train step", "2 memory", "3 logprob", "4 generate", "5 rehearsal", "6 vLLM"}


def test_smoke_run_reports_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter is slow
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "gpu_check.py", "--smoke", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["failed"] == [] and data["smoke"] is True
    assert {r["section"] for r in rows} == SECTIONS
    assert not any(r["what"] == "FAILED" for r in rows)
    assert all(r["value"] for r in rows)
    cpu = not torch.cuda.is_available()
    by = {(r["section"], r["what"]): r for r in rows}
    if cpu:  # what needs CUDA says so instead of failing
        assert by[("5 rehearsal", "train.py README GPU flags")]["value"] == "skipped: no CUDA"
        assert by[("1 train step", "MFU")]["value"] == "n/a"
    assert by[("3 logprob", "torch vs naive")]["value"] == "PASS"
    assert any(r["section"] == "2 memory" and "checkpointing on" in r["what"] for r in rows)
    assert "section" in proc.stdout and "failed: none" in proc.stdout  # the one table, at the end


def test_step_flops_of_qwen25_05b_by_hand():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    with torch.device("meta"):  # the shape only: no memory, no init time
        model = Qwen2ForCausalLM(Qwen2Config(**gpu_check.FULL.model))
    # per layer: q, o 896×896; k, v 896×128 (2 KV heads of 64); gate, up, down 896×4864
    per_layer = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864
    assert gpu_check.block_matmul_params(model) == 24 * per_layer == 357_826_560  # "0.36B non-embedding"
    rows, T, scored = 4, 2048, 4 * 1536
    want = 6 * 24 * per_layer * rows * T + 12 * 24 * 896 * T * rows * T + 6 * 151936 * 896 * scored
    assert gpu_check.step_flops(model, rows, T, scored) == want


def test_peak_table_by_device_name():
    assert gpu_check.peak_bf16("NVIDIA H200") == 989e12
    assert gpu_check.peak_bf16("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_check.peak_bf16("NVIDIA A100-SXM4-80GB") == 312e12
    for other in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "Tesla T4"):  # not the SXM figure: MFU n/a
        assert gpu_check.peak_bf16(other) is None


def test_rehearsal_is_the_readme_gpu_command_line():
    readme = open(os.path.join(ROOT, "README.md")).read()
    line = re.search(r"python train\.py --algo grpo --model Qwen.*?(?=\n\S|\naccelerate)", readme, re.S).group(0)
    words = shlex.split(line.replace("\\\n", " "), comments=True)
    flags = {w: v for w, v in zip(words, words[1:]) if w.startswith("--")}
    argv = gpu_check.rehearsal_argv({"model": "M", "train": "T.jsonl", "test": "E.jsonl"}, "OUT", "hf")
    given = dict(zip(argv[::2], argv[1::2]))
    for flag, value in flags.items():
        if flag not in ("--model", "--train-data", "--test-data", "--engine"):  # ours: files made in code; no vLLM
            assert given[flag] == value, flag
    assert given["--engine"] == "hf" and given["--input-key"] == "question,problem"  # GSM8K's and MATH's columns
    fields = {f.name for f in dataclasses.fields(Config)}
    assert all(a[2:].replace("-", "_") in fields for a in argv if a.startswith("--"))


def test_bench_gpu_flag_runs_gpu_check(monkeypatch):
    import bench
    seen = []
    monkeypatch.setattr(gpu_check, "main", lambda argv: seen.append(argv) or 0)
    assert bench.main(["--gpu", "--quick", "--json", "x.json"]) == 0
    assert seen == [["--smoke", "--json", "x.json"]]  # --quick means --smoke there


def test_time_limit_stops_a_running_section():
    t = time.perf_counter()
    with pytest.raises(TimeoutError):
        with gpu_check.time_limit(1):
            time.sleep(10)
    assert time.perf_counter() - t < 5
