"""Policy-gradient losses, the value loss, and how a [B, T] loss becomes a scalar: link 5 of the chain.

The advantage A_t says how much better token y_t was than expected; the loss turns it into a gradient
on log π_θ(y_t). Samples come from an older policy (and another engine), so most losses compare the two
through the per-token ratio r_t = π_θ/π_old = exp(clamp(logp − old_logp, −20, 20)), clamped before the
exp (no inf, ever). Each surrogate returns a per-token loss [B, T] to minimise and is registered with
`register_policy_loss` with what it needs before the update (nanorl/plan.py). Start at
`ppo_clip_loss`, `aggregate`, then `total_loss`, which assembles policy, KL, entropy and value terms.
Key choices: every aggregation mode takes the whole optimizer step's denominators, so micro-batch
losses sum to the full-batch loss exactly (TRL #3021); dual-clip on by default (c = 3, as verl);
KL-Cov / Clip-Cov select tokens once per optimizer step. The papers, the formulas and where verl and
slime differ: docs/from-slime-verl.md. Imports torch and the standard library only.
Test: python -m pytest tests/test_losses.py -q
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

LOG_RATIO_CLAMP = 20.0
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- masked helpers
def _check(mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected mask's {tuple(mask.shape)}")


def _clean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """float32 x with masked positions replaced by 0 BEFORE any arithmetic: NaN/inf there never
    reach a loss, metric or gradient (torch.where routes no gradient to the unselected side)."""
    return torch.where(valid, x.float(), torch.zeros((), device=x.device))


def _mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return _clean(x, valid).sum() / valid.sum().clamp(min=1)


def _seq_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B]
    return _clean(x, valid).sum(-1) / valid.sum(-1).clamp(min=1)


def _max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if not valid.any():
        return torch.zeros((), device=x.device)
    return torch.where(valid, x.float(), torch.full((), -torch.inf, device=x.device)).max()


def log_ratio_and_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_ratio = clamp(logp − old_logp, ±20) and ratio = exp(log_ratio); both [B, T] float32."""
    if logp.shape != old_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ")
    log_ratio = (logp.float() - old_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


# ----------------------------------------------------------------------------- policy losses
# Each takes logp (grad), old_logp, adv, mask: [B, T] and returns (loss [B, T], stats), loss 0 on
# masked positions; stats maps a metric name to a [B, T] 0/1 indicator (masked-meaned later).
def ppo_clip_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """PPO clipped surrogate, asymmetric ε (DAPO clip-higher), optional dual-clip c > 1 for A < 0."""
    _check(mask, logp=logp, old_logp=old_logp, adv=adv)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020), got {dual_clip}")
    valid = mask > 0
    logp, old_logp, adv = _clean(logp, valid), _clean(old_logp, valid), _clean(adv, valid)
    _, ratio = log_ratio_and_ratio(logp, old_logp)  # [B, T]
    loss1 = -adv * ratio  # [B, T]
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    clipped = loss2 > loss1  # the clipped branch won: zero gradient on this token
    loss = torch.maximum(loss1, loss2)
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip  # [B, T], the bound on the loss for A < 0
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    stats = {"clip_high": clipped & (ratio > 1.0 + clip_high), "clip_low": clipped & (ratio < 1.0 - clip_low),
             "clip": clipped, "dual_clip": dual}
    return loss, stats


def gspo_loss(logp, old_logp, adv, mask, clip_low=3e-4, clip_high=4e-4):
    """GSPO(-token): sequence ratio s_i = exp(masked mean of the log-ratio), PPO-clipped."""
    _check(mask, logp=logp, old_logp=old_logp, adv=adv)
    valid = mask > 0
    logp, old_logp, adv = _clean(logp, valid), _clean(old_logp, valid), _clean(adv, valid)
    seq_log_ratio = _seq_mean(logp - old_logp, valid).detach()  # [B]
    log_s = seq_log_ratio.unsqueeze(-1) + logp - logp.detach()  # [B, T] value log s_i, grad ∇logp_t
    s = torch.exp(log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]
    loss1, loss2 = -adv * s, -adv * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = (loss2 > loss1) & valid
    stats = {"clip_high": clipped & (s > 1.0 + clip_high), "clip_low": clipped & (s < 1.0 - clip_low),
             "clip": clipped}
    return _clean(torch.maximum(loss1, loss2), valid), stats


