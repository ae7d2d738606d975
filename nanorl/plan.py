"""The step's plan: which per-token quantities this run computes, worked out once at set-up.

An advantage estimator declares what it reads by its keyword parameters (nanorl/advantage.py), a
policy loss by its registered `needs` (nanorl/losses.py), and a few flags add their own (TIS/MIS
weights read π_old, the 80/20 rule reads π_old's entropy, a KL term reads the reference, --distill-coef
reads the teacher's log-probs and π_old). The plan
is their union; the step (train.py) computes exactly what the plan says and names no algorithm.
Start at `make_plan`. Test: python -m pytest tests/test_plan.py -q
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from nanorl.advantage import ADVANTAGE_ESTIMATORS, estimator_inputs
from nanorl.losses import POLICY_LOSSES


@dataclass(frozen=True)
class Plan:
    """What one step computes before the update (each a StepTensors field, nanorl/trajectory.py)."""
    estimator: str | Callable
    """The advantage estimator: a registry name, or a user function (nanorl/plugins.py)."""
    estimator_inputs: frozenset
    """The keyword inputs it can use (advantage.estimator_inputs)."""
    old_logprobs: bool
    """Recompute log π_old before the update (off-policy updates, and whatever reads it first)."""
    sum_sq_probs: bool
    """Σ_v π_old(v)² per token, a by-product of the recompute's LM head (OTB-style estimators)."""
    old_entropy: bool
    """π_old's entropy per token (the 80/20 rule's token selection, --top-entropy-quantile)."""
    values: bool
    """The critic's values before the update (a critic exists: --vf-coef > 0)."""
    greedy_baselines: bool
    """One greedy response per prompt, scored: its reward is the baseline (an estimator's `baselines`)."""
    is_weights: str
    """Truncated / masked IS weights π_old/π_rollout (--tis-cap, --mis-high): "" (none), "recompute"
    (from the recomputed π_old, before the advantage, which may read them), or "first forward"
    (on-policy with nothing reading π_old before the update: from the update's own forward, detached,
    which IS π_old — the same weights without a second forward; nanorl/update.py micro_step)."""
    reference: str
    """Where the reference logprobs come from (a KL term: --kl-coef > 0): "" (no KL term), "from the
    worker" (--async-steps: scored with the rollout), "every row" (before the advantage: a KL in the
    reward, or every row trains), "trained rows" (after the advantage, only the rows that train: KL as
    a loss with --skip-zero-advantage, where a row with advantage 0 everywhere never reaches the loss)."""
    kl_in_reward: bool
    """The KL penalty goes into the rewards the estimator sees (else it is a loss term, if any)."""
    teacher: bool = False
    """log π_teacher of the sampled tokens, scored by --teacher (an estimator's `teacher_logprobs`, or
    --distill-coef adding the distillation advantage to another estimator's)."""

    @property
    def scoring_pass(self) -> bool:
        """Whether the step runs the no-gradient scoring pass of the policy (and critic) at all."""
        return self.old_logprobs or self.values or self.sum_sq_probs or self.old_entropy


def explicit_inputs(fn: Callable) -> frozenset:
    """The keyword parameters a function names (a **kwargs catch-all declares nothing by itself)."""
    params = inspect.signature(fn).parameters
    return frozenset(k for k, p in params.items() if p.kind is not p.VAR_KEYWORD)


def loss_needs(policy_loss) -> frozenset:
    """A policy loss's declared needs: a registered name, or a user function's `needs` attribute."""
    if callable(policy_loss):
        return frozenset(getattr(policy_loss, "needs", ()))
    return POLICY_LOSSES[policy_loss].needs


def make_plan(cfg, estimator: Callable, policy_loss) -> Plan:
    """The plan for Config `cfg`, its resolved estimator and its policy loss (a name or a function).

    π_old is recomputed when the update is off-policy (several epochs or mini-batches), when
    --old-logprobs recompute asks for it, and when anything reads it before the update: a KL in the
    reward, IS weights an estimator reads, the 80/20 entropy selection, a teacher's signal
    (--distill-coef or an estimator reading `teacher_logprobs`), or an estimator / loss that declares
    it. On-policy and unread, the recompute is skipped: the update's first forward is π_old itself
    (nanorl/update.py), and TIS / MIS weights come from it too.
    --old-logprobs rollout takes the engine's logprobs instead (no recompute)."""
    named = explicit_inputs(ADVANTAGE_ESTIMATORS[estimator] if isinstance(estimator, str) else estimator)
    on_policy = cfg.optim.ppo_epochs == 1 and cfg.optim.mini_batches == 1
    # distillation: log π_teacher − log π_old, both before the update (nanorl/advantage.py opd)
    teacher = "teacher_logprobs" in named or cfg.distill.distill_coef > 0
    reads_old = (cfg.kl.kl_in_reward or bool(cfg.top_entropy_quantile) or teacher
                 or "old_logprobs" in named or "old_logprobs" in loss_needs(policy_loss))
    # TIS / MIS need π_old before the update only when something reads them (or it) first
    off = cfg.offpolicy
    is_early = off.old_logprobs != "auto" or not on_policy or reads_old or "rollout_is_weights" in named
    is_weights = "" if not (off.tis_cap or off.mis_high) else "recompute" if is_early else "first forward"
    old = off.old_logprobs == "recompute" or (off.old_logprobs == "auto" and (not on_policy or reads_old
                                                                              or is_weights == "recompute"))
    # --log-kl scores it like a KL loss whose coefficient is 0: logged, never in the loss
    reference = ("" if not cfg.uses_reference else "from the worker" if cfg.pipeline.async_steps
                 else "every row" if cfg.kl.kl_in_reward or not cfg.memory.skip_zero_advantage
                 else "trained rows")
    return Plan(estimator=estimator, estimator_inputs=estimator_inputs(estimator), old_logprobs=old,
                sum_sq_probs="sum_sq_probs" in named, old_entropy=bool(cfg.top_entropy_quantile),
                values=cfg.vf_coef > 0, greedy_baselines="baselines" in named, is_weights=is_weights,
                reference=reference, kl_in_reward=cfg.kl.kl_in_reward, teacher=teacher)
