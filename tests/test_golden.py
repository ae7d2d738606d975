"""The behaviour fingerprint: a few steps of every preset and of the main feature flags, every logged
metric (wall-clock and memory ones aside), against tests/golden/steps.json — bit for bit.

    python tests/test_golden.py --record     # re-record (a deliberate behaviour change: its own commit)
    python -m pytest -q tests/test_golden.py

Recorded before the spine refactor (issue 31) so that the refactor is shown to change nothing. Floats
are compared exactly, which holds on the kind of machine that recorded them: the same torch and
transformers versions and the same CPU (model name and the SIMD level torch dispatches to). Elsewhere
the warm-started model itself already differs in its last bits, so the test skips with the reason
rather than compare noise; re-record there first (on the old code) to use it.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GOLDEN = os.path.join(ROOT, "tests", "golden", "steps.json")
STEPS = 3

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
    "dppo_tv": (["--policy-loss", "dppo_tv"], "default"),
    "dppo_kl": (["--policy-loss", "dppo_kl"], "default"),
    "reinforce_loss": (["--policy-loss", "reinforce"], "default"),
    "dro": (["--policy-loss", "dro"], "default"),
    "top_entropy": (["--top-entropy-quantile", "0.2", "--entropy-coef", "0.01"], "default"),
    "dual_clip": (["--dual-clip", "3.0"], "default"),
    "no_whiten": (["--advantage", "reinforce_pp", "--no-whiten-advantages"], "default"),
    "naive_logprob": (["--logprob-impl", "naive"], "default"),
    "rollout_old_logprobs": (["--old-logprobs", "rollout", "--ppo-epochs", "2"], "default"),
    "env_calc": (["--env", "calc", "--max-new-tokens", "12"], "own"),
    "async": (["--async-steps", "1"], "default"),
    "routing_replay": (["--routing-replay", "--max-new-tokens", "4"], "moe"),
}
CASES = {**PRESET_CASES, **FEATURE_CASES}


def fingerprint() -> dict:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, "cpu": cpu,
            "capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine()}


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


@pytest.fixture(scope="module")
def golden():
    if not os.path.exists(GOLDEN):
        pytest.fail(f"{GOLDEN} missing: record it with python tests/test_golden.py --record")
    data = json.load(open(GOLDEN))
    if data["fingerprint"] != fingerprint():
        pytest.skip(f"golden recorded on {data['fingerprint']}, this is {fingerprint()}: "
                    "bits differ by machine")
    return data


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    return make_tasks(str(root)), str(root)


@pytest.mark.parametrize("name", list(CASES))
def test_step_metrics_are_bit_for_bit_the_golden(golden, tasks, name):
    if name not in golden["cases"]:  # a case added after the recording (re-record on the old code first)
        pytest.skip(f"{name}: not in {GOLDEN}; record it with python tests/test_golden.py --record")
    rows = run_case(name, *tasks)
    want = golden["cases"][name]
    assert len(rows) == len(want), f"{name}: {len(rows)} logged rows, golden has {len(want)}"
    for i, (got, exp) in enumerate(zip(rows, want)):
        assert sorted(got) == sorted(exp), f"{name} row {i}: keys differ: {sorted(set(got) ^ set(exp))}"
        diff = {k: (got[k], exp[k]) for k in exp if not same(got[k], exp[k])}
        assert not diff, f"{name} row {i} (step {exp.get('step')}): {len(diff)} metrics differ: {diff}"


def test_the_golden_covers_every_preset():
    from nanorl.presets import PRESETS
    assert sorted(n.removeprefix("preset_") for n in PRESET_CASES) == sorted(PRESETS)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_golden.py --record")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as root:
        tasks = make_tasks(root)
        cases = {}
        for name in CASES:
            cases[name] = run_case(name, tasks, root)
            print(f"{name}: {len(cases[name])} rows, {len(cases[name][-1])} metrics in the last", flush=True)
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
        json.dump({"fingerprint": fingerprint(), "steps": STEPS, "cases": cases}, f, indent=0, sort_keys=True)
    print(f"wrote {GOLDEN}")
