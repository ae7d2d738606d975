"""Policy-gradient losses, off-policy corrections, the value loss, and how a [B, T] loss becomes a scalar.

The problem. The advantage A_t says how much better token y_t was than expected; the loss turns
it into a gradient on log π_θ(y_t). Samples were drawn by an older policy (a few optimizer steps
ago, and by a different engine: vLLM in bf16, not the trainer), so every loss compares the
current policy with that one through the per-token ratio r_t = π_θ/π_old, computed as
exp(clamp(logp − old_logp, −20, 20)) (clamp before exp: no inf, ever).

Surrogates (each returns a per-token loss matrix [B, T] to minimise; registry POLICY_LOSSES):
- ppo   (Schulman 2017): max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)). Separate ε_low/ε_high is
        DAPO's clip-higher (Yu 2025: 0.2/0.28). Dual-clip (Ye 2020, arXiv 1912.09729): for A < 0
        the loss is also capped at −c·A (c > 1): a token whose probability rose c-fold despite a
        negative advantage would otherwise add an unbounded −A·r. verl turns it on (c = 3);
        slime leaves it off. We default LossConfig.dual_clip = 3.0: it never binds near
        on-policy (r ≈ 1) and is exactly the safety net stale or mismatched samples need; the
        primitive ppo_clip_loss keeps dual_clip=None (textbook PPO).
- gspo  (Zheng 2025, Qwen3): one ratio per sequence, s_i = exp(mean_t(logp − old_logp)), clipped
        like PPO (the paper's ε are ~3e-4/4e-4). GSPO-token form: log s_it = sg(log s_i) + logp_t
        − sg(logp_t); same value, gradient s_i·∇logp_t, so per-token advantages are allowed and
        with a per-sequence A it IS GSPO. Aggregate with seq-mean-token-mean to match the paper.
- cispo (MiniMax-M1 2025): −sg(clip(r, 1−ε_low, 1+ε_high))·A·logp. The weight is clipped and
        detached, so every token keeps a gradient (PPO drops clipped tokens entirely).
        MiniMax-M1 clips only above (use a large ε_low).
- gmpo  (Zhao 2025, Geometric-Mean PO): per sequence −A·exp(mean_t clip(log r_t)), the clip
        taken token-wise in LOG space with PPO's pessimism (A > 0 caps log r at +ε_high, A < 0
        at −ε_low; the paper uses ε = 0.4). The geometric mean is less sensitive to one outlier
        token than GRPO's arithmetic mean. The sequence loss sits on every valid token: use
        seq-mean-token-mean. The advantage is the sequence's mean advantage.
- dppo_tv / dppo_kl (Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv 2602.04879,
        formula as in the authors' verl code): −A·sg(min(r, C))·logp·M_t. The trust region
        is a divergence mask, not a ratio clip: with p = π_θ(y_t), q = π_old(y_t),
        TV: A > 0 keeps the token iff p − q ≤ δ_high; A ≤ 0 iff p − q ≥ −δ_low.
        KL (binary KL of Bernoulli(q) vs Bernoulli(p)): D = q·log(q/p) + (1−q)·log((1−q)/(1−p));
        A > 0 drops iff D > δ_high and p > q; A ≤ 0 drops iff D > δ_low and p < q.
        Authors' δ: TV 0.15, KL 0.05, C = 10. They anchor at the ROLLOUT policy: pass rollout
        log-probs as old_logp and leave TIS off (their "recompute" variant uses old_logp).
        For dppo, LossConfig.clip_low/clip_high are read as δ_low/δ_high.

Off-policy corrections for the train/inference mismatch (detached weights on the loss matrix):
- TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"): w = min(exp(old_logp − rollout_logp), C), per token or per sequence (product).
- ICEPOP (Ring-1T / "Small leak can sink a great ship", 2025): w = k if low ≤ k ≤ high else 0,
  k the same train/rollout ratio: outliers are discarded, not truncated.
- OPSM (DeepSeek-V3.2 2025): drop a sequence whose advantage is negative and whose sequence mean
  of (rollout_logp − logp) — a k1 estimate of KL(π_rollout ‖ π_θ) — exceeds δ.
Weights multiply the loss; denominators are NOT changed (DeepSeek's formula), which also keeps
the micro-batch invariance below.

Aggregation ([B, T] → scalar). token-mean: Σ l / N_tokens (DAPO). seq-mean-token-mean: mean over
sequences of each sequence's token mean (GRPO paper). seq-mean-token-sum: mean over sequences of
token sums. seq-mean-token-sum-norm: Σ l / (N_seqs · L) with a constant L (Dr. GRPO, Liu 2025;
verl divides by L only, we keep the seq-mean the name promises, so the scale does not grow with
batch size). N counts only sequences with at least one valid token. Gradient accumulation: a
micro-batch's own means are NOT the full batch's mean (TRL #3021). Pass num_tokens / num_seqs
of the whole optimizer step (all micro-batches, all ranks: `global_denominators`) and a constant
norm_len, and the micro-batch losses SUM to the full-batch loss exactly, for every mode.

Where it sits: rollout → reward → logprob recompute → advantage → [losses] → backward → step.
Self-contained: imports torch and the standard library only. Test: python -m pytest tests/test_losses.py -q
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

LOG_RATIO_CLAMP = 20.0
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


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
    stats = {"clip": valid & ~keep, "clip_high": valid & ~keep & (adv > 0), "clip_low": valid & ~keep & (adv <= 0)}
    return -adv * weight * logp * keep.float(), stats


def dppo_tv_loss(logp, old_logp, adv, mask, delta_low=0.15, delta_high=0.15, ratio_cap=10.0):
    """DPPO-Binary-TV: update a token only while |π_θ − π_old| of its probability stays within δ."""
    return _dppo(logp, old_logp, adv, mask, delta_low, delta_high, ratio_cap, "tv")


def dppo_kl_loss(logp, old_logp, adv, mask, delta_low=0.05, delta_high=0.05, ratio_cap=10.0):
    """DPPO-Binary-KL: update a token only while the binary KL of its probability stays within δ."""
    return _dppo(logp, old_logp, adv, mask, delta_low, delta_high, ratio_cap, "kl")


# ----------------------------------------------------------------------------- off-policy corrections
def tis_weights(old_logp, rollout_logp, mask, cap=2.0, level="token"):
    """TIS weight min(π_train/π_rollout, C), detached, [B, T]; level "sequence" uses the product of
    token ratios per sequence. Returns (weights, truncated indicator [B, T])."""
    _check(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    if level not in ("token", "sequence"):
        raise ValueError(f"TIS level must be 'token' or 'sequence', got {level!r}")
    valid = mask > 0
    log_w = _clean(old_logp.detach(), valid) - _clean(rollout_logp.detach(), valid)  # [B, T]
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)  # product of ratios, in log space
    w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return _clean(w.clamp(max=cap), valid), (w > cap) & valid


def icepop_weights(old_logp, rollout_logp, mask, low=0.5, high=5.0):
    """ICEPOP: the train/rollout ratio k where low ≤ k ≤ high, else 0. Returns (weights, zeroed)."""
    _check(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    valid = mask > 0
    log_k = _clean(old_logp.detach(), valid) - _clean(rollout_logp.detach(), valid)
    k = torch.exp(log_k.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]
    inside = (k >= low) & (k <= high)
    return torch.where(inside & valid, k, torch.zeros_like(k)), valid & ~inside


def opsm_mask(logp, rollout_logp, adv, mask, delta):
    """OPSM keep-mask [B, T]: 0 for a sequence with mean advantage < 0 and mean(rollout_logp − logp)
    > δ, else 1. Returns (keep [B, T] float, dropped [B] bool)."""
    _check(mask, logp=logp, rollout_logp=rollout_logp, adv=adv)
    valid = mask > 0
    seq_kl = _seq_mean(rollout_logp.detach().float() - logp.detach().float(), valid)  # [B]
    dropped = (_seq_mean(adv, valid) < 0) & (seq_kl > delta) & valid.any(-1)  # [B]
    return (~dropped).float().unsqueeze(-1).expand_as(valid), dropped


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
    l = _clean(loss_mat, valid)  # [B, T]
    n_tok = valid.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=l.device)
    n_seq = valid.any(-1).sum() if num_seqs is None else torch.as_tensor(num_seqs, device=l.device)
    n_tok, n_seq = n_tok.float().clamp(min=1), n_seq.float().clamp(min=1)
    if mode == "token-mean":
        return l.sum() / n_tok
    if mode == "seq-mean-token-sum":
        return l.sum() / n_seq
    if mode == "seq-mean-token-mean":
        return (l.sum(-1) / valid.sum(-1).clamp(min=1)).sum() / n_seq
    length = mask.shape[-1] if norm_len is None else norm_len
    return l.sum() / (n_seq * length)


# ----------------------------------------------------------------------------- assembly
@dataclass
class LossConfig:
    policy: str = "ppo"                # a key of POLICY_LOSSES
    clip_low: float = 0.2              # ε_low (ppo/gspo/cispo), log-space bound (gmpo), δ_low (dppo)
    clip_high: float = 0.2             # ε_high ...; DAPO clip-higher uses 0.28
    dual_clip: float | None = 3.0      # ppo only: c > 1 bounds the loss for A < 0 (None = off)
    ratio_cap: float = 10.0            # dppo: truncation C of the detached IS weight
    agg_mode: str = "token-mean"       # one of AGG_MODES
    norm_len: int | None = None        # L for seq-mean-token-sum-norm
    entropy_coef: float = 0.0          # loss −= entropy_coef · aggregated entropy
    kl_coef: float = 0.0               # loss += kl_coef · aggregated kl
    vf_coef: float = 0.0               # loss += vf_coef · aggregated value loss
    value_clip: float | None = 0.2
    tis_cap: float | None = None       # TIS truncation C (needs rollout_logp); None = off
    tis_level: str = "token"           # "token" | "sequence"
    icepop: tuple[float, float] | None = None  # (low, high) band; None = off
    opsm_delta: float | None = None    # OPSM threshold δ; None = off


def _by_name(fn: Callable, low: str, high: str, **extra: str) -> Callable:
    return lambda lp, old, adv, m, c: fn(lp, old, adv, m, **{low: c.clip_low, high: c.clip_high},
                                         **{k: getattr(c, v) for k, v in extra.items()})


POLICY_LOSSES: dict[str, Callable] = {  # name -> fn(logp, old_logp, adv, mask, cfg) -> (loss [B, T], stats)
    "ppo": _by_name(ppo_clip_loss, "clip_low", "clip_high", dual_clip="dual_clip"),
    "gspo": _by_name(gspo_loss, "clip_low", "clip_high"),
    "cispo": _by_name(cispo_loss, "clip_low", "clip_high"),
    "gmpo": _by_name(gmpo_loss, "clip_low", "clip_high"),
    "dppo_tv": _by_name(dppo_tv_loss, "delta_low", "delta_high", ratio_cap="ratio_cap"),
    "dppo_kl": _by_name(dppo_kl_loss, "delta_low", "delta_high", ratio_cap="ratio_cap"),
}


def total_loss(cfg: LossConfig, logp, old_logp, advantages, mask, *, entropy=None, kl=None,
               rollout_logp=None, values=None, old_values=None, returns=None,
               num_tokens=None, num_seqs=None):
    """loss = pg_loss − entropy_coef·entropy + kl_coef·kl (+ vf_coef·value loss), for ONE micro-batch.

    All tensors [B, T]: logp (grad) and old_logp of the sampled tokens, advantages, mask; entropy
    (grad) per token; kl per token (e.g. kl.kl_estimator(logp, ref_logp, "k3+", mask=mask));
    rollout_logp, the engine's logprobs (enables TIS/ICEPOP/OPSM and the mismatch metrics); values (grad),
    old_values, returns for the critic. Every term is aggregated with cfg.agg_mode and the same
    global denominators, so summing the returned losses over micro-batches equals the loss of
    the whole batch. Returns (loss, metrics): metrics are detached 0-d tensors; loss, pg_loss,
    kl_loss, vf_loss are this micro-batch's contributions (sum them over micro-batches); all
    others are masked token means over this micro-batch (weight them by metrics["num_tokens"]),
    except opsm_maskfrac (a fraction of sequences) and the *_max values.
    """
    if cfg.policy not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {cfg.policy!r}; choose one of {', '.join(POLICY_LOSSES)}")
    _check(mask, logp=logp, old_logp=old_logp, advantages=advantages, entropy=entropy, kl=kl,
           rollout_logp=rollout_logp, values=values, old_values=old_values, returns=returns)
    valid = mask > 0
    agg = lambda x: aggregate(x, mask, cfg.agg_mode, num_tokens, num_seqs, cfg.norm_len)  # noqa: E731
    zero = torch.zeros((), device=logp.device)

    pg_mat, stats = POLICY_LOSSES[cfg.policy](logp, old_logp, advantages, mask, cfg)  # [B, T]
    weight = torch.ones_like(pg_mat)  # off-policy corrections, detached, on the loss only
    m = {"tis_clipfrac": zero, "icepop_maskfrac": zero, "opsm_maskfrac": zero,
         "logprob_diff_abs": zero, "logprob_diff_abs_max": zero}
    if rollout_logp is not None:
        diff = (_clean(old_logp, valid) - _clean(rollout_logp, valid)).abs()
        m["logprob_diff_abs"], m["logprob_diff_abs_max"] = _mean(diff, valid), _max(diff, valid)
        if cfg.tis_cap is not None:
            w, hit = tis_weights(old_logp, rollout_logp, mask, cfg.tis_cap, cfg.tis_level)
            weight, m["tis_clipfrac"] = weight * w, _mean(hit.float(), valid)
        if cfg.icepop is not None:
            w, hit = icepop_weights(old_logp, rollout_logp, mask, *cfg.icepop)
            weight, m["icepop_maskfrac"] = weight * w, _mean(hit.float(), valid)
    if cfg.opsm_delta is not None:  # the behaviour policy: rollout if known, else old
        behaviour = rollout_logp if rollout_logp is not None else old_logp
        keep, dropped = opsm_mask(logp, behaviour, advantages, mask, cfg.opsm_delta)
        weight = weight * keep
        m["opsm_maskfrac"] = dropped.float().sum() / valid.any(-1).sum().clamp(min=1)
    pg_loss = agg(pg_mat * weight)
    loss = pg_loss

    kl_loss = agg(kl) if kl is not None else zero
    ent = _mean(entropy, valid) if entropy is not None else zero
    if kl is not None and cfg.kl_coef:
        loss = loss + cfg.kl_coef * kl_loss
    if entropy is not None and cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * agg(entropy)
    vf_loss, vf_clip = zero, zero
    if values is not None:
        if old_values is None or returns is None:
            raise ValueError("total_loss: values given without old_values and returns")
        v_mat, v_stats = value_loss(values, old_values, returns, mask, cfg.value_clip)
        vf_loss, vf_clip = agg(v_mat), _mean(v_stats["clip"].float(), valid)
        loss = loss + cfg.vf_coef * vf_loss

    log_ratio, ratio = log_ratio_and_ratio(_clean(logp.detach(), valid), _clean(old_logp, valid))
    frac = lambda k: _mean(stats[k].float(), valid) if k in stats else zero  # noqa: E731
    m.update(loss=loss, pg_loss=pg_loss, kl_loss=kl_loss, vf_loss=vf_loss, vf_clipfrac=vf_clip, entropy=ent,
             pg_clipfrac=frac("clip"), pg_clipfrac_low=frac("clip_low"), pg_clipfrac_high=frac("clip_high"),
             dual_clipfrac=frac("dual_clip"), ppo_kl=_mean(-log_ratio, valid),
             ratio_mean=_mean(ratio, valid), ratio_max=_max(ratio, valid),
             num_tokens=valid.sum().float(), num_seqs=valid.any(-1).sum().float())
    return loss, {k: v.detach().float() for k, v in m.items()}
