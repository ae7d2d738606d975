"""The behaviour fingerprint: a few steps of every preset and of the main feature flags, every logged
metric (wall-clock and memory ones aside), against tests/golden/steps*.json — bit for bit.

    python tests/test_golden.py --record     # re-record (a deliberate behaviour change: its own commit)
    python tests/test_golden.py --add-cpu    # this CPU's recording, on the code the golden was made on
    python -m pytest -q tests/test_golden.py

The cases run in one child process whose kernels are pinned (PORTABLE): ATen's scalar kernels instead
of its AVX2/AVX-512 ones (which sum in another order), MKL's conditional-numerical-reproducibility mode
and one thread. A one-ulp change anywhere in a loss or an advantage shows in a logged metric. Pinned,
most x86-64 CPUs compute the same bits, but not all: on a Xeon with AMX and AVX512-FP16 the step-0
eval rows match and the training rows of 44 of the 45 cases differ, with no pin found that aligns it
(2026-12-05). So steps.json is the first CPU's recording (a 2-core AMD EPYC) and steps.<cpu>.json
another's (steps.intel-xeon-processor.json: that Xeon), recorded on the same commit; a run must equal
one of them in every case. Another torch or transformers version computes other bits: the test then
fails and says so (re-record on the old code first, then compare).

Carried keys (issue 47, eval logs what rollout logs): the eval rows' eval/<set>/reward_mean,
truncated_frac and reward/<component> were recorded on the Xeon only, its every earlier key checked
unchanged, and copied into steps.json's eval rows: all 90 eval rows of the two recordings were equal on
every earlier key (accuracy, pass@k, response length), so the eval samples are taken to be the same on
both CPUs and the new keys, sums of those samples' statuses and rewards, too. For the step-0 evals (same
weights) that holds; for the final evals it is inferred from those equal keys, not measured on the EPYC:
a run there that differs only in a carried key is this carry's error, not a behaviour change.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GOLDEN = os.path.join(ROOT, "tests", "golden", "steps.json")  # --record writes it, --add-cpu steps.CPU.json
STEPS = 3
# Set before torch loads (hence a child process): kernels every x86-64 CPU runs alike, in the same order.
PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "0"}  # the torch log-prob path, as on a plain CPU run

# name: (flags, task) — task "default": the built-in task's files and warm start; "moe": the same data
# with a tiny random Qwen3-MoE; "own": no --model/--train-data (the flags bring their own task)
PRESET_CASES = {f"preset_{name}": (["--algo", name], "default") for name in (
    "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo", "gspo", "cispo",
    "gmpo", "opo", "otb", "remax", "sapo", "gpg", "kl_cov", "clip_cov", "gdpo")}
# "teacher": the default task, distilled from the tiny MoE (it shares the built-in tokenizer)
PRESET_CASES["preset_distill"] = (["--algo", "distill"], "teacher")
FEATURE_CASES = {
    "kl_in_reward": (["--kl-in-reward", "--kl-coef", "0.05", "--kl-estimator", "k1"], "default"),
    "kl_loss_k2_every_row": (["--kl-coef", "0.05", "--kl-estimator", "k2", "--no-skip-zero-advantage"],
                             "default"),
    "kl_target": (["--kl-coef", "0.05", "--kl-target", "0.01"], "default"),
    "unbiased_kl": (["--kl-coef", "0.05", "--unbiased-kl"], "default"),
    "tis": (["--tis-cap", "2.0", "--old-logprobs", "recompute"], "default"),
    # recorded when MIS always recomputed π_old; on-policy it now comes from the update's forward, whose
    # weights and loss are the same (tests/test_plan.py) but its metrics cover only the rows that train
    "mis_sequence": (["--mis-high", "2.0", "--is-level", "sequence", "--old-logprobs", "recompute"],
                     "default"),
    "ksm": (["--keep-sampling-mask", "--top-k", "8"], "default"),
    "micro_batch_size": (["--micro-batch-size", "3"], "default"),
    "token_budget": (["--max-tokens-per-micro-batch", "48"], "default"),
    "epochs_mini_batches": (["--ppo-epochs", "2", "--mini-batches", "2"], "default"),
    "ppo_epochs_mini_batches": (["--algo", "ppo", "--ppo-epochs", "2", "--mini-batches", "2"], "default"),
    "gae_chunked": (["--algo", "ppo", "--advantage", "gae_chunked"], "default"),
    "grpo_passk": (["--advantage", "grpo_passk"], "default"),
    "grpo_passk_max": (["--advantage", "grpo_passk_max"], "default"),
    # a second epoch moves the ratio off 1: on-policy these four losses are the same -A·logp; DPPO's
    # trust regions bind only after a larger step
    "dppo_tv": (["--policy-loss", "dppo_tv", "--ppo-epochs", "2", "--lr", "3e-3"], "default"),
    "dppo_kl": (["--policy-loss", "dppo_kl", "--ppo-epochs", "2", "--lr", "3e-3"], "default"),
    "reinforce_loss": (["--policy-loss", "reinforce", "--ppo-epochs", "2"], "default"),
    "dro": (["--policy-loss", "dro", "--ppo-epochs", "2"], "default"),
    "top_entropy": (["--top-entropy-quantile", "0.2", "--entropy-coef", "0.01"], "default"),
    # c near 1 and a second epoch: the cap binds (with c = 3 on-policy it never does)
    "dual_clip": (["--dual-clip", "1.02", "--ppo-epochs", "2"], "default"),
    "no_whiten": (["--advantage", "reinforce_pp", "--no-whiten-advantages"], "default"),
    "naive_logprob": (["--logprob-impl", "naive"], "default"),
    "rollout_old_logprobs": (["--old-logprobs", "rollout", "--ppo-epochs", "2"], "default"),
    "env_calc": (["--env", "calc", "--max-new-tokens", "12"], "own"),
    "async": (["--async-steps", "1"], "default"),
    "routing_replay": (["--routing-replay", "--max-new-tokens", "4"], "moe"),
}
CASES = {**PRESET_CASES, **FEATURE_CASES}


def fingerprint() -> dict:
    """What the bits depend on once the kernels are pinned: the libraries' versions and the architecture."""
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "machine": platform.machine(), "portable": PORTABLE}