def cispo_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.2):
    """CISPO: −sg(clip(r))·A·logp — the clipped IS weight is detached, the gradient flows via logp."""
    _check(mask, logp=logp, old_logp=old_logp, adv=adv)
    valid = mask > 0
    logp, old_logp, adv = _clean(logp, valid), _clean(old_logp, valid), _clean(adv, valid)
    _, ratio = log_ratio_and_ratio(logp, old_logp)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()  # [B, T]
    stats = {"clip_high": (ratio > 1.0 + clip_high) & valid, "clip_low": (ratio < 1.0 - clip_low) & valid}
    stats["clip"] = stats["clip_high"] | stats["clip_low"]
    return -weight * adv * logp, stats


def gmpo_loss(logp, old_logp, adv, mask, clip_low=0.4, clip_high=0.4):
    """GMPO: −A_i · exp(mean_t clip(log r_t)) per sequence, pessimistic token clip in log space."""
    _check(mask, logp=logp, old_logp=old_logp, adv=adv)
    valid = mask > 0
    logp, old_logp, adv = _clean(logp, valid), _clean(old_logp, valid), _clean(adv, valid)
    log_ratio, _ = log_ratio_and_ratio(logp, old_logp)
    sign = torch.sign(adv)  # pessimism: A > 0 caps the upside (+ε_high), A < 0 the downside (−ε_low)
    clamped = log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)  # [B, T]
    seq_ratio = torch.exp(_seq_mean(pessimistic, valid))  # [B], geometric mean of token ratios
    seq_loss = -_seq_mean(adv, valid) * seq_ratio  # [B]
    clipped = (log_ratio != clamped) & valid
    stats = {"clip_high": clipped & (adv > 0), "clip_low": clipped & (adv < 0), "clip": clipped}
    return _clean(seq_loss.unsqueeze(-1).expand_as(logp), valid), stats


def _dppo(logp, old_logp, adv, mask, delta_low, delta_high, ratio_cap, divergence):
    _check(mask, logp=logp, old_logp=old_logp, adv=adv)
    valid = mask > 0
    logp, old_logp, adv = _clean(logp, valid), _clean(old_logp, valid), _clean(adv, valid)
    _, ratio = log_ratio_and_ratio(logp, old_logp)
    p, q = torch.exp(logp.detach()), torch.exp(old_logp)  # [B, T] sampled-token probabilities
    if divergence == "tv":
        keep_pos, keep_neg = (p - q) <= delta_high, (p - q) >= -delta_low
    else:  # binary KL(Bern(q) ‖ Bern(p)); 1e-8 guards log(0) when a probability reaches 1
        d = q * (old_logp - logp.detach()) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        keep_pos, keep_neg = (d <= delta_high) | (p <= q), (d <= delta_low) | (p >= q)
    keep = torch.where(adv > 0, keep_pos, keep_neg) & valid  # [B, T] inside the trust region
    weight = ratio.clamp(max=ratio_cap).detach()  # truncated IS weight
    clipped = valid & ~keep  # [B, T]
    stats = {"clip": clipped, "clip_high": clipped & (adv > 0), "clip_low": clipped & (adv <= 0)}
    return -adv * weight * logp * keep.float(), stats


def dppo_tv_loss(logp, old_logp, adv, mask, delta_low=0.15, delta_high=0.15, ratio_cap=10.0):
    """DPPO-Binary-TV: update a token only while |π_θ − π_old| of its probability stays within δ."""
    return _dppo(logp, old_logp, adv, mask, delta_low, delta_high, ratio_cap, "tv")


