"""Failed samples leave the loss; --sample-filter drops more; --log-kl logs the KL without using it.

Statuses (nanorl/trajectory.py STATUSES / TRAINS): an aborted request, an environment error, a tool
timeout and a reward fault never train; the step drops them after scoring (nanorl/stages.py
keep_trainable) and counts them. A user filter runs at the same point, on 2 ranks with unequal drops
without a hang. --log-kl with kl_coef 0 scores the reference and logs the KL, the loss unchanged.
"""
import json
import os
import subprocess
import sys

import pytest

import train
from nanorl import rounds
from nanorl.weight_broadcast import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a reward that raises on every response ending in "7": a reward fault (the sample leaves the step)
FAULTY = '''
def reward(prompt, response, label):
    if response.strip().endswith("7"):
        raise RuntimeError("planted reward failure")
    return float(response.strip() == label)
'''
# a filter that keeps only the samples of even groups, and on rank 1 none at all
FILTER = '''
import os
def keep(samples):
    if os.environ.get("RANK") == "1":
        return [False] * len(samples)
    return [s.group_id % 2 == 0 for s in samples]
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl.task import make_default
    d = tmp_path_factory.mktemp("task")
    paths = make_default(str(d), seed=0)
    (d / "faulty.py").write_text(FAULTY)
    (d / "keep.py").write_text(FILTER)
    return {**paths, "faulty": f"{d / 'faulty.py'}:reward", "keep": f"{d / 'keep.py'}:keep"}


def args(task, out, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--out-dir", str(out), "--prompts-per-step", "4", "--samples-per-prompt", "4",
            "--eval-every", "0", "--eval-limit", "4", "--threads", "1", "--quiet", *extra]


def test_failed_samples_train_no_token_and_are_counted(task, tmp_path, monkeypatch):
    """Planted: sample 0 of every group aborted, sample 1 an environment error (statuses the engine and
    the episode driver set), and a reward that raises on answers ending in 7. Only the rest reach the
    update: the batch holds exactly them, and the counts say what left."""
    real_generate, seen, planted = rounds.generate, [], {}

    def generate(run, prompts, n, sampling):
        samples = real_generate(run, prompts, n, sampling)
        for i, s in enumerate(samples):
            s.status = {0: "aborted", 1: "env_error"}.get(i % n, s.status)
        planted["samples"] = samples
        return samples

    monkeypatch.setattr(rounds, "generate", generate)
    real_train_on = train.train_on
    monkeypatch.setattr(train, "train_on", lambda run, batch: seen.append(batch) or real_train_on(run, batch))
    run = train.setup(train.parse_args(args(task, tmp_path, "--steps", "1", "--reward", task["faulty"],
                                            "--reward-timeout", "0", "--kl-coef", "0")))
    try:
        metrics = train.rl_step(run)
    finally:
        run.logger.close()
    samples = planted["samples"]
    faulted = [s for s in samples if s.status == "reward_fault"]
    kept = [s for s in samples if s.status in ("completed", "truncated")]
    assert faulted, "the planted reward failure never fired: the test would mean nothing"
    assert all(run.tokenizer.decode(s.response_ids, skip_special_tokens=True).strip().endswith("7")
               for s in faulted)
    batch = seen[0]
    # the update got exactly the samples that train: no row of a failed one, none of its tokens
    assert batch.response_ids.shape[0] == len(kept) < len(samples)
    got = sorted(tuple(r[m > 0].tolist()) for r, m in zip(batch.response_ids, batch.response_mask))
    assert got == sorted(tuple(s.response_ids) for s in kept)
    assert metrics["rollout/dropped/aborted"] == 4 and metrics["rollout/dropped/env_error"] == 4
    assert metrics["rollout/dropped/reward_fault"] == len(faulted)
    assert metrics["rollout/dropped_frac"] == pytest.approx((8 + len(faulted)) / 16)
    assert run.rewards.faults["RuntimeError"] == len(faulted)


def test_log_kl_logs_the_kl_and_leaves_the_loss_alone(task, tmp_path):
    rows = {}
    for name, extra in (("plain", []), ("log_kl", ["--log-kl"])):
        train.main(args(task, tmp_path / name, "--steps", "3", "--kl-coef", "0", *extra))
        rows[name] = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")
                      if "train/loss" in line]
    assert len(rows["plain"]) == len(rows["log_kl"]) == 3
    assert [r["train/loss"] for r in rows["plain"]] == [r["train/loss"] for r in rows["log_kl"]]
    assert [r["train/grad_norm"] for r in rows["plain"]] == [r["train/grad_norm"] for r in rows["log_kl"]]
    # step 1: the policy IS the reference; after two updates it has moved away from it
    assert rows["log_kl"][0]["train/kl_ref"] == 0.0 < rows["log_kl"][2]["train/kl_ref"]
    assert "train/kl_ref" not in rows["plain"][2]


def test_log_kl_is_refused_with_a_kl_term():
    from nanorl.config import Config
    with pytest.raises(ValueError, match="log_kl is for kl_coef 0"):
        Config.from_flags(kl_coef=0.1, log_kl=True)


def test_a_filter_that_returns_no_verdict_per_sample_is_an_error(task, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def keep(samples):\n    return True\n")
    run = train.setup(train.parse_args(args(task, tmp_path / "run", "--steps", "1",
                                            "--sample-filter", f"{bad}:keep")))
    try:
        with pytest.raises(TypeError, match="one bool per sample"):
            train.rl_step(run)
    finally:
        run.logger.close()


@pytest.mark.slow
def test_sample_filter_on_two_ranks_with_unequal_drops(task, tmp_path):
    """Rank 0 keeps the even groups, rank 1 nothing: both ranks finish every step (no hang), rank 1
    joins each update with zero-weight rows, and the counts are the pooled ones."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()),
           os.path.join(ROOT, "train.py"), *args(task, out, "--steps", "2", "--sample-filter", task["keep"],
                                               "--kl-coef", "0")]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if "rollout/dropped_frac" in line]
    assert len(rows) == 2 and "2 steps in" in res.stdout
    # each rank samples 2 prompts x 4: rank 0 drops the odd group (4 of 8), rank 1 all 8; the logged
    # values are the means over the ranks
    assert all(r["rollout/dropped_frac"] == pytest.approx((0.5 + 1.0) / 2) for r in rows)
    assert all(r["rollout/dropped/filtered"] == pytest.approx((4 + 8) / 2) for r in rows)
