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
import importlib
import json
import math
import os
import sys
import time
from contextlib import contextmanager

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


class Logger:
    """Writes metrics to out_dir/metrics.jsonl (and TensorBoard / W&B when asked); rank 0 only."""

    BAR_KEYS = (("reward", "rollout/reward_mean"), ("acc", "eval/accuracy"), ("s/step", "perf/time/step"))

    def __init__(self, out_dir: str, total_steps: int, enabled: bool = True, quiet: bool = False,
                 tensorboard: bool = False, wandb_project: str = "", config: dict | None = None,
                 resume: bool = False):
        self.enabled, self.last = enabled, {}
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a" if resume else "w")
        self.bar = None
        if not quiet:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, dynamic_ncols=True, file=sys.stdout)
        self.tb = None
        if tensorboard:
            # torch's writer needs the tensorboard package (requirements.txt installs it)
            optional_import("tensorboard", "--tensorboard", "pip install tensorboard")
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(out_dir, "tb"))
        self.wandb = None
        if wandb_project:
            self.wandb = optional_import("wandb", "--wandb-project", "pip install wandb").init(
                project=wandb_project, config=config or {})

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if not isinstance(v, str) else v) for k, v in metrics.items()}
        self.last.update(clean)
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()
        for k, v in clean.items():
            if self.tb is not None and isinstance(v, float) and math.isfinite(v):
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({name: f"{self.last[k]:.3g}" for name, k in self.BAR_KEYS if k in self.last})
            self.bar.refresh()

    def print(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.enabled:
            if self.bar is not None:
                self.bar.close()
            self.file.close()
            if self.tb is not None:
                self.tb.close()
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