def dppo_kl_loss(logp, old_logp, adv, mask, delta_low=0.05, delta_high=0.05, ratio_cap=10.0):
    """DPPO-Binary-KL: update a token only while the binary KL of its probability stays within δ."""
    return _dppo(logp, old_logp, adv, mask, delta_low, delta_high, ratio_cap, "kl")


def sapo_loss(logp, old_logp, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """SAPO: −A·σ(τ(r − 1))·4/τ, τ = τ_pos where A > 0 else τ_neg. A soft, differentiable trust region."""
    _check(mask, logp=logp, old_logp=old_logp, adv=adv)
    valid = mask > 0
    logp, old_logp, adv = _clean(logp, valid), _clean(old_logp, valid), _clean(adv, valid)
    _, ratio = log_ratio_and_ratio(logp, old_logp)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))  # [B, T]
    return -adv * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau), {}


def reinforce_loss(logp, old_logp, adv, mask):
    """−A·logp: the policy gradient itself (REINFORCE; GPG's loss). old_logp only for the shared signature."""
    _check(mask, logp=logp, old_logp=old_logp, adv=adv)
    valid = mask > 0
    return -_clean(adv, valid) * _clean(logp, valid), {}


def dro_loss(logp, old_logp, adv, mask, beta=1.0):
    """DRO: −(A·logp − ½β·(logp − old_logp)²), a quadratic pull back to π_old instead of a clip."""
    _check(mask, logp=logp, old_logp=old_logp, adv=adv)
    if not beta > 0:
        raise ValueError(f"DRO needs beta > 0, got {beta}")
    valid = mask > 0
    logp, old_logp, adv = _clean(logp, valid), _clean(old_logp, valid), _clean(adv, valid)
    return -(adv * logp - 0.5 * beta * (logp - old_logp).square()), {}


def cov_selection(logp, adv, mask, ratio, mode, bounds=(1.0, 5.0), generator=None):
    """Tokens [B, T] bool that kl_cov / clip_cov treat specially, from c_t = (A_t − Ā)(logp_t − mean logp)
    over the valid tokens: kl_cov the k = max(1, ⌊ratio·N⌋) largest; clip_cov k drawn at random among
    lb < c_t < ub. Pass the whole optimizer step's tensors (logp detached)."""
    _check(mask, logp=logp, adv=adv)
    if mode not in ("kl_cov", "clip_cov") or not ratio > 0:
        raise ValueError(f"cov_selection: mode kl_cov or clip_cov and ratio > 0, got {mode!r}, {ratio}")
    valid = mask > 0
    lp, a = _clean(logp.detach(), valid), _clean(adv, valid)
    cov = (a - _mean(a, valid)) * (lp - _mean(lp, valid))                      # [B, T]
    k = max(1, int(ratio * int(valid.sum())))
    if mode == "kl_cov":
        score = torch.where(valid, cov, torch.full((), -torch.inf))
    else:
        band = valid & (cov > bounds[0]) & (cov < bounds[1])
        noise = torch.rand(cov.shape, generator=generator).to(cov.device)       # a random k of the band
        score = torch.where(band, noise, torch.full((), -torch.inf))
    picked = torch.zeros(valid.numel(), dtype=torch.bool, device=cov.device)
    top = score.flatten().topk(min(k, valid.numel())).indices
    picked[top] = True
    return picked.view_as(valid) & (score > -torch.inf)


def kl_cov_loss(logp, old_logp, adv, mask, selected, kl_coef=1.0):
    """KL-Cov: −A·r everywhere, plus kl_coef·|log r| on the selected high-covariance tokens."""
    _check(mask, logp=logp, old_logp=old_logp, adv=adv, selected=selected)
    valid = mask > 0
    logp, old_logp, adv = _clean(logp, valid), _clean(old_logp, valid), _clean(adv, valid)
    log_ratio, ratio = log_ratio_and_ratio(logp, old_logp)
    sel = selected.bool() & valid
    return -adv * ratio + kl_coef * log_ratio.abs() * sel, {"clip": sel}


