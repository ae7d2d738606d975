"""What a new user meets first: every entry point answers --help and refuses an unknown flag, TensorBoard
logging reads back with tensorboard's own reader, W&B's absence is a clear error, and the loss identity the
tour's metric table states holds on a logged row."""
import json
import math
import os
import subprocess
import sys

import pytest

import train
from nanorl import logger
from nanorl.config import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every command a user can run: scripts, and modules with a __main__ (python -m ...)
ENTRY_POINTS = [["train.py"], ["bench.py"], ["gpu_check.py"], ["-m", "nanorl.data"], ["-m", "nanorl.logger"],
                ["-m", "nanorl.task"], ["-m", "nanorl.viewer"], ["-m", "nanorl.advantage"],
                ["-m", "nanorl.export"], ["-m", "examples.dcpo"]]


def test_every_module_with_a_main_is_an_entry_point_listed_here():
    mains = {f"nanorl.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, "nanorl"))
             if f.endswith(".py") and 'if __name__ == "__main__"' in open(os.path.join(ROOT, "nanorl",
                                                                                       f)).read()}
    assert mains <= {e[1] for e in ENTRY_POINTS if e[0] == "-m"}, mains


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=[" ".join(e) for e in ENTRY_POINTS])
def test_entry_point_answers_help_and_refuses_an_unknown_flag(entry, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    # Run from an empty folder: --help must write nothing (nanorl.task once made a model in "./--help")
    run = lambda *a: subprocess.run([sys.executable,  # noqa: E731
                                     *(os.path.join(ROOT, x) if x.endswith(".py") else x for x in entry), *a],
                                    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    ok = run("--help")
    assert ok.returncode == 0 and ok.stdout.startswith("usage:"), ok.stdout[-2000:] + ok.stderr[-2000:]
    assert os.listdir(tmp_path) == []
    # Two stand-in positionals so that commands with required arguments reach the unknown flag too
    bad = run("x", "y", "--no-such-flag-nanorl")
    assert bad.returncode == 2 and "error: unrecognized arguments:" in bad.stderr, bad.stderr[-2000:]
    assert "--no-such-flag-nanorl" in bad.stderr and os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl.task import make_default
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


def short_run(task, out, *extra):
    return train.main(["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
                       "--out-dir", str(out), "--steps", "3", "--prompts-per-step", "4",
                       "--samples-per-prompt",
                       "4", "--eval-every", "0", "--quiet", "--no-skip-zero-advantage", *extra])


def rows(out) -> list:
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_tensorboard_event_file_holds_the_logged_metrics(task, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    short_run(task, tmp_path, "--tensorboard")
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0}).Reload()
    logged = [r for r in rows(tmp_path) if "train/loss" in r]
    assert len(logged) == 3
    for key in ("train/loss", "rollout/reward_mean", "train/grad_norm", "perf/time/step"):
        got = {e.step: e.value for e in events.Scalars(key)}
        # TensorBoard stores float32
        assert got.keys() == {r["step"] for r in logged}, key
        assert all(math.isclose(got[r["step"]], r[key], rel_tol=1e-6, abs_tol=1e-30) for r in logged), key


def test_wandb_missing_is_an_error_naming_the_install(monkeypatch, tmp_path):
    # None in sys.modules makes `import wandb` raise ImportError, as on the README's install
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"--wandb-project needs the wandb package.*pip install wandb"):
        logger.Logger(str(tmp_path), total_steps=1, quiet=True, wandb_project="p")


@pytest.mark.parametrize("extra", [
    ["--algo", "ppo", "--kl-coef", "0.05", "--entropy-coef", "0.01", "--loss-agg", "seq-mean-token-mean"],
    ["--algo", "grpo", "--kl-coef", "0.02", "--entropy-coef", "0.003", "--loss-agg", "token-mean",
     "--ppo-epochs", "2"],
], ids=["ppo", "grpo-2-epochs"])
def test_the_tour_loss_identity_holds_on_logged_rows(task, tmp_path, extra):
    """docs/tour.md: train/loss = pg_loss + β·kl_loss + vf_coef·vf_loss − entropy_coef·entropy_loss."""
    short_run(task, tmp_path, *extra)
    cfg = parse_args(extra)
    vf_coef, ent_coef = cfg.vf_coef, cfg.entropy_coef
    logged = [r for r in rows(tmp_path) if "train/loss" in r]
    assert len(logged) == 3
    # Step 1's policy is the reference (KL 0); later steps have moved off it
    assert all(r["train/kl_loss"] > 0 for r in logged[1:])
    for r in logged:
        assert r["train/entropy_loss"] > 0
        assert (vf_coef == 0) == (r["train/vf_loss"] == 0)
        parts = (r["train/pg_loss"] + r["train/kl_beta"] * r["train/kl_loss"] + vf_coef * r["train/vf_loss"]
                 - ent_coef * r["train/entropy_loss"])
        assert math.isclose(r["train/loss"], parts, rel_tol=1e-4, abs_tol=1e-6), (r["train/loss"], parts)
