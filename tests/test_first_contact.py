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


# One child process runs every entry point as `python ...` would (runpy: the script or module as __main__,
# sys.argv set), twice each: --help, then an unknown flag. One interpreter pays the torch import once.
DRIVER = """
import contextlib, io, json, os, runpy, shutil, sys
out = {}
for entry in json.loads(sys.argv[1]):
    for name, args in (("help", ["--help"]), ("bad", ["x", "y", "--no-such-flag-nanorl"])):
        stdout, stderr, code = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                if entry[0] == "-m":
                    sys.argv = [entry[1], *args]
                    runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = [entry[0], *args]
                    runpy.run_path(entry[0], run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out[" ".join(entry) + " " + name] = [code, stdout.getvalue(), stderr.getvalue(), os.listdir(".")]
        for f in os.listdir("."):  # what one entry wrote is that entry's failure only
            shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def entry_results(tmp_path_factory):
    # Run from an empty folder: --help must write nothing (nanorl.task once made a model in "./--help")
    cwd = tmp_path_factory.mktemp("empty")
    entries = [[os.path.join(ROOT, x) if x.endswith(".py") else x for x in e] for e in ENTRY_POINTS]
    run = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(entries)], cwd=cwd, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    return {k.replace(ROOT + os.sep, ""): v for k, v in got.items()}


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=[" ".join(e) for e in ENTRY_POINTS])
def test_entry_point_answers_help_and_refuses_an_unknown_flag(entry, entry_results):
    code, stdout, stderr, files = entry_results[" ".join(entry) + " help"]
    assert code == 0 and stdout.startswith("usage:"), stdout[-2000:] + stderr[-2000:]
    assert files == []
    # Two stand-in positionals so that commands with required arguments reach the unknown flag too
    code, stdout, stderr, files = entry_results[" ".join(entry) + " bad"]
    assert code == 2 and "error: unrecognized arguments:" in stderr, stderr[-2000:]
    assert "--no-such-flag-nanorl" in stderr and files == []


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
