"""Algorithms declare what they need; the step computes exactly that (nanorl/plan.py).

A new estimator registered in this file reads π_old and Σπ² by naming them: the step computes both
(the values the trainer's own forward gives), with one scoring pass. A run whose estimator and loss
need neither computes neither, and runs no scoring forward at all.
"""
import pytest
import torch

import train
from nanorl.advantage import ADVANTAGE_ESTIMATORS, grpo, register_advantage
from nanorl.config import parse_args
from nanorl.losses import POLICY_LOSSES, register_policy_loss, reinforce_loss
from nanorl.plan import make_plan

SEEN = {}


@register_advantage("test_reads_old_and_sum_sq")
def reads_old_and_sum_sq(*, mask, index, scores, old_logprobs, sum_sq_probs):
    """GRPO's advantages, recording what the step handed over."""
    SEEN.update(old_logprobs=old_logprobs, sum_sq_probs=sum_sq_probs)
    return grpo(mask=mask, index=index, scores=scores)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    from nanorl.task import make_default
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


def one_step(task_dir, tmp_path, *flags):
    """Set up a run, count the trainer's forwards in one rl_step, return (run, batch, forwards)."""
    argv = ["--model", task_dir["model"], "--train-data", task_dir["train"], "--test-data", task_dir["test"],
            "--out-dir", str(tmp_path), "--prompts-per-step", "4", "--samples-per-prompt", "4",
            "--eval-every", "0", "--threads", "1", "--quiet", "--kl-coef", "0", *flags]
    run = train.setup(parse_args(argv))
    forwards, seen = [], []
    run.trained.register_forward_hook(lambda mod, args, out: forwards.append(torch.is_grad_enabled()))
    real_train_on = train.train_on
    try:
        train.train_on = lambda run, batch: seen.append(batch) or real_train_on(run, batch)
        train.rl_step(run)
    finally:
        train.train_on = real_train_on
        run.logger.close()
    return run, seen[0], forwards


def test_an_estimator_that_names_old_logprobs_and_sum_sq_gets_both(task_dir, tmp_path):
    SEEN.clear()
    run, batch, forwards = one_step(task_dir, tmp_path, "--advantage", "test_reads_old_and_sum_sq")
    assert run.plan.old_logprobs and run.plan.sum_sq_probs and not run.plan.values
    t, valid = batch.tensors, batch.response_mask > 0  # [B, T]
    assert SEEN["old_logprobs"] is t.old_logprobs and SEEN["sum_sq_probs"] is t.sum_sq_probs
    # the values are the policy's own: π_old is the update's first forward (on-policy, one step),
    # and Σ_v π_v² of the same distribution is at least the sampled token's π² and at most 1
    assert torch.equal(t.old_logprobs[valid], t.first_pass_logprobs[valid])
    p_tok = t.old_logprobs.exp()
    ssq = t.sum_sq_probs[valid]
    assert (ssq >= p_tok[valid] ** 2 - 1e-6).all() and (ssq <= 1 + 1e-6).all()
    assert (t.sum_sq_probs[valid] > 0).all()
    # one scoring pass without gradient, then the update's forwards with it
    assert forwards.count(False) == 1 and forwards.count(True) >= 1


def test_a_run_that_needs_neither_computes_neither(task_dir, tmp_path):
    run, batch, forwards = one_step(task_dir, tmp_path, "--advantage", "grpo")
    assert not (run.plan.old_logprobs or run.plan.sum_sq_probs or run.plan.scoring_pass)
    t = batch.tensors
    assert t.old_logprobs is None and t.sum_sq_probs is None and t.trainer_logprobs is None
    assert forwards.count(False) == 0 and forwards.count(True) >= 1  # no extra forward


def test_a_registered_loss_declares_what_it_reads():
    """A loss that needs π_old before the update says so; the plan recomputes it even on-policy."""
    register_policy_loss("test_reads_old", needs={"old_logprobs"})(
        lambda lp, old, adv, m, c, sel: reinforce_loss(lp, old, adv, m))
    try:
        cfg = parse_args(["--policy-loss", "test_reads_old", "--kl-coef", "0"])
        assert make_plan(cfg, cfg.advantage, cfg.policy_loss).old_logprobs
        plain = parse_args(["--policy-loss", "reinforce", "--kl-coef", "0"])
        assert not make_plan(plain, plain.advantage, plain.policy_loss).old_logprobs
    finally:
        POLICY_LOSSES.pop("test_reads_old")


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda *, mask, index, scores: None)
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo


def test_the_trainer_names_no_algorithm():
    """train.py, the stages, the rounds, the plan, the update and the teacher read the estimators' and losses'
    declarations, never their names."""
    import ast
    import pathlib
    names = set(ADVANTAGE_ESTIMATORS) | set(POLICY_LOSSES)
    for path in ("train.py", "nanorl/stages.py", "nanorl/rounds.py", "nanorl/plan.py", "nanorl/update.py",
                 "nanorl/teacher.py"):
        tree = ast.parse(pathlib.Path(train.__file__).parent.joinpath(path).read_text())
        found = [node.value for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and node.value in names]
        assert not found, f"{path} names algorithms: {found}"


def tis_step(task_dir, tmp_path, *flags):
    """One GRPO step with --tis-cap 1.5 whose engine's logprobs are planted off the trainer's (token t
    of each response shifted by ±0.6 alternately), so the weights ρ = π_old/π_rollout are far from 1
    and clipped; returns (run, the step's metrics, its forwards: grad enabled or not)."""
    argv = ["--model", task_dir["model"], "--train-data", task_dir["train"], "--test-data", task_dir["test"],
            "--out-dir", str(tmp_path), "--prompts-per-step", "4", "--samples-per-prompt", "4",
            "--eval-every", "0", "--threads", "1", "--quiet", "--kl-coef", "0", "--tis-cap", "1.5", *flags]
    run = train.setup(parse_args(argv))
    real_generate = run.engine.generate

    def generate(*args, **kw):
        samples = real_generate(*args, **kw)
        for s in samples:
            s.rollout_logprobs = [lp + (0.6 if t % 2 else -0.6) for t, lp in enumerate(s.rollout_logprobs)]
        return samples

    run.engine.generate = generate
    forwards = []
    run.trained.register_forward_hook(lambda mod, args, out: forwards.append(torch.is_grad_enabled()))
    try:
        metrics = train.rl_step(run)
    finally:
        run.logger.close()
    return run, metrics, forwards


def test_tis_on_policy_takes_its_weights_from_the_update_forward(task_dir, tmp_path):
    """Issue 34: on-policy (one epoch, one mini-batch) π_old is the update's own forward, detached, so
    TIS needs no scoring pass; the loss is the one the recomputed π_old gives, bit for bit (red check:
    weights from the engine's logprobs instead — ρ = 1 — changed the loss)."""
    run, first, forwards = tis_step(task_dir, tmp_path / "first")
    assert run.plan.is_weights == "first forward" and not run.plan.old_logprobs
    assert forwards.count(False) == 0
    run, again, forwards = tis_step(task_dir, tmp_path / "recompute", "--old-logprobs", "recompute")
    assert run.plan.is_weights == "recompute" and forwards.count(False) == 1
    assert again["train/is_clipfrac"] > 0.1  # the planted mismatch is clipped: the weights matter
    for k in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert first[k] == again[k], (k, first[k], again[k])
    # the diagnostics are over the tokens the update weighed (all of them here: no row skipped)
    for k in ("train/is_weight_mean", "train/is_clipfrac", "train/is_ess"):
        assert first[k] == pytest.approx(again[k], rel=1e-6), (k, first[k], again[k])
