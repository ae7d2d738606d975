"""Advantage estimation, link 4 of the chain: how much credit each response token gets for the reward.

The policy gradient is E[Σ_t ∇log π(a_t|s_t)·Ψ_t]; with Ψ_t = G_t − b(s_t), the return minus a baseline
that does not depend on a_t, it stays unbiased and its variance shrinks: Ψ_t is the *advantage*. Each
estimator answers the credit-assignment question its own way: a critic (gae), the group (grpo,
dr_grpo, rloo, opo, gpg, grpo_passk), a greedy response (remax), the batch (reinforce_pp), a
variance-optimal per-token baseline (otb), each reward component (gdpo), a teacher's log-probs of the
student's own tokens (opd: on-policy distillation). Their papers, and every
place verl and slime differ with the choice made here: docs/from-slime-verl.md.
Start at `grpo`, then `gae`. Each estimator is a keyword-only function registered with
@register_advantage, which declares what it reads by its parameter names (nanorl/plan.py).
Key choices: float32, zero outside the mask; recursions skip masked holes; a group of one gets
advantage 0; NaN/inf on a valid token raises; an input an estimator cannot use raises.
Run: python -m nanorl.advantage (a demo). Test: python -m pytest tests/test_advantage.py -q
"""

import inspect

import torch

# ----------------------------------------------------------------------------- the registry
# name -> estimator. Built-ins and plug-ins (--advantage file.py:fn, nanorl/plugins.py) register alike.
# An estimator declares what it reads by its keyword parameters: `values` needs a critic,
# `old_logprobs` the π_old recompute, `sum_sq_probs` Σπ² from that pass, `baselines` a greedy
# response per prompt, `rollout_is_weights` TIS/MIS weights, `teacher_logprobs` a teacher's scoring of
# the sampled tokens (--teacher; nanorl/plan.py turns them into the step).
ADVANTAGE_ESTIMATORS: dict = {}


def register_advantage(name: str, raw_scores: bool = False):
    """Decorator: add an estimator to ADVANTAGE_ESTIMATORS under `name` (a name is registered once).
    raw_scores: it reads the raw scores (0/1 pass/fail, reward components), so a KL penalty cannot be
    folded into its rewards (--kl-in-reward is refused; put the KL in the loss)."""
    def add(fn):
        if ADVANTAGE_ESTIMATORS.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        fn.raw_scores = raw_scores
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return add


# ----------------------------------------------------------------------------- masked helpers


def masked_sum(x, mask, dim=None):
    """Sum of x where mask > 0 (NaN/inf elsewhere is ignored). x, mask: same shape."""
    x = torch.where(mask > 0, x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x, mask, dim=None):
    """Mean over mask > 0; 0 where the mask is empty (never NaN)."""
    n = (mask > 0).to(torch.float32)
    n = n.sum() if dim is None else n.sum(dim)
    return masked_sum(x, mask, dim) / n.clamp_min(1.0)


def masked_var(x, mask, unbiased=True):
    """Variance over all mask > 0 entries (unbiased: divides by n−1); 0 when fewer than 2 entries."""
    n = (mask > 0).sum().to(torch.float32)
    dev = x - masked_mean(x, mask)
    return masked_sum(dev * dev, mask) / ((n - 1.0) if unbiased else n).clamp_min(1.0) * (n > 1)


def masked_whiten(x, mask, eps=1e-8, shift_mean=True):
    """(x − mean) / sqrt(var + eps) over the masked entries of the whole tensor; zero outside.

    shift_mean=False adds the mean back: unit variance, sign and offset kept (verl's and slime's flag)."""
    x = torch.where(mask > 0, x, torch.zeros_like(x))
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps) + (0.0 if shift_mean else mean)
    return torch.where(mask > 0, out, torch.zeros_like(out))


# ----------------------------------------------------------------------------- input checks


def _check_tokens(name, x, m):
    """Validate a per-token tensor [B, T]; return it float32 with masked positions zeroed."""
    if x.shape != m.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(m.shape)} like mask")
    x = torch.where(m, x.detach().to(torch.float32), 0.0)          # advantages carry no graph
    if not torch.isfinite(x.sum()):                    # one reduction: NaN/inf propagate to the sum
        raise ValueError(f"{name} has NaN/inf on valid (mask=1) positions")
    return x