def clip_cov_loss(logp, old_logp, adv, mask, selected, clip_low=0.2, clip_high=0.2):
    """Clip-Cov: PPO's clipped loss with the selected high-covariance tokens detached (zero gradient)."""
    loss, stats = ppo_clip_loss(logp, old_logp, adv, mask, clip_low, clip_high)
    _check(mask, selected=selected)
    sel = selected.bool() & (mask > 0)
    stats["clip"] = stats["clip"] | sel
    return torch.where(sel, torch.zeros((), device=loss.device), loss), stats  # verl: loss · 0


def top_entropy_mask(entropy, mask, q):
    """The top ⌈q·N⌉ entropy tokens among the N valid ones → [B, T] bool (the 80/20 rule: q = 0.2)."""
    _check(mask, entropy=entropy)
    if not 0 < q <= 1:
        raise ValueError(f"top-entropy quantile must be in (0, 1], got {q}")
    valid = mask > 0
    n = int(valid.sum())
    score = torch.where(valid, entropy.detach().float(), torch.full((), -torch.inf))
    picked = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    picked[score.flatten().topk(min(math.ceil(q * n), valid.numel())).indices] = True
    return picked.view_as(valid) & valid


# ----------------------------------------------------------------------------- value loss
def value_loss(values, old_values, returns, mask, clip=0.2):
    """Clipped value loss ½·max((V − R)², (V_clip − R)²), V_clip = V_old + clip(V − V_old, ±clip).

    The ½ (verl has it; slime/OpenRLHF do not) makes the gradient (V − R), the plain regression
    residual, so vf_coef means the same thing as in the PPO paper. clip=None disables clipping.
    Returns (loss [B, T], {"clip": indicator [B, T]}).
    """
    _check(mask, values=values, old_values=old_values, returns=returns)
    valid = mask > 0
    v, v_old, ret = _clean(values, valid), _clean(old_values, valid), _clean(returns, valid)
    loss = (v - ret).square()
    clipped = torch.zeros_like(valid)
    if clip is not None:
        v_clip = v_old + (v - v_old).clamp(-clip, clip)
        loss_clip = (v_clip - ret).square()
        clipped = (loss_clip > loss) & valid
        loss = torch.maximum(loss, loss_clip)
    return 0.5 * loss, {"clip": clipped}


# ----------------------------------------------------------------------------- aggregation
def global_denominators(mask: torch.Tensor) -> tuple[int, int]:
    """(num_tokens, num_seqs) of a [B, T] mask: call on the WHOLE optimizer-step batch (sum across
    ranks) and pass both to every micro-batch's aggregate / total_loss."""
    valid = mask > 0
    return int(valid.sum()), int(valid.any(-1).sum())


def aggregate(loss_mat, mask, mode="token-mean", num_tokens=None, num_seqs=None, norm_len=None):
    """Reduce loss_mat [B, T] over mask [B, T] (> 0 = valid) to a scalar; see the module docstring.

    num_tokens / num_seqs: global denominators (default: this batch's own counts); norm_len: L of
    seq-mean-token-sum-norm (default T; pass a constant such as max_new_tokens for invariance).
    Masked positions never contribute (NaN there is fine); an all-zero mask gives 0.
    """
    _check(mask, loss_mat=loss_mat)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {', '.join(AGG_MODES)}")
    valid = mask > 0
    x = _clean(loss_mat, valid)  # [B, T]
    n_tok = valid.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=x.device)
    n_seq = valid.any(-1).sum() if num_seqs is None else torch.as_tensor(num_seqs, device=x.device)
    n_tok, n_seq = n_tok.float().clamp(min=1), n_seq.float().clamp(min=1)
    if mode == "token-mean":
        return x.sum() / n_tok
    if mode == "token-sum":
        return x.sum()
    if mode == "seq-mean-token-sum":
        return x.sum() / n_seq
    if mode == "seq-mean-token-mean":
        return (x.sum(-1) / valid.sum(-1).clamp(min=1)).sum() / n_seq
    length = mask.shape[-1] if norm_len is None else norm_len
    return x.sum() / (n_seq * length)


