"""KL divergence to a reference policy: per-token estimators, the reward penalty, β controllers.

RL fine-tuning pushes π_θ toward high reward; left alone it drifts into degenerate text that games the
reward. The brake: a KL penalty to a frozen reference π_ref, maximise E[R] − β·KL(π_θ ‖ π_ref), estimated
from the sampled token's logprobs only (lr = log π_θ(y) − log π_ref(y)): k1 = lr, k2 = ½·lr²,
k3 = exp(−lr) − 1 + lr, abs = |lr|, and straight-through "+" variants that report k's value with k2's
gradient. Placement: folded into the reward before the advantage (`kl_penalized_rewards`) or added to
the loss (per-token values for losses.total_loss(kl=...)); β fixed (`FixedKLController`) or adapted to a
target KL (`AdaptiveKLController`). Start at `kl_estimator`, then `importance_weighted_kl` (off-policy
tokens). Key choices: lr clamped to ±20 before exp, "low_var_kl" an alias of "k3". The estimators' value
vs gradient, clamps (verl vs slime), off-policy weighting and the β rule: docs/from-slime-verl.md,
"nanorl/kl.py".

Self-contained: imports torch and the standard library only. Test: python -m pytest tests/test_kl.py -q
"""
from __future__ import annotations

import math

import torch

# |log-ratio| clamp before any exp (project rule; verl uses the same value)
LOG_RATIO_CLAMP = 20.0
# verl's clamp on the k3 value; k3 >= 0 so only the upper side ever binds
K3_CLAMP = 10.0

_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
KL_KINDS = ("k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl",
            "k1+", "k2+", "k3+", "abs+", "kl+", "low_var_kl+")