def _check_rows(name, x, B):
    """Validate a per-sample tensor [B] → float32."""
    if x.shape != (B,):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected ({B},)")
    x = x.detach().to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contain NaN/inf")
    return x


def _check(mask, scores=None, index=None, who=None, need_scores=True, token_rewards=None):
    """mask [B, T] → bool; scores [B] → float32; index [B] → group ids 0..G−1 (and G).

    token_rewards [B, T] instead of scores gives the score Σ_t token_rewards (verl's convention for
    outcome estimators: a KL penalty in the reward lowers the score). `who` names a group estimator:
    then index (and, if need_scores, a score) must be given."""
    if mask is None or mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got {None if mask is None else tuple(mask.shape)}")
    m = mask > 0
    B = m.shape[0]
    if token_rewards is not None:
        if scores is not None:
            raise ValueError(f"{who}: give scores [B] or token_rewards [B, T], not both")
        scores = _check_tokens("token_rewards", token_rewards, m).sum(1)                 # [B]
    elif scores is not None:
        scores = _check_rows("scores", scores, B)
    if who is not None and (index is None or (need_scores and scores is None)):
        raise ValueError(f"{who} needs index [B] (group id per sample)"
                         + (" and scores [B] (or token_rewards [B, T])" if need_scores else ""))
    gid, G = None, 0
    if index is not None:
        if index.shape != (B,) or index.is_floating_point():
            raise ValueError(f"index must be an integer tensor of shape ({B},), got "
                             f"{index.dtype} {tuple(index.shape)}")
        uniq, gid = torch.unique(index, return_inverse=True)
        G = uniq.numel()
    return m, scores, gid, G


def _group_stats(x, gid, G):
    """Per-sample group count [B], mean and unbiased std of x [B] or [B, C] (std 0 for groups of one)."""
    z = torch.zeros((G,) + x.shape[1:], device=x.device)
    cnt = torch.zeros(G, device=x.device).index_add_(0, gid, torch.ones_like(gid, dtype=torch.float32))
    c = cnt.view((G,) + (1,) * (x.dim() - 1))                                   # [G] or [G, 1]
    mean = z.index_add(0, gid, x) / c
    dev = x - mean[gid]
    std = (z.index_add(0, gid, dev * dev) / (c - 1).clamp_min(1)).sqrt() * (c > 1)
    return cnt[gid], mean[gid], std[gid]


def _broadcast(a, m):
    """Per-sample value a [B] on every valid token → [B, T]."""
    return torch.where(m, a[:, None].expand(m.shape), 0.0)


def _outcome_token_rewards(token_rewards, scores, m):
    """token_rewards [B, T] if given, else the score placed on the last valid token (never both)."""
    if token_rewards is not None:
        if scores is not None:
            raise ValueError("give scores [B] or token_rewards [B, T], not both")
        return _check_tokens("token_rewards", token_rewards, m)
    if scores is None:
        raise ValueError("need scores or token_rewards")
    pos = torch.arange(m.shape[1], device=m.device)
    last = torch.where(m, pos, -1).amax(1, keepdim=True)                        # [B, 1], −1 if empty
    return torch.where(pos == last, scores[:, None], 0.0)                       # [B, T]


# ----------------------------------------------------------------------------- discounted scans
# Holes in the mask are skipped by moving the valid tokens of each row to the front (order kept),
# scanning a contiguous sequence, and moving the result back. Right-padded rows (1…1 0…0, the common
# case) are already in that form: then dest is None and nothing moves.


def _compact_dest(m):
    """Destination column of each token so that valid tokens come first, in order. → [B, T] | None."""
    if not (m[:, 1:] & ~m[:, :-1]).any():                                      # no 0→1 step
        return None
    c = m.to(torch.int32).cumsum(1, dtype=torch.int32)                         # [B, T] valid so far
    pos = torch.arange(1, m.shape[1] + 1, device=m.device, dtype=torch.int32)  # masked so far: pos − c
    return torch.where(m, c - 1, c[:, -1:] + pos - c - 1).long()


def _compact(x, dest):
    return x if dest is None else torch.zeros_like(x).scatter_(1, dest, x)


def _uncompact(y, dest, m):
    return torch.where(m, y if dest is None else y.gather(1, dest), 0.0)


