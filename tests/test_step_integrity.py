"""Integrity of one real training step, end to end through train.py (issue 15):

- the gradient train_on accumulates does not depend on how the step is split into micro-batches
  (whole-step loss denominators, through the real rl_step → train_on path, not a hand-made loop);
- reward faults are run totals: they accumulate over calls and continue across a checkpoint resume;
- the engine holds the weight version of the step it is at, and every sample carries the version of
  the weights that sampled it.

Every test here fails when its feature is broken (checked by planting each bug). Tiny runs on the
built-in task, one torch thread. Run: python -m pytest tests/test_step_integrity.py -q
"""
import hashlib
import json
import os

import pytest
import torch

import train
from nanorl import build, update
from nanorl.config import parse_args
from nanorl.rewards import RewardRunner
from nanorl.rollout import HFEngine
from nanorl.task import make_default

# A reward with variance in (nearly) every group whatever the model says, so GRPO advantages, and the
# gradient of the first step, are clearly non-zero.
DIGITS = "def digits(prompt, response, label):\n    return sum(c.isdigit() for c in response) / 4\n"
# Faults on every odd answer, and appends one line per call ("1" = raised) to a log beside it: the
# test's own count of faults, independent of the counter under test.
FAULTY = '''import os
LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.log")
def odd_faults(prompt, response, label):
    odd = int(label) % 2 == 1
    with open(LOG, "a") as f:
        f.write("1\\n" if odd else "0\\n")
    if odd:
        raise RuntimeError("odd label")
    return sum(c.isdigit() for c in response) / 4
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """One built-in task + warm-started model shared by every test here."""
    d = tmp_path_factory.mktemp("task")
    paths = make_default(str(d), seed=0)
    (d / "digits.py").write_text(DIGITS)
    paths["digits"] = f"{d / 'digits.py'}:digits"
    return paths


def args(task, out, *extra, test_data=True):
    test = ["--test-data", task["test"]] if test_data else []
    return ["--model", task["model"], "--train-data", task["train"], *test, "--out-dir", str(out),
            "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "8",
            "--pass-k", "2", "--threads", "1", "--quiet", *extra]


def metric_lines(out) -> list[dict]:
    return [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
            if "rollout/reward_mean" in r]


# ----------------------------------------------------------------------------- (1) micro-batch split


def first_step_gradient(task, out, monkeypatch, *extra):
    """The gradient one real step (train.setup → rl_step → train_on) hands to the optimizer, flat,
    and the sizes of the micro-batches it was accumulated over."""
    run = train.setup(parse_args(args(task, out, "--reward", task["digits"], "--grad-clip", "0",
                                      # all 16 rows
                                      "--max-new-tokens", "6", "--no-skip-zero-advantage", *extra)))
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    grads, sizes = [], []
    real_micro_step = update.micro_step

    def capture(optimizer, a, k):  # the gradient accumulated over every micro-batch, before the step
        grads.append(torch.cat([p.grad.detach().flatten().clone() for p in params]))

    def counted(run_, mb, *a):  # one call per micro-batch of train_on
        sizes.append(mb.input_ids.shape[0])
        return real_micro_step(run_, mb, *a)
    run.optimizer.register_step_pre_hook(capture)
    monkeypatch.setattr(update, "micro_step", counted)
    try:
        metrics = train.rl_step(run)
    finally:
        monkeypatch.setattr(update, "micro_step", real_micro_step)
        run.logger.close()
        run.rewards.close()
    assert len(grads) == 1 and sum(sizes) == 16, (len(grads), sizes)  # one optimizer step, every sample once
    return grads[0], sizes, metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_step_gradient_does_not_depend_on_micro_batching(mode, task, tmp_path, monkeypatch):
    """Whole-step denominators (TRL #3021) through the real train_on: one micro-batch, fixed-size
    micro-batches of 2, and token-budgeted micro-batches give the same gradient."""
    whole, sizes, m = first_step_gradient(task, tmp_path / "whole", monkeypatch, "--loss-agg", mode)
    assert sizes == [16]
    assert whole.norm() > 0.1, whole.norm()  # GRPO groups with signal: a real gradient, not zero
    # ragged
    assert (m["train/advantage_abs_mean"] > 0.1
            and m["rollout/response_length_max"] > m["rollout/response_length_mean"])
    variants = {"fixed": ("--micro-batch-size", "2"), "budget": ("--max-tokens-per-micro-batch", "24")}
    for name, extra in variants.items():
        g, sizes, m2 = first_step_gradient(task, tmp_path / name, monkeypatch, "--loss-agg", mode, *extra)
        n = len(sizes)
        assert n > 1, (name, sizes)  # really split
        assert m2["rollout/reward_mean"] == m["rollout/reward_mean"]  # the same rollout
        rel = float((g - whole).norm() / whole.norm())
        assert rel < 1e-5, f"{mode}, {name} ({n} micro-batches): gradient differs by {rel:.2e} (relative)"


def test_gradient_checkpointing_changes_no_gradient(task, tmp_path, monkeypatch):
    """--gradient-checkpointing recomputes each block in backward: in fp32 the step's gradient is the
    plain one (the model trains in train() mode either way; dropout is 0). Also with a token budget."""
    plain, _, _ = first_step_gradient(task, tmp_path / "plain", monkeypatch)
    assert plain.norm() > 0.1
    for name, extra in {"ckpt": (), "ckpt+budget": ("--max-tokens-per-micro-batch", "24")}.items():
        g, sizes, _ = first_step_gradient(task, tmp_path / name, monkeypatch, "--gradient-checkpointing",
                                          *extra)
        rel = float((g - plain).norm() / plain.norm())
        assert rel < 1e-5, f"{name}: gradient differs by {rel:.2e}"


@pytest.mark.parametrize("extra", [("--algo", "ppo", "--dtype", "bfloat16"),
                                   ("--algo", "grpo", "--gradient-checkpointing")],
                         ids=["ppo-bf16", "grpo-checkpointing"])
def test_builtin_task_runs_in_bf16_and_with_checkpointing(extra, task, tmp_path):
    """Issue 15's two commands on the built-in task: PPO's critic in bf16 (an fp32 value head on a bf16
    body used to crash) and GRPO with checkpointing: both complete with finite metrics."""
    res = train.main(args(task, tmp_path, "--steps", "2", *extra))
    lines = [m for m in metric_lines(tmp_path) if "train/loss" in m]
    assert res["step"] == 2 and len(lines) == 2
    assert all(v == v and abs(v) != float("inf") for m in lines for v in m.values() if isinstance(v, float))
    if "ppo" in extra:
        assert all(m["train/vf_loss"] > 0 for m in lines)  # the critic trained


# ----------------------------------------------------------------------------- (2) reward fault totals


def test_reward_fault_totals_accumulate_over_calls():
    def fn(prompt, response, label):
        if label == "raise":
            raise RuntimeError("boom")
        if label == "nan":
            return float("nan")
        return 1.0
    runner = RewardRunner(fn, log=lambda *a: None)
    labels = ["ok", "raise", "nan", "raise"]
    for call in range(1, 4):
        assert runner(["p"] * 4, ["r"] * 4, labels) == [1.0, 0.0, 0.0, 0.0]
        assert dict(runner.faults) == {"RuntimeError": 2 * call, "ValueError": call}
    runner(["p"], ["r"], ["ok"])  # a call without faults keeps the totals
    assert dict(runner.faults) == {"RuntimeError": 6, "ValueError": 3}


def test_reward_fault_totals_continue_across_resume(task, tmp_path):
    """The logged reward_faults/* are run totals: after --resume latest they continue from the
    checkpoint's, not from zero. (No held-out set: only training calls the reward.)"""
    (tmp_path / "faulty.py").write_text(FAULTY)
    calls = tmp_path / "calls.log"
    out = tmp_path / "run"
    run_args = lambda steps, *extra: args(task, out, "--reward", f"{tmp_path / 'faulty.py'}:odd_faults",
                                          "--steps", str(steps), *extra, test_data=False)
    train.main(run_args(2))
    train.main(run_args(4, "--resume", "latest"))
    log = calls.read_text().split()
    per_step = 4 * 4  # one reward call per sample, no evaluation
    assert len(log) == 4 * per_step
    expected = [log[:k * per_step].count("1") for k in range(1, 5)]  # faults up to each step
    assert expected[1] > 0 and expected[3] > expected[1]  # faults before and after the resume
    lines = metric_lines(out)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert [r.get("rollout/reward_faults/RuntimeError", 0) for r in lines] == expected
    state = json.load(open(os.path.join(out, "checkpoints", "step_000004", "trainer_state.json")))
    assert state["reward_faults"] == [{"RuntimeError": expected[3]}]


# ----------------------------------------------------------------------------- (3) weight versions


def fingerprint(model) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_engine_holds_each_steps_weight_version(task, tmp_path, monkeypatch):
    """After step k the engine holds version k; every sample carries the version of the weights it
    was sampled from (weights fingerprinted when each version is loaded, and again at generation);
    a resumed run's engine starts at the checkpoint's step."""
    loaded, calls, after_step = {}, [], []

    class Recording(HFEngine):
        def update_weights(self, model, version):
            super().update_weights(model, version)
            loaded[version] = fingerprint(model)

        def generate(self, prompts, n, sampling):
            samples = super().generate(prompts, n, sampling)
            calls.append((n, self.version, {s.weight_version for s in samples}, fingerprint(self.model)))
            return samples

    real_step = train.rl_step

    def checked_step(run):
        metrics = real_step(run)
        after_step.append((run.step + 1, run.engine.version))  # main counts the step after rl_step
        return metrics
    monkeypatch.setattr(build, "HFEngine", Recording)
    monkeypatch.setattr(train, "rl_step", checked_step)
    out = tmp_path / "run"
    train.main(args(task, out, "--reward", task["digits"], "--steps", "3", "--lr", "1e-3", "--warmup-steps",
                    "0"))
    assert after_step == [(1, 1), (2, 2), (3, 3)]
    rollouts = [c for c in calls if c[0] == 4]  # the training rollouts (evaluation samples 1 or 2)
    assert [c[1] for c in rollouts] == [0, 1, 2]  # step k samples from the weights of step k - 1
    assert len(calls) == 3 + 4 and [c[1] for c in calls if c[0] != 4] == [0, 0, 3, 3]  # eval: before, after
    for n, version, tags, weights in calls:
        assert tags == {version}, (n, version, tags)  # samples tagged with the engine's version ...
        assert weights == loaded[version], f"engine at version {version} samples from other weights"
    assert len({loaded[v] for v in range(4)}) == 4  # ... and every step really changed the weights
    # Resume: the engine starts at the checkpoint's step, holding exactly that step's weights.
    saved = loaded[3]
    for record in (loaded, calls, after_step):
        record.clear()
    train.main(args(task, out, "--reward", task["digits"], "--steps", "4", "--lr", "1e-3", "--warmup-steps",
                    "0",
                    "--resume", "latest"))
    assert loaded.get(3) == saved, f"resumed engine: versions {sorted(loaded)}, not step 3's weights"
    assert after_step == [(4, 4)]
    assert [c[1] for c in calls] == [3, 3, 3, 4, 4]  # eval before, the rollout of step 4, eval after
    for n, version, tags, weights in calls:
        assert tags == {version} and weights == loaded[version], (n, version, tags)
