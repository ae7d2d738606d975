"""Several optimizer steps per rollout (--ppo-epochs, --mini-batches): each step's metrics on their own
axis, out_dir/optimizer_steps.jsonl (nanorl/logger.py Logger.optimizer_step), beside the rollout step's
averaged line in metrics.jsonl; a resume cuts both back to the checkpoint.
    python -m pytest tests/test_optimizer_steps.py -q
"""
import json
import os

import pytest

import train
from nanorl.task import make_default

TINY = ["--steps", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0",
        "--eval-limit", "8", "--quiet", "--algo", "ppo"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


def run(task, out, *extra):
    train.main(["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
                "--out-dir", str(out), *TINY, *extra])
    rows = lambda name: [json.loads(line) for line in open(out / name)]  # noqa: E731
    opt = rows("optimizer_steps.jsonl") if os.path.exists(out / "optimizer_steps.jsonl") else None
    return rows("metrics.jsonl"), opt


def test_each_optimizer_step_is_a_row_and_the_step_line_is_their_mean(task, tmp_path):
    metrics, opt = run(task, tmp_path, "--ppo-epochs", "2", "--mini-batches", "2")
    assert [(r["step"], r["epoch"]) for r in opt] == [(s, e) for s in (1, 2) for e in (0, 0, 1, 1)]
    assert [r["opt_step"] for r in opt] == list(range(1, 9))  # the scheduler's count: one axis for the run
    steps = [r for r in metrics if "train/grad_norm" in r]
    for line in steps:  # one rank: the step's line averages its optimizer steps' rows
        mine = [r for r in opt if r["step"] == line["step"]]
        for key in ("grad_norm", "pg_loss", "ratio_mean"):
            assert line[f"train/{key}"] == pytest.approx(sum(r[key] for r in mine) / len(mine), rel=1e-6)
    # the rows differ: what the average hid (later epochs move the ratio off 1)
    assert len({round(r["grad_norm"], 8) for r in opt}) > 1


def test_one_optimizer_step_per_rollout_writes_no_second_file(task, tmp_path):
    _, opt = run(task, tmp_path)
    assert opt is None


def test_a_resume_cuts_the_optimizer_steps_back_to_the_checkpoint(task, tmp_path):
    full = tmp_path / "full"
    _, want = run(task, full, "--ppo-epochs", "2", "--save-every", "1")
    # the run again, resumed from its step-1 checkpoint: step 2's rows are redone, not duplicated
    _, got = run(task, full, "--ppo-epochs", "2", "--save-every", "1", "--resume",
                 str(full / "checkpoints" / "step_000001"))
    assert [(r["step"], r["opt_step"]) for r in got] == [(r["step"], r["opt_step"]) for r in want]
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-5)