def _powers(d, expo):
    """d^expo where expo ≥ 0, else 0; values below 1e-30 flushed to 0 (no slow denormals).

    Only non-negative exponents are ever used: never d^(−k), which overflows for small d and long
    chunks (the factorisation d^(j−i) = d^j / d^i is the classic trap); d = 0 gives 0^0 = 1.
    """
    p = torch.pow(d, expo.clamp_min(0).to(torch.float32))
    return torch.where((expo >= 0) & (p >= 1e-30), p, 0.0)


def _suffix_scan(x, discount, chunk_size=128):
    """y_t = x_t + d·y_{t+1} (y_T = 0) for x [B, T], as chunked matrix products.

    Within a chunk of C tokens y = x @ Kᵀ with K[i, j] = d^(j−i) for j ≥ i. Between chunks one carried
    state, the full y at the first token of the next chunk: y[chunk c] += d^(C−i) · carry_c. The carries
    obey the same recursion over chunk starts with discount d^C, so they are one more (small) matrix
    product with K2[c, c'] = d^(C·(c'−c−1)) for c' > c instead of a Python loop over chunks (which, at
    ~T/C kernel launches, cost more than all the matmuls).
    """
    B, T = x.shape
    if T == 0:
        return x.clone()
    C = max(1, min(int(chunk_size), T))
    n = -(-T // C)
    xs = torch.nn.functional.pad(x, (0, n * C - T)).view(B, n, C)              # [B, n, C]
    d = torch.tensor(float(discount), dtype=torch.float32, device=x.device)
    ar, ac = torch.arange(C, device=x.device), torch.arange(n, device=x.device)
    K = _powers(d, ar[None, :] - ar[:, None])                                   # [C, C] d^(j−i)
    y = xs @ K.T                                                                # [B, n, C] in-chunk
    K2 = _powers(d, C * (ac[None, :] - ac[:, None] - 1))                        # [n, n]
    carry = y[:, :, 0] @ K2.T                                                   # [B, n]
    y = y + _powers(d, C - ar) * carry[:, :, None]                              # + d^(C−i)·carry
    return y.reshape(B, n * C)[:, :T]


# ----------------------------------------------------------------------------- critic: GAE


def _gae_inputs(who, mask, values, token_rewards, scores):
    m, scores, _, _ = _check(mask, scores)
    if values is None:
        raise ValueError(f"{who} needs values [B, T] from a critic")
    return m, _check_tokens("values", values, m), _outcome_token_rewards(token_rewards, scores, m)


@register_advantage("gae")
def gae(*, mask, values, token_rewards=None, scores=None, gamma=1.0, lam=1.0, whiten=False):
    """GAE as the plain reverse loop (the reference). values, token_rewards, mask: [B, T].

    Masked positions are skipped: `last` (the running advantage) and `next_v` (the next valid value)
    are carried through them unchanged; after the last valid token V_next = 0. whiten: the advantages
    (not the returns, the critic's targets) whitened over the batch's valid tokens, as verl and
    OpenRLHF do for PPO; the trainer passes --whiten-advantages (on by default).
    """
    m, v, r = _gae_inputs("gae", mask, values, token_rewards, scores)
    B, T = m.shape
    last, next_v = torch.zeros(B, device=m.device), torch.zeros(B, device=m.device)
    adv = torch.zeros(B, T, device=m.device)
    for t in range(T - 1, -1, -1):
        delta = r[:, t] + gamma * next_v - v[:, t]                              # [B]
        last = torch.where(m[:, t], delta + gamma * lam * last, last)
        next_v = torch.where(m[:, t], v[:, t], next_v)
        adv[:, t] = last
    adv = torch.where(m, adv, 0.0)
    return (masked_whiten(adv, mask) if whiten else adv), torch.where(m, adv + v, 0.0)


@register_advantage("gae_chunked")
def gae_chunked(*, mask, values, token_rewards=None, scores=None, gamma=1.0, lam=1.0,
                chunk_size=128, whiten=False):
    """GAE as a chunked matrix scan of δ with discount γλ; equals `gae` to fp32 rounding, far faster."""
    m, v, r = _gae_inputs("gae_chunked", mask, values, token_rewards, scores)
    dest = _compact_dest(m)
    rc, vc = _compact(r, dest), _compact(v, dest)                               # [B, T] valid first
    v_next = torch.nn.functional.pad(vc[:, 1:], (0, 1))                         # 0 after the last
    delta = rc + gamma * v_next - vc                                            # 0 on the padding
    adv = _uncompact(_suffix_scan(delta, gamma * lam, chunk_size), dest, m)
    return (masked_whiten(adv, mask) if whiten else adv), torch.where(m, adv + v, 0.0)


# ----------------------------------------------------------------------------- group baselines


@register_advantage("grpo")
def grpo(*, mask, index, scores=None, token_rewards=None, norm_by_std=True, eps=1e-6):
    """A_i = (r_i − mean_g)/(std_g + ε) (or r_i − mean_g if not norm_by_std) on every valid token."""
    m, scores, gid, G = _check(mask, scores, index, who="grpo", token_rewards=token_rewards)
    _, mean, std = _group_stats(scores, gid, G)
    a = scores - mean
    if norm_by_std:
        a = a / (std + eps)
    return _broadcast(a, m), _broadcast(scores, m)


@register_advantage("dr_grpo")
def dr_grpo(*, mask, index, scores=None, token_rewards=None):
    """GRPO without the std division (Dr.GRPO)."""
    return grpo(mask=mask, index=index, scores=scores, token_rewards=token_rewards, norm_by_std=False)


@register_advantage("rloo")
def rloo(*, mask, index, scores=None, token_rewards=None):
    """A_i = r_i − mean of the other samples of its group = n/(n−1)·(r_i − mean_g); 0 if n = 1."""
    m, scores, gid, G = _check(mask, scores, index, who="rloo", token_rewards=token_rewards)
    cnt, mean, _ = _group_stats(scores, gid, G)
    a = (scores - mean) * cnt / (cnt - 1).clamp_min(1)
    return _broadcast(a, m), _broadcast(scores, m)


@register_advantage("remax")
def remax(*, mask, baselines, scores=None, token_rewards=None):
    """A_t = G_t − b_i: G_t the reward-to-go (undiscounted, as verl), b_i [B] the greedy response's reward."""
    m, scores, _, _ = _check(mask, scores)
    b = _check_rows("baselines", baselines, m.shape[0])
    r = _outcome_token_rewards(token_rewards, scores, m)
    dest = _compact_dest(m)
    ret = _uncompact(_suffix_scan(_compact(r, dest), 1.0), dest, m)                   # [B, T] G_t
    return torch.where(m, ret - b[:, None], 0.0), ret


@register_advantage("opo")
def opo(*, mask, index, scores=None, token_rewards=None):
    """A_i = r_i − Σ_j |o_j| r_j / Σ_j |o_j| with |o_j| the number of valid tokens of sample j."""
    m, scores, gid, G = _check(mask, scores, index, who="opo", token_rewards=token_rewards)
    length = m.sum(1).to(torch.float32)                                         # [B]
    cnt, mean, _ = _group_stats(torch.stack([length * scores, length], 1), gid, G)  # [B, 2]
    base = torch.where(mean[:, 1] > 0, mean[:, 0] / mean[:, 1].clamp_min(1e-12), scores)
    a = torch.where(cnt > 1, scores - base, 0.0)
    return _broadcast(a, m), _broadcast(scores, m)


@register_advantage("gpg")
def gpg(*, mask, index, scores=None, token_rewards=None, eps=1e-6):
    """A_i = α(r_i − mean_g), α = B/(B − M), M = samples in groups with equal rewards (or of one)."""
    m, scores, gid, G = _check(mask, scores, index, who="gpg", token_rewards=token_rewards)
    _, mean, std = _group_stats(scores, gid, G)
    B, M = scores.numel(), int((std <= eps).sum())                              # all-equal groups
    alpha = B / (B - M) if B > M else 1.0
    return _broadcast(alpha * (scores - mean), m), _broadcast(scores, m)


def _comb_ratio(a, b, k):
    """C(a, k) / C(b, k) for 0 ≤ a ≤ b (0 when a < k), via lgamma in float64. a, b: [G]; k: int."""
    a, b = a.double(), b.double()
    lr = (torch.lgamma(a + 1) - torch.lgamma((a - k).clamp_min(0) + 1)
          - torch.lgamma(b + 1) + torch.lgamma(b - k + 1))
    return torch.where(a >= k, lr.exp(), 0.0)


@register_advantage("grpo_passk", raw_scores=True)
def grpo_passk(*, mask, index, scores=None, token_rewards=None, pass_k=1, norm_by_std=True, eps=1e-6):
    """Pass@k training advantage (closed form, binary 0/1 scores). Needs pass_k ≤ every group size."""
    m, scores, gid, G = _check(mask, scores, index, who="grpo_passk", token_rewards=token_rewards)
    if not ((scores == 0) | (scores == 1)).all():
        raise ValueError("grpo_passk needs binary 0/1 scores (pass/fail)")
    k = int(pass_k)
    zeros = torch.zeros(G, dtype=torch.float64, device=m.device)
    n = zeros.index_add(0, gid, torch.ones_like(scores).double())              # [G] group size
    n_neg = zeros.index_add(0, gid, (1 - scores).double())                      # [G] failures
    if k < 1 or k > n.min():
        raise ValueError(f"pass_k={k} must be in [1, smallest group size={int(n.min())}]")
    r_bar = 1 - _comb_ratio(n_neg, n, k)                                        # [G] mean pass@k
    a_pos = 1 - r_bar                                                           # [G]
    a_neg = 1 - r_bar - _comb_ratio((n_neg - 1).clamp_min(0), n - 1, k - 1)     # [G]
    a = torch.where(scores == 1, a_pos[gid], a_neg[gid])                        # [B]
    if norm_by_std:
        a = a / ((r_bar * (1 - r_bar)).clamp_min(0).sqrt()[gid] + eps)
    return _broadcast(a.to(torch.float32), m), _broadcast(scores, m)


@register_advantage("grpo_passk_max")
def grpo_passk_max(*, mask, index, scores=None, token_rewards=None, norm_by_std=True, eps=1e-6):
    """verl's grpo_passk: the group's unique best sample gets r_max − r_second (÷ (std_g + ε)), all
    others 0. A tie at the top gives everyone 0 (verl's topk picks one tied sample, whose r_max −
    r_second is 0 too). Any real-valued scores; a group of one gets 0 (verl raises)."""
    m, s, gid, G = _check(mask, scores, index, who="grpo_passk_max", token_rewards=token_rewards)
    cnt, _, std = _group_stats(s, gid, G)
    ninf = torch.full((G,), -torch.inf, device=m.device)
    top = ninf.scatter_reduce(0, gid, s, "amax")[gid]                           # [B] group max
    at_top = s == top
    n_top = torch.zeros(G, device=m.device).index_add_(0, gid, at_top.float())[gid]
    second = ninf.scatter_reduce(0, gid, torch.where(at_top, -torch.inf, s), "amax")[gid]
    gap = torch.where(at_top & (n_top == 1) & (cnt > 1), top - second, 0.0)     # [B] (inf unselected)
    a = gap / (std + eps) if norm_by_std else gap
    return _broadcast(a, m), _broadcast(s, m)


@register_advantage("gdpo", raw_scores=True)
def gdpo(*, mask, index, components=None, scores=None, component_weights=None, norm_by_std=True,
         eps=1e-6, whiten=True):
    """Σ_c w_c · group-normalised component c, then token-weighted batch whitening. components: [B, C].

    components None → scores is the single component (GDPO = GRPO + batch whitening).
    component_weights [C] (verl's gdpo_reward_weights); None = all 1.
    """
    m, scores, gid, G = _check(mask, scores, index, who="gdpo", need_scores=False)
    if components is None and scores is None:
        raise ValueError("gdpo needs components [B, C] or scores [B]")
    comps = scores[:, None] if components is None else components.detach().to(torch.float32)
    if comps.dim() != 2 or comps.shape[0] != m.shape[0]:
        raise ValueError(f"components must be [B, C] with B={m.shape[0]}, got {tuple(comps.shape)}")
    if not torch.isfinite(comps).all():
        raise ValueError("components contain NaN/inf")
    w = torch.ones(comps.shape[1]) if component_weights is None else torch.as_tensor(component_weights)
    if w.shape != (comps.shape[1],):
        raise ValueError(f"component_weights must be [C={comps.shape[1]}], got {tuple(w.shape)}")
    _, mean, std = _group_stats(comps, gid, G)                                  # [B, C]
    a = comps - mean
    a = (a / (std + eps) if norm_by_std else a) * w.to(a)                       # [B, C]
    adv = _broadcast(a.sum(1), m)
    if whiten:
        adv = masked_whiten(adv, m)
    ret = comps.sum(1) if scores is None else scores
    return adv, _broadcast(ret, m)


# ----------------------------------------------------------------------------- batch-normalised


@register_advantage("reinforce_pp")
def reinforce_pp(*, mask, token_rewards=None, scores=None, gamma=1.0, chunk_size=128, whiten=True):
    """G_t = discounted return of token_rewards (KL penalty inside), whitened over the batch."""
    m, scores, _, _ = _check(mask, scores)
    r = _outcome_token_rewards(token_rewards, scores, m)
    dest = _compact_dest(m)
    returns = _uncompact(_suffix_scan(_compact(r, dest), gamma, chunk_size), dest, m)   # [B, T] G_t
    return (masked_whiten(returns, m) if whiten else returns), returns


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(*, scores, mask, index, kl_penalty=None, whiten=True):
    """A_t = r_i − mean_g − kl_penalty_t, whitened over all valid tokens of the batch (unless whiten=False).

    kl_penalty [B, T] = β·KL_t per token (slime's form: the KL stays per token, it is not summed into
    the score); None = verl's form (the KL, if any, is a loss term)."""
    m, scores, gid, G = _check(mask, scores, index, who="reinforce_pp_baseline")
    _, mean, _ = _group_stats(scores, gid, G)
    adv = _broadcast(scores - mean, m)
    if kl_penalty is not None:
        adv = adv - _check_tokens("kl_penalty", kl_penalty, m)
    return (masked_whiten(adv, m) if whiten else adv), _broadcast(scores, m)


# ----------------------------------------------------------------------------- token baseline


@register_advantage("otb")
def otb(*, mask, index, token_rewards=None, scores=None, old_logprobs=None, sum_sq_probs=None,
        rollout_is_weights=None, gamma=1.0, eps=1e-6, chunk_size=128):
    """Optimal token baseline. old_logprobs, sum_sq_probs, rollout_is_weights, token_rewards, mask: [B, T].

    Timestep t is the t-th *valid* token of each response (holes skipped); a timestep with one live
    sample in its group gets advantage 0; if no live path has weight yet, the baseline is the mean.
    """
    m, scores, gid, G = _check(mask, scores, index, who="otb", need_scores=False)
    r = _outcome_token_rewards(token_rewards, scores, m)
    if old_logprobs is None:
        if sum_sq_probs is not None:
            raise ValueError("otb: sum_sq_probs needs old_logprobs (w = 1 − 2π + Σπ²)")
        w = torch.ones(m.shape, device=m.device)                                # W_t = t
    else:
        pi = _check_tokens("old_logprobs", old_logprobs, m).exp()
        ssq = pi * pi if sum_sq_probs is None else _check_tokens("sum_sq_probs", sum_sq_probs, m)
        w = (1 - 2 * pi + ssq).clamp_min(0)                                     # ||∇_z log π||²
    if rollout_is_weights is not None:  # verl: W scaled by ρ̄², MSE-optimal under truncated IS
        w = w * _check_tokens("rollout_is_weights", rollout_is_weights, m).square()
    dest = _compact_dest(m)
    mc = _compact(m.to(torch.float32), dest)                                    # [B, T] 1…1 0…0
    ret = _suffix_scan(_compact(r, dest), gamma, chunk_size)                    # [B, T] G_t
    W = _compact(torch.where(m, w, 0.0), dest).cumsum(1) * mc                   # [B, T] W_t
    T = m.shape[1]
    zeros = torch.zeros(G, T, device=m.device)
    num, den = zeros.index_add(0, gid, ret * W), zeros.index_add(0, gid, W)      # [G, T]
    cnt = zeros.index_add(0, gid, mc)                                           # [G, T] live samples
    mean = zeros.index_add(0, gid, ret * mc) / cnt.clamp_min(1)
    base = torch.where(den > eps, num / den.clamp_min(eps), mean)               # [G, T]
    adv = torch.where(cnt[gid] > 1, ret - base[gid], 0.0)
    return _uncompact(adv, dest, m), _uncompact(ret, dest, m)


# ----------------------------------------------------------------------------- on-policy distillation


def reverse_kl_advantage(old_logprobs, teacher_logprobs, mask):
    """log π_teacher(a_t|s_t) − log π_old(a_t|s_t) on the sampled tokens: −k1 of the reverse KL
    KL(π_old ‖ π_teacher), one sample of it per token. [B, T] each; float32, 0 outside the mask.

    The student's own samples make this the per-token reward of on-policy distillation (Agarwal et al.
    2024, GKD; Qwen3's and Thinking Machines' recipes): maximising Σ_t of it over the student's
    trajectories minimises the sequence-level reverse KL, which is mode-seeking — the student is pushed
    off the tokens the teacher finds unlikely rather than asked to cover all of the teacher's mass. The
    student term is π_old, the policy that sampled (detached, like every advantage: slime's
    apply_opd_kl_to_advantages reads its old-policy log-probs the same way); with --async-steps the
    trainer's weights are newer than the sampler's, so the config asks for --old-logprobs rollout."""
    m = mask > 0
    old = _check_tokens("old_logprobs", old_logprobs, m)
    teacher = _check_tokens("teacher_logprobs", teacher_logprobs, m)
    return torch.where(m, teacher - old, 0.0)


@register_advantage("opd")
def opd(*, mask, old_logprobs, teacher_logprobs):
    """On-policy distillation: A_t = log π_teacher − log π_old per token (`reverse_kl_advantage`),
    each token its own reward and its own return (no discounting over later tokens, as Thinking
    Machines' recipe: discount 0). It reads no task reward: --distill-coef adds the same signal to a
    reward estimator's advantages instead (nanorl/stages.py advantages)."""
    adv = reverse_kl_advantage(old_logprobs, teacher_logprobs, mask)
    return adv, adv.clone()


# ----------------------------------------------------------------------------- registry

# What the trainer can feed an estimator (train.py advantage_inputs), by name; a user estimator
# (--advantage file.py:fn, nanorl/plugins.py) may ask for any of these, and for `metadata`: the
# batch's per-sample Sample.metadata dicts, one per row (nanorl/trajectory.py collate).
PLUGIN_INPUTS = frozenset({"mask", "index", "scores", "token_rewards", "values", "components", "old_logprobs",
                           "sum_sq_probs", "rollout_is_weights", "gamma", "lam", "pass_k", "kl_penalty",
                           "whiten", "component_weights", "baselines", "metadata", "teacher_logprobs"})


def estimator_inputs(name):
    """The keyword inputs estimator `name` (a registry name, or a user function) can use."""
    fn = name if callable(name) else ADVANTAGE_ESTIMATORS[name]
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):  # fn(**inputs): everything there is
        return PLUGIN_INPUTS
    return frozenset(params)


