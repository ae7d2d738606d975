"""Observability: one JSONL line per step with every metric, a progress bar, optional TensorBoard and
W&B, and a command that turns a run's JSONL into a PNG of the main curves.

    python -m nanorl.logger runs/nanorl/metrics.jsonl runs/nanorl/curves.png

Names are namespaced (nanorl/metrics.py: rollout/, train/, eval/, perf/, sync/, routing/); the plot
also reads a metrics.jsonl written before that, with the flat names. Metrics worth watching
(docs/tour.md has the table and the debugging path): rollout/reward_mean and rollout/accuracy go up;
train/entropy falls slowly (a collapse to ~0 means the policy stopped exploring); train/pg_clipfrac
and train/ppo_kl stay small (a jump means the update moved too far); train/logprob_diff_abs (train
vs rollout logprobs) is ~0 for the HF engine and small for vLLM — a rise means the two compute
different distributions.
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import importlib
import json
import math
import os
import shutil
import socket
import sys
import time
from contextlib import contextmanager

from tqdm import tqdm

from nanorl.config_checks import ConfigError
from nanorl.metrics import namespaced


class PhaseTimer:
    """Wall-clock seconds per phase of a step: `with timer("generate"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def optional_import(module: str, flag: str, install: str):
    """Import a package only one flag needs; without it, an error that names the flag and the install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{flag} needs the {module} package, which is not installed: {install}") from e


class RunDirError(ConfigError):
    """An --out-dir this run must not write to: another run's, in use, or not writable (one line)."""


LOCK_FILE = ".nanorl.lock"
# per-optimizer-step rows, when a rollout takes several optimizer steps (Logger.optimizer_step)
OPTIMIZER_STEPS = "optimizer_steps.jsonl"
# what --overwrite deletes: the earlier run's outputs (the built-in task files in out_dir/task stay)
RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "rollouts", "tb", OPTIMIZER_STEPS)


class RunDirLock:
    """This process's claim on an out_dir: an fcntl (POSIX) lock on out_dir/.nanorl.lock, held until
    `release` or the process's end (the kernel drops it even on SIGKILL, so a dead run never leaves
    the directory locked; fork children — reward and tool workers — do not inherit it)."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock
            self.fd = None


def earlier_run(out_dir: str) -> list[str]:
    """What of an earlier run out_dir holds: [] or e.g. ["metrics.jsonl (3 rows)", "2 checkpoints"]: what
    a new run would truncate (metrics.jsonl, opened "w") or rotate away (checkpoints)."""
    found = []
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        with open(metrics, "rb") as f:
            found.append(f"metrics.jsonl ({sum(1 for line in f if line.strip())} rows)")
    root = os.path.join(out_dir, "checkpoints")
    steps = [n for n in os.listdir(root) if n.startswith("step_")] if os.path.isdir(root) else []
    if steps:
        found.append(f"{len(steps)} checkpoint{'s' * (len(steps) > 1)}")
    return found


def claim_run_dir(out_dir: str, resume: str = "", overwrite: bool = False) -> RunDirLock:
    """Lock out_dir for this run (rank 0, before anything is written there) and refuse an earlier
    run's directory unless the run continues it (--resume latest, or a checkpoint of its own) or
    --overwrite deletes it first. A second run on a locked out_dir would interleave its rows into the
    same metrics.jsonl and rotate the other's checkpoints away; a new run in an earlier one's out_dir
    would truncate its metrics.jsonl and delete its checkpoints (the rotation keeps the newest steps,
    so a later --resume latest loads the old run's). Raises RunDirError (one line, the fix in it)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd = os.open(os.path.join(out_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirError(f"--out-dir {out_dir}: cannot write there ({type(e).__name__}: {e.strerror}); "
                          "choose a writable --out-dir") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(f"--out-dir {out_dir} is in use by another run ({owner}): wait for it to "
                              "end, or choose another --out-dir") from None
        # a filesystem without locks (some network mounts): the run goes on unguarded, with a note
        print(f"note: --out-dir {out_dir} cannot be locked ({e.strerror}); make sure no other run "
              "writes there")
        os.close(fd)
        fd = None
    lock = RunDirLock(fd)
    try:
        if fd is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        found = earlier_run(out_dir)
        if found and overwrite:
            for name in RUN_OUTPUTS:
                path = os.path.join(out_dir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
            print(f"--overwrite: deleted the earlier run in {out_dir} ({', '.join(found)})")
        elif found and not _continues(out_dir, resume):
            fix = (f"resuming {resume} (another directory's checkpoint) would mix the two: choose an "
                   "empty --out-dir" if resume else "--resume latest continues it, --overwrite deletes "
                   "it, or choose another --out-dir")
            raise RunDirError(f"--out-dir {out_dir} holds an earlier run ({', '.join(found)}): {fix}")
    except BaseException:
        lock.release()
        raise
    return lock


def _continues(out_dir: str, resume: str) -> bool:
    """Whether --resume continues the run in out_dir: "latest", or a checkpoint of out_dir's own."""
    if resume == "latest":
        return True
    own = os.path.realpath(os.path.join(out_dir, "checkpoints"))
    return bool(resume) and os.path.realpath(os.path.dirname(os.path.normpath(resume))) == own


def _tensorboard(log_dir: str):
    """--tensorboard's writer, logging to log_dir."""
    # torch's writer needs the tensorboard package (requirements.txt installs it)
    optional_import("tensorboard", "--tensorboard", "pip install tensorboard")
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(log_dir)


def _wandb(project: str, config: dict):
    """--wandb-project's W&B run, with the run's config."""
    wandb = optional_import("wandb", "--wandb-project", "pip install wandb")
    return wandb.init(project=project, config=config)


class Logger:
    """Writes metrics to out_dir/metrics.jsonl (and TensorBoard / W&B when asked); rank 0 only."""

    BAR_KEYS = (("reward", "rollout/reward_mean"), ("acc", "eval/accuracy"), ("s/step", "perf/time/step"))

    def __init__(self, out_dir: str, total_steps: int, enabled: bool = True, quiet: bool = False,
                 tensorboard: bool = False, wandb_project: str = "", config: dict | None = None,
                 resume: bool = False):
        self.enabled, self.last, self.out_dir, self.opt_file = enabled, {}, out_dir, None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        # line-buffered: every row is in the file once logged
        self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a" if resume else "w", buffering=1)
        if not resume and os.path.exists(os.path.join(out_dir, OPTIMIZER_STEPS)):  # a new run: its own rows
            os.remove(os.path.join(out_dir, OPTIMIZER_STEPS))
        self.bar = None if quiet else tqdm(total=total_steps, dynamic_ncols=True, file=sys.stdout)
        self.tb = _tensorboard(os.path.join(out_dir, "tb")) if tensorboard else None
        self.wandb = _wandb(wandb_project, config or {}) if wandb_project else None

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if not isinstance(v, str) else v) for k, v in metrics.items()}
        self.last.update(clean)
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.bar is not None:
            self.bar.n = step
            # set_postfix redraws the bar
            self.bar.set_postfix({name: f"{self.last[k]:.3g}" for name, k in self.BAR_KEYS if k in self.last})

    def optimizer_step(self, step: int, row: dict) -> None:
        """One optimizer step's metrics on their own axis (several per rollout: --ppo-epochs,
        --mini-batches): a row of out_dir/optimizer_steps.jsonl {"step", "opt_step", "epoch", ...}, and
        TensorBoard's opt/<name> over opt_step (the scheduler's count of optimizer steps). Rank 0's rows:
        the step's line in metrics.jsonl holds every rank's average."""
        if not self.enabled:
            return
        if self.opt_file is None:  # only runs with several optimizer steps per rollout write it
            self.opt_file = open(os.path.join(self.out_dir, OPTIMIZER_STEPS), "a", buffering=1)
        axis = {"opt_step": int(row["opt_step"]), "epoch": int(row["epoch"])}
        clean = {k: float(v) for k, v in row.items() if k not in axis}
        self.opt_file.write(json.dumps({"step": step, **axis, **clean}) + "\n")
        if self.tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self.tb.add_scalar(f"opt/{k}", v, axis["opt_step"])

    def print(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.enabled:
            for out in (self.bar, self.file, self.opt_file, self.tb):
                if out is not None:
                    out.close()
            if self.wandb is not None:
                self.wandb.finish()


CURVES = ("rollout/reward_mean", "eval/accuracy", "train/entropy", "train/pg_clipfrac", "train/ppo_kl",
          "train/logprob_diff_abs", "rollout/response_length_mean", "train/grad_norm")


def plot(jsonl_path: str, png_path: str):
    """A grid of the main curves of a run (one panel per metric present in the file)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # namespaced() leaves today's names as they are and renames an old file's flat ones
    rows = [json.loads(line) for line in open(jsonl_path) if line.strip()]
    rows = [{"step": r.pop("step"), **namespaced(r)} for r in rows]
    keys = [k for k in CURVES if any(k in r for r in rows)]
    if not keys:
        raise ValueError(f"{jsonl_path}: none of {CURVES} is in the file")
    cols = 4
    fig, axes = plt.subplots((len(keys) + cols - 1) // cols, cols,
                             figsize=(4 * cols, 3 * ((len(keys) + cols - 1) // cols)),
                             squeeze=False)
    for ax, k in zip(axes.flat, keys):
        pts = [(r["step"], r[k]) for r in rows if k in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30 else None)
        ax.set_title(k)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nanorl.logger",
                                 description="A run's metrics.jsonl → curves PNG.")
    ap.add_argument("metrics", help="a metrics.jsonl written by train.py")
    ap.add_argument("out", help="the PNG file to write")
    a = ap.parse_args(argv)
    plot(a.metrics, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
