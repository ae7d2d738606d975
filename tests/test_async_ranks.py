"""--async-steps with several trainer ranks (nanorl/pipeline.py): rank 0's rollout worker samples every
rank's prompts, each rank trains its shard, and 2 ranks (gloo, 1 thread each) take the steps one
process takes on the union; a 2-rank run resumed from its checkpoint is the uninterrupted run.
Every run sits under test_lockstep's timeout.   python -m pytest tests/test_async_ranks.py -q
"""
import json
import os

import pytest
import torch
from test_lockstep import run as launch

from nanorl import checkpoint
from nanorl.weight_broadcast import free_port

pytestmark = pytest.mark.slow  # the slow tier (README): CI runs it, `-m slow`

BASE = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "8",
        "--quiet", "--threads", "1", "--schedule", "constant", "--lr", "1e-3", "--warmup-steps", "0"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl.task import make_default
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0, sft_steps=60)


def train(task, out, *extra, ranks=1, port=0):
    proc = launch("train.py", "--model", task["model"], "--train-data", task["train"], "--test-data",
                  task["test"], "--out-dir", str(out), *BASE, *extra, ranks=ranks, port=port)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def weights(out, step):
    return checkpoint.load_file(os.path.join(out, "checkpoints", f"step_{step:06d}", "model.safetensors"))


def gap(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_ranks_with_one_worker_equal_one_process_on_the_union(task, tmp_path):
    """K = 1 with a KL term (the worker scores the reference on each rank's shard) for 4 steps: the
    2-rank run's weights equal one process's within twice the fp32 floor, measured here as one
    process against itself with another micro-batch split (the same sums in another order; see
    test_lockstep), and its logged rewards are the one process's: the same samples, sharded."""
    extra = ("--steps", "4", "--async-steps", "1", "--kl-coef", "0.01")
    train(task, tmp_path / "one", *extra)
    train(task, tmp_path / "split", *extra, "--micro-batch-size", "4")
    out = train(task, tmp_path / "two", *extra, ranks=2, port=free_port())
    assert "ranks in sync" in out
    one, split, two = (weights(tmp_path / d, 4) for d in ("one", "split", "two"))
    init = checkpoint.load_file(os.path.join(task["model"], "model.safetensors"))
    assert gap(one, init) > 1e-3  # the steps really trained
    floor, diff = gap(one, split), gap(one, two)
    print(f"2 ranks vs 1 process {diff:.3g}; fp32 floor {floor:.3g}")
    assert diff <= max(2e-5, 2 * floor), (diff, floor)
    rewards = [[x["rollout/reward_mean"] for x in map(json.loads, open(tmp_path / d / "metrics.jsonl"))
                if "rollout/reward_mean" in x] for d in ("one", "two")]
    assert rewards[0] == pytest.approx(rewards[1], abs=1e-9) and len(rewards[0]) == 4


def test_two_rank_resume_is_the_uninterrupted_run(task, tmp_path):
    """K = 1, 2 ranks: 4 steps, and the same run resumed from its step-2 checkpoint (batch 2, sampled
    ahead from version 1, comes from rank 0's pipeline.pt and is sharded again) end on the same
    weights, bit for bit."""
    extra = ("--steps", "4", "--async-steps", "1", "--save-every", "2", "--keep-checkpoints", "3")
    train(task, tmp_path / "a", *extra, ranks=2, port=free_port())
    ck = os.path.join(tmp_path / "a", "checkpoints", "step_000002")
    assert "pipeline.pt" in checkpoint.verify(ck)["files"]
    train(task, tmp_path / "b", *extra, "--resume", ck, ranks=2, port=free_port())
    wa, wb = weights(tmp_path / "a", 4), weights(tmp_path / "b", 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_ranks_with_a_worker_scored_reward_model_equal_one_process(task, tmp_path):
    """--async-steps 1 --reward-model on 2 ranks: rank 0's worker scores every rank's samples with the
    reward model (its component `rm` beside --reward), each rank trains its shard, and the logged
    rewards and RM components are the one process's; each rank scores its slice of the held-out set with
    its own copy of the reward model (eval/test/reward/rm at the end, the one process's)."""
    from test_reward_components import tiny_rm
    tiny_rm(tmp_path / "rm")
    extra = ("--steps", "3", "--async-steps", "1", "--reward-model", str(tmp_path / "rm"),
             "--reward-weights", "correct=1,rm=0.5")
    train(task, tmp_path / "one", *extra)
    out = train(task, tmp_path / "two", *extra, ranks=2, port=free_port())
    assert "ranks in sync" in out
    logged = {}
    for d in ("one", "two"):
        rows = [json.loads(x) for x in open(tmp_path / d / "metrics.jsonl")]
        steps = [v for x in rows if "rollout/reward/rm" in x
                 for v in (x["rollout/reward_mean"], x["rollout/reward/rm"])]
        logged[d] = (steps, [x["eval/test/reward/rm"] for x in rows if "eval/test/reward/rm" in x])
    assert len(logged["one"][0]) == 2 * 3 and len(logged["one"][1]) == 2  # 3 steps; eval before and after
    assert logged["two"][0] == pytest.approx(logged["one"][0], abs=1e-6)
    assert logged["two"][1] == pytest.approx(logged["one"][1], abs=1e-6)
