"""Off-policy corrections: importance weights for the train/inference mismatch, and OPSM.

Link 5 of the chain (loss): off-policy weights on the policy loss. The engine that sampled the tokens
(vLLM, bf16, other kernels) is not the trainer, so even on the first pass π_rollout ≠ π_old and the
policy gradient is taken under the wrong distribution. With ρ_t = π_old(y_t)/π_rollout(y_t) (both known
before the update, so the weights are computed once per step, detached, and multiply the policy loss of
every micro-batch), `is_weights` gives TIS (w = clip(ρ, low, C)), MIS (w = ρ·1[low ≤ ρ ≤ high]: outliers
dropped, not truncated), both combined, at token or sequence level; `opsm_mask` masks the negative-
advantage tokens of sequences that drifted too far (OPSM, DeepSeek-V3.2). Start at `is_weights`, then
`is_metrics` and `mismatch_metrics` (logged every step). The papers, verl's and slime's variants and the
metrics: docs/from-slime-verl.md, "nanorl/offpolicy.py".

Self-contained: imports torch and the standard library only. Test: python -m pytest tests/test_offpolicy.py -q
"""
from __future__ import annotations

import math

import torch

LOG_RATIO_CLAMP = 20.0


def _check(mask, **tensors):
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected mask's {tuple(mask.shape)}")


def _clean(x, valid):
    """float32, detached, 0 on masked positions BEFORE any arithmetic (NaN there never leaks)."""
    return torch.where(valid, x.detach().float(), torch.zeros((), device=x.device))


def _mean(x, valid):
    return _clean(x, valid).sum() / valid.sum().clamp(min=1)


def is_weights(old_logp, rollout_logp, mask, *, level="token", tis=None, mis=None):
    """Detached importance weights [B, T] from ρ = π_old/π_rollout.

    tis: (low, cap) clips ρ to [low, cap] (low 0 = verl's, upper-only); mis: (low, high) zeroes the
    weights outside the band. level "token" or "sequence" (ρ_seq = Π_t ρ_t on every token of the row).
    Returns (weights [B, T], changed [B, T] bool: the weight differs from ρ, rho [B, T] token ratios).
    """
    _check(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    if level not in ("token", "sequence"):
        raise ValueError(f"importance-weight level must be 'token' or 'sequence', got {level!r}")
    if tis is not None and not 0 <= tis[0] < 1 < tis[1]:
        raise ValueError(f"TIS needs 0 <= low < 1 < cap, got {tis}")
    if mis is not None and not 0 <= mis[0] < 1 < mis[1]:
        raise ValueError(f"MIS needs 0 <= low < 1 < high, got {mis}")
    valid = mask > 0
    log_rho = _clean(old_logp, valid) - _clean(rollout_logp, valid)               # [B, T]
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))              # [B, T] token ρ
    log_w = log_rho.sum(-1, keepdim=True).expand_as(log_rho) if level == "sequence" else log_rho
    raw = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))                # [B, T] ρ at `level`
    w = raw if tis is None else raw.clamp(tis[0], tis[1])
    if mis is not None:
        w = torch.where((raw >= mis[0]) & (raw <= mis[1]), w, torch.zeros((), device=w.device))
    changed = (w != raw) & valid
    return torch.where(valid, w, torch.zeros((), device=w.device)), changed, torch.where(valid, rho, 0.0)


def is_metrics(weights, changed, rho, mask):
    """Step-level diagnostics of the weights and of the raw token ratio (docs/from-slime-verl.md)."""
    _check(mask, weights=weights, changed=changed, rho=rho)
    valid = mask > 0
    w, r = _clean(weights, valid), _clean(rho, valid)
    n = valid.sum().clamp(min=1)
    sq = (w * w).sum()
    ess = w.sum() ** 2 / (n * sq) if sq > 0 else torch.zeros(())
    tail = valid & ((r > 2.0) | (r < 0.5))
    return {"is_weight_mean": float(w.sum() / n),
            "is_weight_max": float(torch.where(valid, w, 0.0).max()) if valid.any() else 0.0,
            "is_clipfrac": float(_mean(changed.float(), valid)), "is_ess": float(ess),
            "is_ratio_var": float((r * r).sum() / n - (r.sum() / n) ** 2),
            "is_ratio_tail": float(_mean(tail.float(), valid))}


MISMATCH_QUANTILES = (0.01, 0.5, 0.99)


def mismatch_metrics(old_logp, rollout_logp, mask) -> dict:
    """The train–inference mismatch of one step, logged every step with or without TIS/MIS, from
    ρ_t = π_old(y_t)/π_rollout(y_t) over the valid tokens: its mean, max and quantiles; its effective
    sample size share (Σρ)²/(N·Σρ²) (1 = trainer and engine agree everywhere); and the sequence-level
    log-ratio Σ_t log ρ_t (mean, and mean abs over sequences with a valid token). old_logp must be the
    trainer's π_old, not a copy of the engine's (nanorl/update.py old_policy_view). No valid token
    (a rank of zero-weight pads, or every row skipped): the values of agreement, ρ ≡ 1, so that every
    rank logs the same keys (distributed.reduce_metrics all-reduces them by position)."""
    _check(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    valid = mask > 0                                                                 # [B, T]
    if not valid.any():
        return {"mismatch/ratio_mean": 1.0, "mismatch/ratio_max": 1.0, "mismatch/ratio_ess": 1.0,
                "mismatch/seq_log_ratio_mean": 0.0, "mismatch/seq_log_ratio_abs_mean": 0.0,
                **{f"mismatch/ratio_p{round(100 * p):02d}": 1.0 for p in MISMATCH_QUANTILES}}
    log_rho = (_clean(old_logp, valid) - _clean(rollout_logp, valid)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(log_rho)[valid]                                                  # [N] valid tokens
    seq = log_rho.sum(-1)[valid.any(-1)]                                             # [S] Σ_t log ρ_t
    q = torch.quantile(rho, torch.tensor(MISMATCH_QUANTILES, device=rho.device)).tolist()
    m = {"mismatch/ratio_mean": float(rho.mean()), "mismatch/ratio_max": float(rho.max()),
         "mismatch/ratio_ess": float(rho.sum() ** 2 / (rho.numel() * (rho * rho).sum())),
         "mismatch/seq_log_ratio_mean": float(seq.mean()),
         "mismatch/seq_log_ratio_abs_mean": float(seq.abs().mean())}
    m.update({f"mismatch/ratio_p{round(100 * p):02d}": v for p, v in zip(MISMATCH_QUANTILES, q)})
    return m


def opsm_mask(logp, behaviour_logp, adv, mask, delta):
    """OPSM keep-mask [B, T] float: 0 on tokens with A_t < 0 in a sequence whose
    mean_t(behaviour_logp − logp) > δ, else 1. Returns (keep, masked [B, T] bool)."""
    _check(mask, logp=logp, behaviour_logp=behaviour_logp, adv=adv)
    if not (delta >= 0 and math.isfinite(delta)):
        raise ValueError(f"OPSM delta must be finite and >= 0, got {delta}")
    valid = mask > 0
    gap = _clean(behaviour_logp, valid) - _clean(logp, valid)                       # [B, T]
    seq_kl = gap.sum(-1) / valid.sum(-1).clamp(min=1)                               # [B]
    masked = (_clean(adv, valid) < 0) & (seq_kl > delta)[:, None] & valid           # [B, T]
    return (~masked).float(), masked
