"""Metric names (nanorl/metrics.py): one namespace per metric, one place that names them, and the
plot reading both today's metrics.jsonl and one written with the old flat names.

Run: python -m pytest tests/test_metrics.py -q
"""
import json

import pytest

from nanorl.logger import CURVES, plot
from nanorl.metrics import NAMESPACES, name, namespaced


@pytest.mark.parametrize("local,full", [
    ("reward_mean", "rollout/reward_mean"), ("accuracy", "rollout/accuracy"),
    ("reward/format", "rollout/reward/format"),
    ("reward_faults/Timeout", "rollout/reward_faults/Timeout"),
    ("ksm/support_bytes_per_token", "rollout/ksm/support_bytes_per_token"),
    ("env/turns_mean", "rollout/env/turns_mean"), ("dapo/gen_rounds", "rollout/dapo/gen_rounds"),
    ("groups_kept_frac", "rollout/groups_kept_frac"), ("async/staleness_max", "rollout/async/staleness_max"),
    ("async/trainer_wait_s", "perf/async/trainer_wait_s"), ("time/generate", "perf/time/generate"),
    ("time/step", "perf/time/step"), ("tokens_per_s", "perf/tokens_per_s"),
    ("pg_clipfrac", "train/pg_clipfrac"),
    ("grad_norm", "train/grad_norm"), ("is_ess", "train/is_ess"),
    ("mismatch/ratio_p99", "train/mismatch/ratio_p99"),
    ("eval/accuracy", "eval/accuracy"), ("sync/max_abs_logprob_diff", "sync/max_abs_logprob_diff"),
    ("routing/disagreement/layer_3", "routing/disagreement/layer_3"),
    ("perf/mem/peak_rss_gb", "perf/mem/peak_rss_gb")])
def test_names(local, full):
    assert name(local) == full and name(full) == full and full.startswith(NAMESPACES)


def test_two_keys_on_one_name_raise():
    with pytest.raises(ValueError, match="both map to 'train/loss'"):
        namespaced({"loss": 1.0, "train/loss": 2.0})


def test_plot_reads_old_flat_and_new_names(tmp_path):
    old = [{"step": s, "reward_mean": 0.1 * s, "entropy": 1.0 - 0.1 * s, "time/step": 0.2} for s in (1, 2, 3)]
    new = [{"step": s, **namespaced({k: v for k, v in r.items() if k != "step"})}
           for s, r in zip((1, 2, 3), old)]
    panels = {}
    for tag, rows in (("old", old), ("new", new)):
        path = tmp_path / f"{tag}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # a trailing blank line too
        fig = plot(str(path), str(tmp_path / f"{tag}.png"))
        panels[tag] = [ax.get_title() for ax in fig.axes if ax.get_title()]
        assert (tmp_path / f"{tag}.png").stat().st_size > 1000
    assert panels["old"] == panels["new"] == ["rollout/reward_mean", "train/entropy"]
    assert set(panels["new"]) <= set(CURVES)