# ----------------------------------------------------------------------------- assembly
@dataclass
class LossConfig:
    policy: str | Callable = "ppo"     # a key of POLICY_LOSSES, or a user loss (user_policy_loss)
    clip_low: float = 0.2              # ε_low (ppo/gspo/cispo/clip_cov), log-space bound (gmpo), δ_low (dppo)
    clip_high: float = 0.2             # ε_high ...; DAPO clip-higher uses 0.28
    dual_clip: float | None = 3.0      # ppo only: c > 1 bounds the loss for A < 0 (None = off)
    ratio_cap: float = 10.0            # dppo: truncation C of the detached IS weight
    params: object = None              # the loss's own settings (its PolicyLoss.params; None = defaults)
    agg_mode: str = "token-mean"       # one of AGG_MODES
    norm_len: int | None = None        # L for seq-mean-token-sum-norm
    entropy_coef: float = 0.0          # loss −= entropy_coef · aggregated entropy
    kl_coef: float = 0.0               # loss += kl_coef · aggregated kl
    vf_coef: float = 0.0               # loss += vf_coef · aggregated value loss
    value_clip: float | None = 0.2


def _by_name(fn: Callable, low: str, high: str, **extra: str) -> Callable:
    return lambda lp, old, adv, m, c, sel: fn(lp, old, adv, m, **{low: c.clip_low, high: c.clip_high},
                                              **{k: getattr(c, v) for k, v in extra.items()})


# ----------------------------------------------------------------------------- a loss's own settings
# Declared here, with the loss they belong to (register_policy_loss's `params`): each field is a flag of
# train.py by its own name, shown by --help under TITLE, and refused unless --policy-loss is one of the
# losses registered with the class (nanorl/config_groups.py LossParams). `problems` lists what is out of
# range, each message naming the field.
@dataclass
class SapoParams:
    TITLE: ClassVar[str] = "SAPO's gate (--policy-loss sapo)"
    sapo_tau_pos: float = 1.0
    """SAPO: gate temperature τ for A > 0 (Gao et al. 2025: 1.0)."""
    sapo_tau_neg: float = 1.05
    """SAPO: gate temperature τ for A ≤ 0 (Gao et al. 2025: 1.05; larger damps negative updates faster)."""

    def problems(self) -> list[str]:
        return [f"{name} must be > 0" for name in ("sapo_tau_pos", "sapo_tau_neg")
                if not getattr(self, name) > 0]


@dataclass
class DroParams:
    TITLE: ClassVar[str] = "DRO's penalty (--policy-loss dro)"
    dro_beta: float = 1.0
    """DRO: β of the quadratic penalty ½β(log π_θ − log π_old)² (verl requires it set; no paper default)."""

    def problems(self) -> list[str]:
        return [] if self.dro_beta > 0 else ["dro_beta must be > 0"]


@dataclass
class CovParams:
    TITLE: ClassVar[str] = "KL-Cov / Clip-Cov's token selection (--policy-loss kl_cov or clip_cov)"
    cov_ratio: float = 2e-4
    """KL-Cov / Clip-Cov: share of the step's tokens selected by covariance (verl's default 2e-4)."""
    cov_kl_coef: float = 1.0
    """KL-Cov: κ of κ·|log r| on the selected tokens (verl's kl_cov fallback 1.0)."""

    def problems(self) -> list[str]:
        return [] if 0 < self.cov_ratio <= 1 else [f"cov_ratio must be in (0, 1], got {self.cov_ratio}"]


def _own(c: LossConfig, cls: type):
    """The loss's own settings in `c` (its class's defaults when none were given)."""
    return cls() if c.params is None else c.params