def _check_pair(a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{names}: shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")


def _clean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x.float()
    _check_pair(x, mask, "KL input vs mask")
    return torch.where(mask > 0, x.float(), torch.zeros((), device=x.device))


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _forward_value(log_ratio: torch.Tensor, base: str, k3_clamp: float | None) -> torch.Tensor:
    if base == "k1":
        return log_ratio
    if base == "k2":
        return _k2(log_ratio)
    if base == "abs":
        return log_ratio.abs()
    # k3: with u = log(π_ref/π_θ) = -lr, k3 = e^u - 1 - u  (>= 0 since e^u >= 1 + u)
    u = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # expm1: exact near u = 0, where most tokens live
    k3 = torch.expm1(u) - u
    return k3 if k3_clamp is None else k3.clamp(-k3_clamp, k3_clamp)


def kl_estimator(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3",
                 k3_clamp: float | None = K3_CLAMP, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from sampled-token log-probs.

    logp: [B, T] log π_θ(y_t) (may require grad); ref_logp: [B, T] log π_ref(y_t) (constant).
    kind: "k1" | "k2" | "k3" | "abs", aliases "kl"=k1, "mse"=k2, "low_var_kl"=k3, and any of these
    with a "+" suffix (value of the named estimator, gradient of k2). Returns [B, T] float32;
    aggregate it with the response mask (losses.aggregate / total_loss). mask [B, T] (optional,
    recommended): masked positions are zeroed BEFORE any arithmetic, so NaN/inf there cannot
    reach a value or, through exp's backward (0·NaN), a gradient.
    """
    _check_pair(logp, ref_logp, "kl_estimator(logp, ref_logp)")
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")
    straight_through = kind.endswith("+")
    base = _ALIASES.get(kind.rstrip("+"), kind.rstrip("+"))
    log_ratio = _clean(logp, mask) - _clean(ref_logp, mask)  # [B, T]
    value = _forward_value(log_ratio, base, k3_clamp)  # [B, T]
    if not straight_through or base == "k2":
        return value
    k2 = _k2(log_ratio)  # [B, T]
    # forward: value; backward: ∇k2
    return k2 - k2.detach() + value.detach()


def importance_weighted_kl(logp: torch.Tensor, ref_logp: torch.Tensor, old_logp: torch.Tensor,
                           kind: str = "k3", detach_weight: bool = False,
                           k3_clamp: float | None = K3_CLAMP,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """KL estimator for tokens sampled from π_old, weighted by w = π_θ/π_old (DeepSeek-V3.2).

    logp, ref_logp, old_logp: [B, T] (old_logp = log-prob under the policy that sampled the
    token; rollout log-probs or the recomputed old ones). Returns w·k, [B, T] float32.
    detach_weight=False (default): unbiased value for k1/k3 and unbiased gradient ∇KL(π_θ‖π_ref)
    for k1/k3 (the weight's own gradient supplies the score-function term).
    detach_weight=True: the weight only re-weights; pair it with a "+" kind for an unbiased
    gradient. When π_θ = π_old the value equals the unweighted estimator. mask: as in kl_estimator.
    """
    _check_pair(logp, old_logp, "importance_weighted_kl(logp, old_logp)")
    k = kl_estimator(logp, ref_logp, kind, k3_clamp, mask)  # [B, T]
    log_w = (_clean(logp, mask) - _clean(old_logp, mask)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    w = torch.exp(log_w)  # [B, T]
    return (w.detach() if detach_weight else w) * k


def kl_loss_term(logp: torch.Tensor, ref_logp: torch.Tensor, old_logp: torch.Tensor, kind: str = "k3",
                 unbiased: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token KL(π_θ‖π_ref) of a KL loss [B, T]: `kl_estimator` on the sampled tokens, or with
    unbiased=True (--unbiased-kl) `importance_weighted_kl`, which weighs each token by π_θ/π_old
    because it was sampled from π_old, not π_θ (DeepSeek-V3.2). logp, ref_logp, old_logp: [B, T]."""
    if unbiased:
        return importance_weighted_kl(logp, ref_logp, old_logp, kind, mask=mask)
    return kl_estimator(logp, ref_logp, kind, mask=mask)


def kl_penalized_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                         beta: float) -> torch.Tensor:
    """Token-level rewards with the KL penalty folded in (InstructGPT, REINFORCE++).

    scores: [B] sequence reward; kl: [B, T] per-token KL (usually k1 of old vs ref, no grad);
    mask: [B, T] response mask. Returns [B, T]: −β·kl on every valid token, plus the score on
    the LAST valid token (multi-turn masks may have holes; the last 1 is where the episode
    ends). Zero on masked positions, whatever kl holds there (NaN included). A row with no
    valid token gets all zeros: it carries no loss anyway.
    """
    _check_pair(kl, mask, "kl_penalized_rewards(kl, mask)")
    if scores.shape != kl.shape[:1]:
        raise ValueError(f"kl_penalized_rewards: scores must be [B]={kl.shape[0]}, got {tuple(scores.shape)}")
    valid = mask > 0  # [B, T]
    rewards = torch.where(valid, -beta * kl.detach().float(), torch.zeros((), device=kl.device))
    T = mask.shape[-1]
    pos = torch.arange(T, device=mask.device).expand_as(valid)  # [B, T]
    last = torch.where(valid, pos, torch.full_like(pos, -1)).amax(dim=-1)  # [B], -1 = empty row
    is_last = (pos == last.unsqueeze(-1)) & valid  # [B, T]
    return rewards + is_last.float() * scores.float().unsqueeze(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x [B, T] over mask > 0; 0 for an empty mask; NaN in masked positions never leaks."""
    _check_pair(x, mask, "masked_mean(x, mask)")
    return _clean(x, mask).sum() / (mask > 0).sum().clamp(min=1)


class FixedKLController:
    """β that never moves. update() exists so the trainer can treat both controllers alike."""

    def __init__(self, beta: float):
        if not (beta >= 0 and math.isfinite(beta)):
            raise ValueError(f"FixedKLController: beta must be finite and >= 0, got {beta}")
        self.beta = float(beta)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = float(state["beta"])


class AdaptiveKLController:
    """Ziegler et al. 2019: move β proportionally to how far the measured KL is from target.

    error = clip(current_kl / target − 1, −0.2, 0.2);  β ← β · (1 + error · n_steps / horizon).
    The clip keeps one noisy KL measurement from changing β by more than 20 %·n_steps/horizon.
    n_steps = samples (or steps) since the last update; horizon in the same unit.
    """

    def __init__(self, init_beta: float, target: float, horizon: float):
        if not (init_beta >= 0 and math.isfinite(init_beta)):
            raise ValueError(f"AdaptiveKLController: init_beta must be finite and >= 0, got {init_beta}")
        if not target > 0 or not horizon > 0:
            raise ValueError(f"AdaptiveKLController: target and horizon must be > 0, got {target}, {horizon}")
        self.beta, self.target, self.horizon = float(init_beta), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        current_kl = float(current_kl)
        # a NaN here would silently poison β for the rest of the run
        if not math.isfinite(current_kl):
            raise ValueError(f"AdaptiveKLController.update: current_kl is not finite ({current_kl})")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + error * n_steps / self.horizon
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.beta = float(state["beta"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))