def compute_advantages(name, **inputs):
    """Run estimator `name` on keyword inputs → (advantages [B, T], returns [B, T]).

    `name` is a key of ADVANTAGE_ESTIMATORS or a user function with the same keyword interface (its
    output is checked: two [B, T] tensors like mask, finite on valid tokens, zeroed elsewhere).
    An input set to None counts as not given; any other input the estimator cannot use raises."""
    if not callable(name) and name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}")
    label = getattr(name, "__name__", name)
    given = {k: v for k, v in inputs.items() if v is not None}
    unusable = sorted(set(given) - estimator_inputs(name))
    if unusable:
        raise ValueError(f"advantage estimator {label!r} cannot use {', '.join(unusable)}; it takes "
                         f"{', '.join(sorted(estimator_inputs(name)))}")
    if not callable(name):
        return ADVANTAGE_ESTIMATORS[name](**given)
    out = name(**given)
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)):
        raise TypeError(f"advantage estimator {label!r} must return (advantages [B, T], returns [B, T]), "
                        f"got {type(out).__name__}")
    if "mask" not in given:
        raise ValueError(f"advantage estimator {label!r} must take `mask` [B, T] "
                         "(its output is checked against it)")
    m = given["mask"] > 0                                              # [B, T]
    return tuple(_check_tokens(f"{label} {what}", x, m) for what, x in zip(("advantages", "returns"), out))


if __name__ == "__main__":
    import argparse
    about = "Print a few estimators' advantages on a toy batch of 2 groups."
    argparse.ArgumentParser(prog="python -m nanorl.advantage", description=about).parse_args()
    kw = dict(scores=torch.tensor([1.0, 0, 0, 1, 0.5, 0.5]), index=torch.tensor([0, 0, 0, 0, 1, 1]),
              mask=torch.ones(6, 3))
    for name in ["grpo", "dr_grpo", "rloo", "gpg", "opo", "grpo_passk_max"]:  # GAE timing: bench.py
        print(f"{name:14s}", compute_advantages(name, **kw)[0][:, 0])