def kept(key: str) -> bool:
    """Every logged metric but wall-clock and memory ones (they differ run to run)."""
    return not (key.startswith(("time/", "perf/")) or "memory" in key or "_mib" in key
                or "tokens_per_s" in key)


def make_tasks(root: str) -> dict:
    from nanorl import moe_replay, task as builtin
    paths = builtin.make_default(os.path.join(root, "task"), seed=0)
    tok = builtin.build_tokenizer()
    moe = moe_replay.tiny_moe("qwen3_moe", seed=0, vocab_size=len(tok), pad_token_id=0, eos_token_id=1)
    moe.save_pretrained(os.path.join(root, "moe"))
    tok.save_pretrained(os.path.join(root, "moe"))
    return {"default": paths, "moe": {**paths, "model": os.path.join(root, "moe")}}


def run_case(name: str, tasks: dict, root: str) -> list[dict]:
    import train
    flags, kind = CASES[name]
    out = os.path.join(root, name)
    common = ["--out-dir", out, "--steps", str(STEPS), "--prompts-per-step", "4", "--samples-per-prompt", "4",
              "--eval-every", "0", "--eval-limit", "4", "--pass-k", "2", "--threads", "1", "--quiet",
              "--seed", "3"]
    task = tasks["default" if kind == "teacher" else kind] if kind != "own" else None
    data = [] if kind == "own" else ["--model", task["model"], "--train-data", task["train"],
                                      "--test-data", task["test"]]
    data += ["--teacher", tasks["moe"]["model"]] if kind == "teacher" else []
    torch.manual_seed(0)
    train.main(data + common + flags)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    return [{k: v for k, v in row.items() if kept(k)} for row in rows]


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def run_all(out: str, cases: list[str]) -> None:
    """In the child: every case on one set of task files, the rows to `out` as JSON."""
    assert all(os.environ.get(k) == v for k, v in PORTABLE.items()), "run through run_portable"
    with tempfile.TemporaryDirectory() as root:
        tasks = make_tasks(root)
        rows = {name: run_case(name, tasks, root) for name in cases}
    with open(out, "w") as f:
        json.dump({"fingerprint": fingerprint(), "steps": STEPS, "cases": rows}, f, indent=0, sort_keys=True)