# ----------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss. fn(logp, old_logp, adv, mask, cfg, selected) -> (loss [B, T], stats).
    needs: the step quantities it reads that are computed before the update ("old_logprobs": π_old
    recompute even on-policy, because `select` reads it); the plan (nanorl/plan.py) computes exactly
    those. select(logp, adv, mask, cfg, generator) -> [B, T] bool: the tokens it acts on, chosen once
    per optimizer step over the whole step, so micro-batching changes nothing (None: no selection).
    params: the dataclass of its own settings (LossConfig.params; SapoParams above), or None."""
    fn: Callable
    needs: frozenset = frozenset()
    select: Callable | None = None
    params: type | None = None


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, needs=(), select: Callable | None = None, params: type | None = None):
    """Decorator: add a policy loss (the fn signature of PolicyLoss) under `name`, registered once."""
    def add(fn: Callable) -> Callable:
        if name in POLICY_LOSSES and POLICY_LOSSES[name].fn is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = PolicyLoss(fn, frozenset(needs), select, params)
        return fn
    return add


def _cov_select(mode: str) -> Callable:
    return lambda logp, adv, mask, c, generator: cov_selection(logp, adv, mask, _own(c, CovParams).cov_ratio,
                                                               mode, generator=generator)


register_policy_loss("ppo")(_by_name(ppo_clip_loss, "clip_low", "clip_high", dual_clip="dual_clip"))
register_policy_loss("gspo")(_by_name(gspo_loss, "clip_low", "clip_high"))
register_policy_loss("cispo")(_by_name(cispo_loss, "clip_low", "clip_high"))
register_policy_loss("gmpo")(_by_name(gmpo_loss, "clip_low", "clip_high"))
register_policy_loss("dppo_tv")(_by_name(dppo_tv_loss, "delta_low", "delta_high", ratio_cap="ratio_cap"))
register_policy_loss("dppo_kl")(_by_name(dppo_kl_loss, "delta_low", "delta_high", ratio_cap="ratio_cap"))
register_policy_loss("sapo", params=SapoParams)(lambda lp, old, adv, m, c, sel: sapo_loss(
    lp, old, adv, m, _own(c, SapoParams).sapo_tau_pos, _own(c, SapoParams).sapo_tau_neg))
register_policy_loss("reinforce")(lambda lp, old, adv, m, c, sel: reinforce_loss(lp, old, adv, m))
register_policy_loss("gpg")(lambda lp, old, adv, m, c, sel: reinforce_loss(lp, old, adv, m))
register_policy_loss("dro", params=DroParams)(
    lambda lp, old, adv, m, c, sel: dro_loss(lp, old, adv, m, _own(c, DroParams).dro_beta))
# KL-Cov / Clip-Cov select their tokens from π_old before the update: they need the recompute
register_policy_loss("kl_cov", needs={"old_logprobs"}, select=_cov_select("kl_cov"), params=CovParams)(
    lambda lp, old, adv, m, c, sel: kl_cov_loss(lp, old, adv, m, sel, _own(c, CovParams).cov_kl_coef))
register_policy_loss("clip_cov", needs={"old_logprobs"}, select=_cov_select("clip_cov"), params=CovParams)(
    lambda lp, old, adv, m, c, sel: clip_cov_loss(lp, old, adv, m, sel, c.clip_low, c.clip_high))
# the losses that take a token selection (their own settings: CovParams)
COV_LOSSES = tuple(name for name, loss in POLICY_LOSSES.items() if loss.select is not None)


def params_owners() -> dict[type, tuple[str, ...]]:
    """Each registered settings class with the losses it belongs to, in registration order."""
    owners: dict[type, tuple[str, ...]] = {}
    for name, loss in POLICY_LOSSES.items():
        if loss.params is not None:
            owners[loss.params] = owners.get(loss.params, ()) + (name,)
    return owners

# A user policy loss (--policy-loss file.py:fn, nanorl/plugins.py) is called as
# fn(logp, old_logp, advantages, mask, **named) with, by name from its signature, any LossConfig field
# and `metadata` (the micro-batch's Sample.metadata dicts, one per row).
PLUGIN_LOSS_INPUTS = frozenset(LossConfig.__dataclass_fields__) - {"policy", "params"} | {"metadata"}


def user_policy_loss(fn: Callable, logp, old_logp, adv, mask, cfg: LossConfig, metadata=None):
    """A user loss → (loss [B, T], stats): it may return the matrix alone or with a dict of [B, T]
    masks/values or numbers (stats "clip", "clip_low", ... are logged as pg_clipfrac, ...; any other key
    as train/<key>, `user_loss_stats`)."""
    import inspect
    takes = inspect.signature(fn).parameters
    named = {k: getattr(cfg, k) for k in takes if k in PLUGIN_LOSS_INPUTS and k != "metadata"}
    if "metadata" in takes:
        named["metadata"] = metadata
    elif metadata is not None:
        raise ValueError(f"policy loss {fn.__name__!r} takes no `metadata`, but metadata was given")
    out = fn(logp, old_logp, adv, mask, **named)
    mat, stats = out if isinstance(out, tuple) else (out, {})
    if not isinstance(mat, torch.Tensor) or mat.shape != mask.shape or not isinstance(stats, dict):
        raise TypeError(f"policy loss {fn.__name__!r} must return a loss [B, T] like mask "
                        f"{tuple(mask.shape)} (or (loss, stats dict)), got {type(out).__name__}")
    return mat, stats


# the stats every loss may return, logged as pg_clipfrac, pg_clipfrac_low, ... (total_loss)
CLIP_STATS = ("clip", "clip_low", "clip_high", "dual_clip")


def user_loss_stats(fn: Callable, stats: dict, valid: torch.Tensor) -> dict:
    """A user loss's own stats beyond CLIP_STATS, logged as train/<key>: a [B, T] value → its masked
    token mean (the max for a key ending in _max), a number or 0-d tensor → itself (micro-batches are
    then averaged by their token counts, as every token mean is; nanorl/update.py)."""
    out = {}
    for key, value in stats.items():
        if key in CLIP_STATS:
            continue
        value = torch.as_tensor(value, device=valid.device).detach().float()
        if value.dim() == 0:
            out[key] = value
        elif value.shape == valid.shape:
            out[key] = (_max if key.endswith("_max") else _mean)(value, valid)
        else:
            raise TypeError(f"policy loss {fn.__name__!r}: stat {key!r} must be a number or [B, T] like mask "
                            f"{tuple(valid.shape)}, got shape {tuple(value.shape)}")
    return out


def total_loss(cfg: LossConfig, logp, old_logp, advantages, mask, *, entropy=None, kl=None,
               rollout_logp=None, values=None, old_values=None, returns=None, weights=None, selected=None,
               num_tokens=None, num_seqs=None, metadata=None):
    """loss = pg_loss − entropy_coef·entropy + kl_coef·kl (+ vf_coef·value loss), for ONE micro-batch.

    All tensors [B, T]: logp (grad) and old_logp of the sampled tokens, advantages, mask; entropy
    (grad) per token; kl per token (e.g. kl.kl_estimator(logp, ref_logp, "k3+", mask=mask));
    rollout_logp, the engine's logprobs (the mismatch metrics); weights, detached off-policy
    corrections on the policy loss (nanorl/offpolicy.py); selected, kl_cov/clip_cov's tokens
    (`cov_selection` over the whole step; None = selected on this micro-batch, as verl does);
    values (grad), old_values, returns for the critic; metadata, per-row dicts for a user policy
    loss (cfg.policy a function: user_policy_loss). Every term is aggregated with cfg.agg_mode
    and the same global denominators, so summing the returned losses over micro-batches equals the
    loss of the whole batch. Returns (loss, metrics): metrics are detached 0-d tensors; loss,
    pg_loss, kl_loss, vf_loss are this micro-batch's contributions (sum them over micro-batches);
    all others are masked token means over this micro-batch (weight them by metrics["num_tokens"]),
    except the *_max values.
    """
    user = callable(cfg.policy)
    if not user and cfg.policy not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {cfg.policy!r}; choose one of {', '.join(POLICY_LOSSES)}")
    if metadata is not None and not user:
        raise ValueError(f"total_loss: `metadata` is for a user policy loss, not {cfg.policy!r}")
    _check(mask, logp=logp, old_logp=old_logp, advantages=advantages, entropy=entropy, kl=kl,
           rollout_logp=rollout_logp, values=values, old_values=old_values, returns=returns, weights=weights,
           selected=selected)
    entry = None if user else POLICY_LOSSES[cfg.policy]
    if selected is not None and (entry is None or entry.select is None):
        raise ValueError(f"total_loss: `selected` is for {' / '.join(COV_LOSSES)}, not {cfg.policy!r}")
    valid = mask > 0
    agg = lambda x: aggregate(x, mask, cfg.agg_mode, num_tokens, num_seqs, cfg.norm_len)  # noqa: E731
    zero = torch.zeros((), device=logp.device)
    if entry is not None and entry.select is not None and selected is None:
        selected = entry.select(logp, advantages, mask, cfg, torch.Generator().manual_seed(0))

    if user:
        # [B, T]
        pg_mat, stats = user_policy_loss(cfg.policy, logp, old_logp, advantages, mask, cfg, metadata)
    else:
        pg_mat, stats = entry.fn(logp, old_logp, advantages, mask, cfg, selected)  # [B, T]
    if weights is not None:  # off-policy corrections, detached, on the policy loss only
        pg_mat = pg_mat * _clean(weights.detach(), valid)
    pg_loss = agg(pg_mat)
    loss = pg_loss
    m = {"logprob_diff_abs": zero, "logprob_diff_abs_max": zero}
    if rollout_logp is not None:
        diff = (_clean(old_logp, valid) - _clean(rollout_logp, valid)).abs()
        m["logprob_diff_abs"], m["logprob_diff_abs_max"] = _mean(diff, valid), _max(diff, valid)

    kl_loss = agg(kl) if kl is not None else zero
    if kl is not None:
        m["kl_ref"] = _mean(kl.detach(), valid)  # per-token KL to the reference (the β controller's input)
    ent = _mean(entropy, valid) if entropy is not None else zero
    # The entropy aggregated as the loss aggregates (ent above is the token mean, whatever the mode)
    ent_loss = agg(entropy) if entropy is not None else zero
    if kl is not None and cfg.kl_coef:
        loss = loss + cfg.kl_coef * kl_loss
    if entropy is not None and cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * ent_loss
    vf_loss, vf_clip = zero, zero
    if values is not None:
        if old_values is None or returns is None:
            raise ValueError("total_loss: values given without old_values and returns")
        v_mat, v_stats = value_loss(values, old_values, returns, mask, cfg.value_clip)
        vf_loss, vf_clip = agg(v_mat), _mean(v_stats["clip"].float(), valid)
        loss = loss + cfg.vf_coef * vf_loss

    log_ratio, ratio = log_ratio_and_ratio(_clean(logp.detach(), valid), _clean(old_logp, valid))
    frac = lambda k: _mean(stats[k].float(), valid) if k in stats else zero  # noqa: E731 (CLIP_STATS)
    m.update(loss=loss, pg_loss=pg_loss, kl_loss=kl_loss, vf_loss=vf_loss, vf_clipfrac=vf_clip, entropy=ent,
             entropy_loss=ent_loss,
             pg_clipfrac=frac("clip"), pg_clipfrac_low=frac("clip_low"), pg_clipfrac_high=frac("clip_high"),
             dual_clipfrac=frac("dual_clip"), ppo_kl=_mean(-log_ratio, valid),
             ratio_mean=_mean(ratio, valid), ratio_max=_max(ratio, valid),
             num_tokens=valid.sum().float(), num_seqs=valid.any(-1).sum().float())
    if user:  # its own stats, by name beside these (a clash would overwrite one of the step's metrics)
        own = user_loss_stats(cfg.policy, stats, valid)
        clash = sorted(set(own) & set(m))
        if clash:
            raise ValueError(f"policy loss {cfg.policy.__name__!r} returns stats {clash}, which are metric "
                             "names of the step already: rename them")
        m.update(own)
    return loss, {k: v.detach().float() for k, v in m.items()}
