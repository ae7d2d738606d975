"""--skip-zero-advantage (issue 23): rows whose advantage is 0 on every token skip the update's forward
and backward, and the reference forward, while the loss keeps the whole step's denominators.

- Without a KL loss it is exact: the gradient handed to the optimizer, and the weights after steps
  where every row is skipped (AdamW still steps on a zero gradient), equal the unskipped run's.
- With a KL loss it is a choice, not an accident: the skipped rows' KL pull is gone (the gradient
  differs, a little), and the reference scores only the rows that train.

Tiny runs on the built-in task, one torch thread. Run: python -m pytest tests/test_skip_zero_advantage.py -q
"""
import sys

import pytest
import torch

import train
from nanorl import scoring, stages, update
from nanorl.config import parse_args
from nanorl.task import make_default

# Groups of odd labels all score 0 (advantage 0: skipped); even labels score by a hash of the response
# (signal wherever the group's responses differ).
HALF = ("def half(prompt, response, label):\n"
        "    return 0.0 if int(label) % 2 else sum(map(ord, response)) % 7 / 7\n")
# Signal in the first step's 16 calls, then every answer scores 1: later steps have no signal at all.
THEN_FLAT = ("CALLS = [0]\n"
             "def then_flat(prompt, response, label):\n"
             "    CALLS[0] += 1\n"
             "    return sum(c.isdigit() for c in response) / 4 if CALLS[0] <= 16 else 1.0\n")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("task")
    paths = make_default(str(d), seed=0)
    for name, src in (("half", HALF), ("then_flat", THEN_FLAT)):
        (d / f"{name}.py").write_text(src)
        paths[name] = f"{d / name}.py:{name}"
    return paths


def setup_run(task, out, *extra):
    return train.setup(parse_args([
        "--model", task["model"], "--train-data", task["train"], "--test-data", task["test"], "--out-dir",
        str(out),
        "--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens", "6", "--grad-clip", "0",
        "--eval-every", "0", "--threads", "1", "--quiet", *extra]))


def first_step(task, out, monkeypatch, *extra, steps=1):
    """(the gradient of the last of `steps` real rl_steps, flat; the rows each of its micro-batches
    trained; its metrics)."""
    run = setup_run(task, out, "--reward", task["half"], *extra)
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    grads, rows, real = [], [], update.micro_step
    run.optimizer.register_step_pre_hook(
        lambda *_: grads.append(torch.cat([p.grad.flatten().clone() for p in params])))

    def counted(run_, mb, *a):
        rows.append(mb.input_ids.shape[0])
        return real(run_, mb, *a)
    monkeypatch.setattr(update, "micro_step", counted)
    try:
        for _ in range(steps):
            rows.clear()
            metrics = train.rl_step(run)
            run.step += 1
    finally:
        monkeypatch.setattr(update, "micro_step", real)
        run.logger.close()
        run.rewards.close()
    return grads[-1], rows, metrics


def test_skipping_is_exact_without_a_kl_loss(task, tmp_path, monkeypatch):
    full, rows_full, m_full = first_step(task, tmp_path / "full", monkeypatch, "--kl-coef", "0",
                                         "--no-skip-zero-advantage")
    skip, rows_skip, m_skip = first_step(task, tmp_path / "skip", monkeypatch, "--kl-coef", "0")
    assert rows_full == [16] and 0 < sum(rows_skip) < 16, (rows_full, rows_skip)  # really skipped rows
    assert m_skip["rollout/reward_mean"] == m_full["rollout/reward_mean"]  # the same rollout
    assert m_skip["train/rows_skipped_frac"] == 1 - sum(rows_skip) / 16
    assert full.norm() > 0.1
    rel = float((skip - full).norm() / full.norm())
    assert rel < 1e-6, f"skipping zero-advantage rows changed the gradient by {rel:.2e} (relative)"


def test_a_step_with_every_row_skipped_still_moves_adam(task, tmp_path):
    """Step 1 has signal; steps 2-3 have none (every row skipped). AdamW's moments still move the
    weights on a zero gradient, so the skipped run must step too: same weights as the unskipped run."""
    final = {}
    for name, extra in {"full": ("--no-skip-zero-advantage",), "skip": ()}.items():
        # in-process (--reward-timeout 0): the call counter lives in this process
        run = setup_run(task, tmp_path / name, "--reward", task["then_flat"], "--kl-coef", "0",
                        "--reward-timeout", "0", *extra)
        for m in [m for k, m in sys.modules.items() if k.startswith("nanorl_user_")
                  and hasattr(m, "then_flat")]:
            m.CALLS[0] = 0  # each run sees signal in its first step only (the file is imported once)
        before = [p.detach().clone() for p in run.model.parameters()]
        metrics = []
        for _ in range(3):
            metrics.append(train.rl_step(run))
            run.step += 1
        final[name] = torch.cat([p.detach().flatten() for p in run.model.parameters()])
        moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(run.model.parameters(), before))
        run.logger.close()
        run.rewards.close()
        assert moved > 0
        if name == "skip":
            assert [m["train/rows_skipped_frac"] for m in metrics[1:]] == [1.0, 1.0]
    assert torch.allclose(final["skip"], final["full"], atol=1e-6, rtol=0), \
        float((final["skip"] - final["full"]).abs().max())


def test_with_a_kl_loss_skipping_drops_only_the_skipped_rows_kl(task, tmp_path, monkeypatch):
    """The documented choice: with β > 0 the skipped rows' KL pull is gone — the gradients differ, but
    by far less than the policy gradient itself; and the reference scored only the rows that train.
    Compared at step 2: at step 1 the policy IS the reference, where the K3 KL's gradient is 0."""
    refs = []
    real = scoring.score_rows
    monkeypatch.setattr(stages, "score_rows", lambda run, m, b, s,
                        rows: refs.append(int(rows.sum())) or real(run, m, b, s, rows))
    full, _, _ = first_step(task, tmp_path / "full", monkeypatch, "--kl-coef", "0.5",
                            "--no-skip-zero-advantage",
                            steps=2)
    assert refs == []  # unskipped: the reference scored every row, before the advantage
    skip, rows_skip, _ = first_step(task, tmp_path / "skip", monkeypatch, "--kl-coef", "0.5", steps=2)
    assert len(refs) == 2 and 0 < refs[-1] == sum(rows_skip) < 16, (refs, rows_skip)
    rel = float((skip - full).norm() / full.norm())
    assert 1e-6 < rel < 0.5, rel