def run_portable(script: str, out: str, *args: str, timeout: float = 900) -> dict:
    """`python script --out out *args` in a child process under PORTABLE; the JSON it wrote to `out`
    (this file's cases, or tests/test_rollout_pin.py's)."""
    env = {**os.environ, **PORTABLE}
    child = [sys.executable, os.path.abspath(script), "--out", out, *args]
    proc = subprocess.run(child, env=env, cwd=ROOT, timeout=timeout, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, f"{os.path.basename(script)}'s portable run failed:\n{proc.stdout[-4000:]}"
    return json.load(open(out))


def assert_same_versions(recorded: dict, got: dict) -> None:
    """The recording's torch and transformers are this run's: other versions compute other bits."""
    want, have = ({k: fp[k] for k in ("torch", "transformers")} for fp in (recorded, got))
    assert want == have, (f"recorded with {want}, this is {have}: install those (the README's install "
                          "line) or re-record on the old code first")


def recordings() -> dict[str, dict]:
    """file name → recording: steps.json and every other CPU's steps.<cpu>.json (same commit)."""
    folder = os.path.dirname(GOLDEN)
    names = sorted(n for n in os.listdir(folder) if n.startswith("steps") and n.endswith(".json"))
    return {n: json.load(open(os.path.join(folder, n))) for n in names}


def cpu_tag() -> str:
    """This CPU's model name as a file-name tag (only names a recording; the match decides)."""
    model = next((line.split(":", 1)[1] for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    words = re.sub(r"\((r|tm)\)", "", model.lower())  # "Intel(R) Xeon(R) Processor" → intel-xeon-processor
    return re.sub(r"[^a-z0-9]+", "-", words).strip("-") or "cpu"


@pytest.fixture(scope="module")
def golden():
    if not os.path.exists(GOLDEN):
        pytest.fail(f"{GOLDEN} missing: record it with python tests/test_golden.py --record")
    if platform.machine() not in ("x86_64", "AMD64"):  # the pinned paths are x86-64's
        pytest.skip(f"the golden is recorded for x86-64 CPUs, this is {platform.machine()}")
    return recordings()


def whole_matches(recording: dict, observed: dict) -> int:
    return sum(observed.get(name) == rows for name, rows in recording["cases"].items())


@pytest.fixture(scope="module")
def observed(golden, tmp_path_factory):
    got = run_portable(__file__, str(tmp_path_factory.mktemp("golden") / "observed.json"), *CASES)
    for recording in golden.values():
        assert_same_versions(recording["fingerprint"], got["fingerprint"])
    return got["cases"]


@pytest.fixture(scope="module")
def expected(golden, observed):
    """The recording this CPU computes: the one most cases equal whole (a behaviour change breaks
    only some cases; a CPU with other bits breaks every case of every recording)."""
    name, best = max(golden.items(), key=lambda kv: whole_matches(kv[1], observed))
    assert whole_matches(best, observed) > 0, (
        f"no case equals any recording ({', '.join(golden)}): this CPU computes other bits, or every "
        "case changed. Check out the commit the golden was recorded on and run python "
        "tests/test_golden.py --add-cpu there, then compare this code")
    return name, best


@pytest.mark.parametrize("name", list(CASES))
def test_step_metrics_are_bit_for_bit_the_golden(expected, observed, name):
    file, golden = expected
    assert name in golden["cases"], f"{name}: not in {file}; record it on the old code first"
    rows, want = observed[name], golden["cases"][name]
    assert len(rows) == len(want), f"{name}: {len(rows)} logged rows, {file} has {len(want)}"
    for i, (got, exp) in enumerate(zip(rows, want)):
        assert sorted(got) == sorted(exp), f"{name} row {i}: keys differ: {sorted(set(got) ^ set(exp))}"
        diff = {k: (got[k], exp[k]) for k in exp if not same(got[k], exp[k])}
        assert not diff, f"{name} row {i} (step {exp.get('step')}): {len(diff)} metrics differ: {diff}"


def test_every_cpus_recording_has_the_same_cases_and_keys():
    """A CPU's recording is the same commit's behaviour: same cases, rows and metric names."""
    shape = {n: {c: [sorted(r) for r in rows] for c, rows in rec["cases"].items()}
             for n, rec in recordings().items()}
    first = shape.pop("steps.json")
    for name, other in shape.items():
        assert other == first, f"{name} holds other cases or metrics than steps.json: record it on its commit"


def test_the_golden_covers_every_preset():
    from nanorl.presets import PRESETS
    assert sorted(n.removeprefix("preset_") for n in PRESET_CASES) == sorted(PRESETS)


def test_no_two_cases_log_the_same_rows():
    """A case whose flag changes nothing in 3 steps proves nothing about that flag (a second epoch moves
    the ratio off 1, which most losses need to differ)."""
    cases = json.load(open(GOLDEN))["cases"]
    seen = {}
    for name, rows in cases.items():
        key = json.dumps(rows, sort_keys=True)
        assert key not in seen, f"{name} logs exactly what {seen[key]} logs"
        seen[key] = name


if __name__ == "__main__":
    if sys.argv[1:2] == ["--out"]:  # the child
        run_all(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:] == ["--record"]:  # a new behaviour: the other CPUs' recordings are stale
        data = run_portable(__file__, GOLDEN + ".tmp", *CASES)
        os.replace(GOLDEN + ".tmp", GOLDEN)
        stale = [n for n in recordings() if n != "steps.json"]
        for n in stale:
            os.remove(os.path.join(os.path.dirname(GOLDEN), n))
        print(f"wrote {GOLDEN}: {len(data['cases'])} cases" + (f"; removed {stale}" if stale else ""))
    elif sys.argv[1:] == ["--add-cpu"]:
        path = GOLDEN.replace("steps.json", f"steps.{cpu_tag()}.json")
        data = run_portable(__file__, path + ".tmp", *CASES)
        if any(rec == data for rec in recordings().values()):
            os.remove(path + ".tmp")
            sys.exit("this CPU computes a recording already there: nothing to add")
        os.replace(path + ".tmp", path)
        print(f"wrote {path}: {len(data['cases'])} cases")
    else:
        sys.exit("usage: python tests/test_golden.py --record | --add-cpu")
