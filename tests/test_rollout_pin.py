"""The HF engine's samples at the real vocabulary, pinned bit for bit: tokens, rollout logprobs and KSM
supports of a small batch on a Qwen2.5-0.5B-shaped model (vocabulary 151936, hidden 896; one layer so
it is quick), against tests/golden/rollout_real_shape.json.

    python tests/test_rollout_pin.py --record   # re-record (a deliberate sampling change: its own commit)
    python -m pytest -q tests/test_rollout_pin.py

A faster decode loop must sample the same tokens with the same logprobs. Like tests/test_golden.py the
cases run in a child process with kernels every x86-64 CPU runs alike (test_golden.PORTABLE), so the
floats are compared exactly on any x86-64 machine with the recorded torch / transformers versions.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_golden import PORTABLE, assert_same_versions, fingerprint, run_portable  # noqa: E402

from nanorl.rollout import HFEngine, SamplingConfig  # noqa: E402
from nanorl.task import ENDOFTEXT, QWEN25_05B  # noqa: E402

GOLDEN = os.path.join(ROOT, "tests", "golden", "rollout_real_shape.json")
# name: sampling; every config goes through both paths of the loop (shared prefill: 3 prompts × 2
# samples, and one row per prompt) with 3 left-padded prompt lengths
CASES = {
    "t1": dict(temperature=1.0),
    "t07_topk_topp_ksm": dict(temperature=0.7, top_k=40, top_p=0.9, keep_support=True, support_cap=16),
    "topp_no_ksm": dict(temperature=1.0, top_p=0.8),
    "topk_ksm": dict(temperature=1.0, top_k=5, keep_support=True),
    "greedy": dict(temperature=0.0),
    # ids that t1 samples at steps 1-3 of some rows: rows finish at different steps, finished rows pad
    "stops": dict(temperature=1.0, stop_token_ids=(94534, 29254, 104216)),
}
PROMPTS = [[11, 12, 13, 14, 15, 16], [200, 300, 400], [151000, 7, 8, 9, 10]]
# the batch: 8 prompts × 4 samples (32 rows), prompts of 9-16 tokens
BATCH32 = [[(97 * i + 13 * j) % 151000 + 1 for j in range(9 + i)] for i in range(8)]


def real_shape_model() -> torch.nn.Module:
    """One Qwen2.5-0.5B layer, fp32, random init, with an untied head scaled ×8: random tied embeddings
    just repeat the last token, a random head ×1 is ~uniform over 152k; this one keeps a few dozen ids
    likely, so temperature, top-k and top-p all change what is drawn."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    shape = {**QWEN25_05B, "tie_word_embeddings": False}
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=1, pad_token_id=ENDOFTEXT, **shape)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def run_cases(model) -> dict:
    out = {}
    for name, kw in CASES.items():
        runs = ((2, PROMPTS), (1, PROMPTS)) + (((4, BATCH32),) if name in ("t1", "t07_topk_topp_ksm") else ())
        for n, prompts in runs:
            sp = SamplingConfig(max_new_tokens=6, seed=7, **kw)
            samples = HFEngine(model, pad_id=ENDOFTEXT).generate(prompts, n, sp)
            out[f"{name}_n{n}"] = dict(
                tokens=[s.response_ids for s in samples],
                status=[s.status for s in samples],
                # exact floats: hex of the stored fp32 value
                logprobs=[[float(x).hex() for x in s.rollout_logprobs] for s in samples],
                support=[hashlib.sha256(s.sampling_support.numpy().tobytes()).hexdigest()[:16]
                         + f":{tuple(s.sampling_support.shape)}" if s.sampling_support is not None else None
                         for s in samples])
    return out


@pytest.fixture(scope="module")
def golden():
    return json.load(open(GOLDEN))


@pytest.mark.slow
def test_real_shape_samples_are_pinned(golden, tmp_path):
    if platform.machine() not in ("x86_64", "AMD64"):  # the pinned kernels are x86-64's
        pytest.skip(f"pinned on x86-64, this is {platform.machine()}")
    data = run_portable(__file__, str(tmp_path / "pin.json"))
    assert_same_versions(golden["fingerprint"], data["fingerprint"])
    got = data["cases"]
    assert set(got) == set(golden["cases"])
    for case, want in golden["cases"].items():
        for key in want:
            assert got[case][key] == want[key], f"{case}: {key} differs"


def test_pinned_cases_exercise_filters_and_stops(golden):
    """The fixture is not vacuous: some rows stop early, KSM rows keep several ids, samples differ."""
    cases = golden["cases"]
    assert "completed" in cases["stops_n2"]["status"] and "truncated" in cases["stops_n2"]["status"]
    assert len({tuple(t) for t in cases["t1_n2"]["tokens"]}) > 1
    assert len(cases["t1_n4"]["tokens"]) == 32
    assert any(s.endswith(", 16)") for s in cases["t07_topk_topp_ksm_n4"]["support"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--out"]:  # the child
        assert all(os.environ.get(k) == v for k, v in PORTABLE.items()), "run through run_portable"
        torch.set_num_threads(1)
        json.dump({"fingerprint": fingerprint(), "cases": run_cases(real_shape_model())},
                  open(sys.argv[2], "w"), indent=0)
    elif sys.argv[1:] == ["--record"]:
        run_portable(__file__, GOLDEN + ".tmp")
        os.replace(GOLDEN + ".tmp", GOLDEN)
        print("recorded", GOLDEN)
    else:
        sys.exit("usage: python tests/test_rollout_pin.py --record")
