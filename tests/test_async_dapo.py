"""DAPO's dynamic sampling with --async-steps (rollout_worker.Worker.refilled): the worker runs the
refill rounds on its own prompts, over-sampled and aborted with --over-sample, so the trainer gets full
batches of groups with reward variance; the worker's prompt stream survives a checkpoint, and two
trainer ranks with one worker take the steps one process takes. With --partial-rollout abort the
abort waits for kept groups and the aborted ones resume in the next batch (partial_rollout.GroupFilter).
Run: python -m pytest tests/test_async_dapo.py -q
"""
import json
import os

import pytest
import torch
from test_async_ranks import gap, train as launch
from test_dapo import HALF, assert_full
from test_pipeline import (
    task as task,  # the trained task fixture, shared (pytest finds it by name)
    weights,
)

import train
from nanorl import pipeline
from nanorl.config import Config
from nanorl.weight_broadcast import free_port

COMMON = ["--algo", "dapo", "--prompts-per-step", "2", "--samples-per-prompt", "8", "--eval-limit", "2",
          "--eval-every", "0", "--pass-k", "1", "--quiet", "--threads", "1", "--max-new-tokens", "4",
          "--async-steps", "1", "--steps", "4"]
ABORT = ("--partial-rollout", "abort", "--over-sample", "4")  # slime's over-sampling, aborted into a buffer


def logged(out, key) -> list:
    return [x[key] for x in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if key in x]


def run_args(task, out, reward, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--reward", f"{reward}:reward", "--out-dir", str(out), *COMMON, *extra]


@pytest.fixture
def half(tmp_path):
    """A reward only the prompts with an even answer can earn: about half the groups have no variance."""
    (tmp_path / "half.py").write_text(HALF)
    return tmp_path / "half.py"


def test_worker_refills_and_over_sampling_fills_the_batch_in_one_round(task, half, tmp_path, monkeypatch):
    """K = 1: without over-sampling the worker's refill needs several rounds for some batch; with
    --over-sample 4 every batch fills in one round (8 groups started, the rest aborted: aborted tokens
    logged). Either way each update trains 2 whole groups with reward variance, none older than the
    staleness bound. Red checks: the trainer refilling instead (the worker's rounds not run) logs no
    dapo/gen_rounds from the worker; the worker ignoring --over-sample needs several rounds."""
    seen = []
    real = train.train_on
    monkeypatch.setattr(train, "train_on", lambda run, batch: seen.append(batch) or real(run, batch))
    train.main(run_args(task, tmp_path / "refill", half))
    assert max(logged(tmp_path / "refill", "rollout/dapo/gen_rounds")) > 1
    train.main(run_args(task, tmp_path / "over", half, "--over-sample", "4"))
    assert logged(tmp_path / "over", "rollout/dapo/gen_rounds") == [1] * 4
    assert logged(tmp_path / "over", "rollout/dapo/oversampled_groups") == [8] * 4
    assert sum(logged(tmp_path / "over", "rollout/dapo/aborted_tokens")) > 0
    assert len(seen) == 8
    assert_full(seen)
    for out in ("refill", "over"):
        assert max(logged(tmp_path / out, "rollout/async/staleness_max")) <= 1


def test_a_batch_out_of_rounds_trains_on_what_it_found_and_says_so(task, half, tmp_path, capsys):
    """--max-gen-batches 1 with a step whose round has a group without variance: the worker's note and
    the dapo_gave_up counter reach the trainer (its run totals and its log)."""
    res = train.main(run_args(task, tmp_path, half, "--max-gen-batches", "1", "--steps", "6"))
    gave_up = res["counters"].get("dapo_gave_up", 0)
    kept = logged(tmp_path, "rollout/groups_kept_frac")
    assert gave_up == sum(f < 1 for f in kept) > 0
    assert capsys.readouterr().out.count("dynamic sampling found") == gave_up


@pytest.mark.parametrize("flags", [("--over-sample", "2"), ABORT], ids=["refill", "abort"])
def test_resume_is_the_uninterrupted_run(task, half, tmp_path, flags):
    """4 steps with --over-sample 2, and the same run resumed from its step-2 checkpoint: the checkpoint
    holds batch 2 and the worker's prompt stream after it (how far the rounds drew); the resumed run
    logs the same steps 3-4 and ends on the same weights. With --partial-rollout abort the checkpoint
    also holds the buffer of aborted groups, which the resumed run's batch 3 resumes. Red check: the
    worker ignoring the saved stream (drawing from the trainer's loader position) samples other
    prompts."""
    a, b = tmp_path / "a", tmp_path / "b"
    extra = (*flags, "--save-every", "2", "--keep-checkpoints", "3")
    train.main(run_args(task, a, half, *extra))
    ck = os.path.join(a, "checkpoints", "step_000002")
    saved = torch.load(os.path.join(ck, pipeline.FILE), weights_only=True)
    assert "loader" in saved["batches"][-1]["carry"]
    if flags == ABORT:  # aborted partial samples in flight at the checkpoint
        buffer = saved["batches"][-1]["carry"]["buffer"]
        assert any(s["status"] == "aborted" and s["response_ids"] for g in buffer for s in g["samples"])
    train.main(run_args(task, b, half, *extra, "--resume", ck))

    def lines(out):
        return [{k: v for k, v in x.items() if not k.startswith("perf/")}
                for x in map(json.loads, open(out / "metrics.jsonl")) if "rollout/reward_mean" in x]
    la, lb = lines(a), lines(b)
    assert [x["step"] for x in lb] == [3, 4] and la[2:] == lb
    if flags == ABORT:
        assert lb[1]["rollout/async/resumed_groups"] == len(buffer)  # batch 3, the one after the buffer
    wa, wb = weights(a, 4), weights(b, 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_two_ranks_with_one_worker_equal_one_process_on_the_union(task, half, tmp_path):
    """DAPO with --over-sample 2 and K = 1 for 3 steps: 2 ranks (gloo) log the rewards and rounds of one
    process and end on its weights within twice the fp32 floor (one process against itself with
    another micro-batch split, as test_async_ranks measures it)."""
    extra = ("--algo", "dapo", "--over-sample", "2", "--steps", "3", "--async-steps", "1",
             "--reward", f"{half}:reward")
    launch(task, tmp_path / "one", *extra)
    launch(task, tmp_path / "split", *extra, "--micro-batch-size", "4")
    out = launch(task, tmp_path / "two", *extra, ranks=2, port=free_port())
    assert "ranks in sync" in out
    one, split, two = (weights(tmp_path / d, 3) for d in ("one", "split", "two"))
    floor, diff = gap(one, split), gap(one, two)
    print(f"2 ranks vs 1 process {diff:.3g}; fp32 floor {floor:.3g}")
    assert diff <= max(2e-5, 2 * floor), (diff, floor)
    for key in ("rollout/reward_mean", "rollout/dapo/gen_rounds", "rollout/dapo/aborted_tokens"):
        one_, two_ = (logged(tmp_path / d, key) for d in ("one", "two"))
        assert one_ == pytest.approx(two_, abs=1e-9) and len(one_) == 3, key


def test_abort_waits_for_kept_groups_and_the_next_batch_resumes_the_rest(task, half, tmp_path, monkeypatch):
    """--partial-rollout abort with --filter-groups (slime's over-sampling with its dynamic filter): the
    worker keeps 4 × 2 groups in flight and aborts the rest once 2 groups WITH reward variance are in,
    so every batch fills in its first round; the aborted groups go to the buffer and the next batch
    resumes them first (judged by the filter as any group). Each update trains 2 whole groups with
    variance, within the K + 1 bound. Red checks: counting finished groups instead of kept ones aborts
    too early, and some batch needs a second round; buffering the surplus kept groups (as abort alone
    does) fills the buffer past the cut groups."""
    seen = []
    real = train.train_on
    monkeypatch.setattr(train, "train_on", lambda run, batch: seen.append(batch) or real(run, batch))
    train.main(run_args(task, tmp_path, half, *ABORT))
    assert logged(tmp_path, "rollout/dapo/gen_rounds") == [1] * 4
    assert len(seen) == 4
    assert_full(seen)
    buffered, resumed = (logged(tmp_path, f"rollout/async/{k}_groups") for k in ("buffered", "resumed"))
    aborted = logged(tmp_path, "rollout/async/aborted_groups")
    surplus = logged(tmp_path, "rollout/dapo/surplus_groups")
    assert sum(aborted) > 0 and sum(surplus) > 0
    # the buffer holds the cut groups only (up to G): kept ones finished beyond G are dropped, as slime's
    assert buffered == [min(a, 2) for a in aborted]
    assert resumed[0] == 0 and resumed[1:] == buffered[:-1]  # each batch resumes what the one before cut
    assert sum(logged(tmp_path, "rollout/async/resumed_tokens")) > 0
    assert max(logged(tmp_path, "rollout/async/partial_frac")) > 0  # resumed samples trained
    assert max(logged(tmp_path, "rollout/async/staleness_max")) <= 2
    assert all(f < 1 for f in logged(tmp_path, "rollout/groups_kept_frac"))  # the filter dropped some


def test_config_takes_refill_with_abort_buffers():
    cfg = Config.from_flags(async_steps=1, filter_groups=True, partial_rollout="abort", over_sample=2)
    assert cfg.dapo.filter_groups and cfg.pipeline.partial_rollout == "abort"


def test_each_engine_call_of_a_batch_has_its_own_seed():
    """SamplingConfig.call: call 0 is the batch's own seed, later calls distinct seeds fixed by (seed,
    call), none without a seed (the engine's stream goes on, as in a synchronous run)."""
    from nanorl.rollout import SamplingConfig
    sp = SamplingConfig(seed=12345)
    seeds = [sp.call(i).seed for i in range(6)]
    assert seeds[0] == 12345 and len(set(seeds)) == 6 and seeds == [sp.call(i).seed for i in range(6)]
    assert SamplingConfig(seed=12346).call(1).seed != seeds[1]
    assert SamplingConfig().call(3).seed is None and sp.call(2).max_new_tokens == sp.max_new_tokens
