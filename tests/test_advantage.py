"""Tests for nanorl/advantage.py: hand-computed values and invariants for every estimator.

Run: python -m pytest tests/test_advantage.py -q
"""
import itertools
import math

import pytest
import torch

from nanorl import advantage as adv
from nanorl.advantage import ADVANTAGE_ESTIMATORS, compute_advantages, estimator_inputs, masked_whiten


def close(actual, expected, atol=1e-5, rtol=1.3e-6):
    """allclose with a readable message (torch.testing.assert_close costs ~4 s on first use here)."""
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), (
        f"max |diff| {(actual - expected).abs().max():.3e}\n{actual}\n{expected}")


def ragged_mask(B, T, holes=False, empty_row=False, gen=None):
    """Right-padded rows of random length (some full, some length 1); optional holes and empty row."""
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    if holes and T > 2:
        for b in range(1, B, 2):                       # multi-turn style gaps inside the response
            lo = int(torch.randint(0, T - 1, (1,), generator=gen))
            mask[b, lo:lo + max(1, T // 5)] = 0
    if empty_row:
        mask[-1] = 0
    return mask


def full_inputs(B=6, T=5, mask=None):
    """One common set of keyword inputs, as the trainer passes them."""
    mask = ragged_mask(B, T) if mask is None else mask
    lp = -torch.rand(B, T) * 2
    return dict(scores=torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])[:B], mask=mask,
                index=torch.tensor([5, 5, 5, 9, 9, 9])[:B], token_rewards=None,
                values=torch.randn(B, T), components=torch.rand(B, 2),
                old_logprobs=lp, sum_sq_probs=lp.exp() ** 2 + 0.1, teacher_logprobs=lp * 0.5,
                gamma=1.0, lam=1.0,
                norm_by_std=True, eps=1e-6, pass_k=1, chunk_size=4, baselines=torch.rand(B))


def inputs_for(name, kw):
    """The inputs of `kw` that estimator `name` reads (scores or token_rewards, never both)."""
    out = {k: v for k, v in kw.items() if k in estimator_inputs(name) and v is not None}
    if "token_rewards" in out and "scores" in out:
        out.pop("token_rewards" if name == "grpo_passk" else "scores")  # grpo_passk needs 0/1 scores
    return out


# ----------------------------------------------------------------------------- GAE


def gae_float64(mask, values, rewards, gamma, lam):
    """The reverse GAE loop in float64, independent of nanorl, and beside it the same recursion over
    absolute values, S_t = Σ_{s≥t} (γλ)^(s−t)·(|r_s| + γ|V_next| + |V_s|): the size of the terms whose
    fp32 rounding any implementation pays (the advantages themselves are small where δ telescopes)."""
    m, v, r = mask.bool(), values.double(), rewards.double()
    B, T = m.shape
    last, size, next_v = (torch.zeros(B, dtype=torch.float64) for _ in range(3))
    a, s = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    for t in range(T - 1, -1, -1):
        delta = r[:, t] + gamma * next_v - v[:, t]                                 # [B]
        last = torch.where(m[:, t], delta + gamma * lam * last, last)
        size = torch.where(m[:, t], r[:, t].abs() + gamma * next_v.abs() + v[:, t].abs()
                           + gamma * lam * size, size)
        next_v = torch.where(m[:, t], v[:, t], next_v)
        a[:, t], s[:, t] = last, size
    return torch.where(m, a, 0.0), torch.where(m, s, 0.0)


def assert_fp32_rounding_of(actual, exact, size, n):
    """|actual − exact| ≤ u·(|exact| + 2·√n·S): the output's own rounding plus the accumulated rounding
    of n terms of total size S, at Higham's statistical rate √n·u (Accuracy and Stability of Numerical
    Algorithms, §2.8) with a margin of 2; the worst-case constant n·u is never approached. Measured on
    an Intel Xeon at 1 and 2 threads: at most 0.33 of this bound (T = 3), 0.08 at T = 1000, where the
    former fp32-vs-fp32 comparison at 1e-5 failed (1.7e-5: one thread's matmul order, 0.2 u·S)."""
    u = 2.0 ** -24
    bound = u * (exact.abs() + 2 * n.double().sqrt()[:, None] * size)           # [B, T]
    err = (actual.double() - exact).abs()
    assert (err <= bound).all(), f"max |err| / bound {(err / bound.clamp_min(1e-300)).max():.3g}"


@pytest.mark.parametrize("T", [1, 2, 3, 7, 64, 127, 129, 1000, 8192])
def test_chunked_gae_and_loop_equal_float64_gae_to_fp32_rounding(T):
    """Both fp32 GAEs (the loop and the chunked scan at every chunk size) against float64 truth: a
    chunking bug (a wrong power at a chunk edge, a carry lost) is an error of the size of one δ, far
    above the rounding bound. Red checks: the carry's power d^(C−i) made d^(C−i−1), and the carry
    dropped, each fail every T > chunk."""
    B = 3 if T == 8192 else 8
    combos = [(1.0, 1.0)] if T == 8192 else [(1.0, 1.0), (0.99, 0.95), (0.5, 0.3), (0.9, 0.0)]
    mask = ragged_mask(B, T, holes=True, empty_row=T > 1)
    rewards = 0.01 * torch.randn(B, T)                 # per-token −β·KL-like noise
    rewards[torch.arange(B), (mask.cumsum(1).argmax(1))] += torch.rand(B)  # outcome at the end
    values = torch.randn(B, T)
    n = mask.sum(1).clamp_min(1)                                                # [B] terms per row
    for gamma, lam in combos:
        exact, size = gae_float64(mask, values, rewards, gamma, lam)            # [B, T] each
        ret_exact = torch.where(mask.bool(), exact + values.double(), 0.0)
        kw = dict(mask=mask, values=values, token_rewards=rewards, gamma=gamma, lam=lam)
        runs = [adv.gae(**kw)] + [adv.gae_chunked(**kw, chunk_size=c)
                                  for c in ([1, 7, 128, 8192] if T < 8192 else [128])]
        for a, ret in runs:
            assert a.dtype == ret.dtype == torch.float32
            assert_fp32_rounding_of(a, exact, size, n)
            assert_fp32_rounding_of(ret, ret_exact, size + values.double().abs(), n)


@pytest.mark.parametrize("name", ["gae", "gae_chunked"])
def test_gae_lambda_one_is_reward_to_go_minus_value(name):
    mask = torch.tensor([[1.0, 1, 1, 0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])            # 5 on padding must be ignored
    values = torch.tensor([[0.5, 0.2, 0.1, float("nan")]])
    a, ret = compute_advantages(name, mask=mask, token_rewards=rewards, values=values)
    close(a, torch.tensor([[0.5, 0.8, 0.9, 0.0]]))
    close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    # random: A_t = Σ_{s≥t} r_s − V_t when γ = λ = 1
    mask = ragged_mask(4, 33)
    r, v = torch.randn(4, 33), torch.randn(4, 33)
    a, _ = compute_advantages(name, mask=mask, token_rewards=r, values=v)
    rtg = (r * mask).flip(1).cumsum(1).flip(1)
    close(a, (rtg - v) * mask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gae", "gae_chunked"])
def test_gae_discount_and_hole_by_hand(name):
    # γ = 0.5, λ = 1, V = 0: A = discounted return = [1 + 0.25·2, 0.5·2, 2]
    a, _ = compute_advantages(name, mask=torch.ones(1, 3), token_rewards=torch.tensor([[1.0, 0, 2]]),
                              values=torch.zeros(1, 3), gamma=0.5, lam=1.0)
    close(a, torch.tensor([[1.5, 1.0, 2.0]]))
    # hole at t=1 is skipped: δ_2 = 1 − 2 = −1; δ_0 = 0 + 0.9·V_2 − V_0 = 0.8; A_0 = 0.8 + 0.9·(−1)
    a, ret = compute_advantages(name, mask=torch.tensor([[1.0, 0, 1]]),
                                token_rewards=torch.tensor([[0.0, 7.0, 1.0]]),
                                values=torch.tensor([[1.0, 100.0, 2.0]]), gamma=0.9, lam=1.0)
    close(a, torch.tensor([[-0.1, 0.0, -1.0]]))
    close(ret, torch.tensor([[0.9, 0.0, 1.0]]))


def test_gae_builds_outcome_reward_from_scores():
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    a, _ = adv.gae_chunked(mask=mask, scores=torch.tensor([2.0, 3.0]), values=torch.zeros(2, 3))
    close(a, torch.tensor([[2.0, 2, 0], [3, 3, 3]]))


def test_small_discount_long_chunk_is_stable():
    # (γλ)^(j−i) underflows for γλ = 0.01 and a 1024 chunk: no inf/NaN/denormal, equals the loop
    mask, v, r = ragged_mask(2, 1024), torch.randn(2, 1024), torch.randn(2, 1024)
    kw = dict(mask=mask, values=v, token_rewards=r, gamma=0.1, lam=0.1)
    a, _ = adv.gae_chunked(**kw, chunk_size=1024)
    assert torch.isfinite(a).all()
    close(a, adv.gae(**kw)[0], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- group estimators


def grpo_loop(scores, index, norm_by_std=True, eps=1e-6):
    """Per-group Python loop reference (verl style, but group of one → 0)."""
    out = torch.zeros_like(scores)
    for g in index.unique():
        sel = index == g
        r = scores[sel]
        if r.numel() == 1:
            continue
        a = r - r.mean()
        out[sel] = a / (r.std() + eps) if norm_by_std else a
    return out


def test_grpo_zero_mean_unit_std_per_group_and_matches_loop():
    B = 48
    index = torch.randint(0, 9, (B,)) * 1000 + 7        # non-contiguous ids, varying group sizes
    scores = torch.randn(B)
    mask = ragged_mask(B, 6)
    a, ret = compute_advantages("grpo", scores=scores, mask=mask, index=index)
    close(a, grpo_loop(scores, index)[:, None] * mask)
    close(ret, scores[:, None] * mask)
    for g in index.unique():
        sel = index == g
        if sel.sum() > 1:
            s = a[sel, 0]
            assert abs(float(s.mean())) < 1e-5 and abs(float(s.std()) - 1) < 1e-4


def test_grpo_by_hand_and_dr_grpo_has_no_std():
    scores, index, mask = torch.tensor([1.0, 0, 0, 1]), torch.zeros(4, dtype=torch.long), torch.ones(4, 2)
    a, _ = compute_advantages("grpo", scores=scores, mask=mask, index=index)
    close(a[:, 0], torch.tensor([1, -1, -1, 1.0]) * 0.5 / (math.sqrt(1 / 3) + 1e-6))
    for dr in [compute_advantages("dr_grpo", scores=scores, mask=mask, index=index),
               compute_advantages("grpo", scores=scores, mask=mask, index=index, norm_by_std=False)]:
        close(dr[0], torch.tensor([0.5, -0.5, -0.5, 0.5])[:, None].expand(4, 2))
    with pytest.raises(ValueError, match="dr_grpo.*cannot use norm_by_std"):  # it used to be ignored
        compute_advantages("dr_grpo", scores=scores, mask=mask, index=index, norm_by_std=True)


def test_rloo_equals_leave_one_out_formula():
    B = 30
    index, scores = torch.randint(0, 5, (B,)), torch.randn(B)
    a, _ = compute_advantages("rloo", scores=scores, mask=torch.ones(B, 3), index=index)
    for i in range(B):
        others = (index == index[i]) & (torch.arange(B) != i)
        expect = scores[i] - scores[others].mean() if others.any() else torch.tensor(0.0)
        close(a[i], expect.expand(3), atol=1e-5, rtol=1e-5)


def test_opo_length_weighted_baseline():
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])   # lengths 2, 4, 1
    a, _ = compute_advantages("opo", scores=torch.tensor([1.0, 0, 1]), mask=mask,
                              index=torch.zeros(3, dtype=torch.long))
    b = (2 * 1 + 4 * 0 + 1 * 1) / 7
    close(a, torch.tensor([1 - b, -b, 1 - b])[:, None] * mask)


def test_gpg_alpha_rescales_for_equal_reward_groups():
    scores = torch.tensor([1.0, 0, 0, 1, 1, 1])             # group 1 all equal → M = 2, α = 6/4
    a, _ = compute_advantages("gpg", scores=scores, mask=torch.ones(6, 1),
                              index=torch.tensor([0, 0, 0, 0, 1, 1]))
    close(a[:, 0], 1.5 * torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0]))


def passk_bruteforce(r, k):
    """Average over all size-k subsets containing i of (max(subset) − R̄)/σ (Chen et al. 2025)."""
    subsets = list(itertools.combinations(range(len(r)), k))
    rew = torch.tensor([max(r[j] for j in s) for s in subsets], dtype=torch.float64)
    mean, std = rew.mean(), rew.std(unbiased=False)
    out = []
    for i in range(len(r)):
        vals = [rew[n] for n, s in enumerate(subsets) if i in s]
        out.append((sum(vals) / len(vals) - mean) / (std + 1e-6))
    return torch.tensor(out, dtype=torch.float32)


def test_grpo_passk_hand_example_and_bruteforce():
    scores, idx = torch.tensor([1.0, 0, 1, 0]), torch.zeros(4, dtype=torch.long)
    a, _ = compute_advantages("grpo_passk", scores=scores, mask=torch.ones(4, 2), index=idx, pass_k=2)
    # R̄ = 1 − C(2,2)/C(4,2) = 5/6, σ = √5/6; success (1/6)/σ, failure (1/6 − C(1,1)/C(3,1))/σ
    close(a[:, 0], torch.tensor([1, -1, 1, -1.0]) / math.sqrt(5), atol=1e-5, rtol=1e-5)
    a, _ = compute_advantages("grpo_passk", scores=scores, mask=torch.ones(4, 2), index=idx,
                              pass_k=2, norm_by_std=False)
    close(a[:, 0], torch.tensor([1, -1, 1, -1.0]) / 6)
    gen = torch.Generator().manual_seed(1)
    for n, k in [(5, 1), (5, 2), (5, 3), (6, 4), (4, 4)]:
        r = (torch.rand(n, generator=gen) < 0.5).float()
        a, _ = compute_advantages("grpo_passk", scores=r, mask=torch.ones(n, 1),
                                  index=torch.zeros(n, dtype=torch.long), pass_k=k)
        close(a[:, 0], passk_bruteforce(r.tolist(), k), atol=1e-4, rtol=1e-4)
        assert abs(float(a.sum())) < 1e-4                  # zero-sum within the group


def test_grpo_passk_k1_is_grpo_with_population_std_and_errors():
    scores = torch.tensor([1.0, 0, 0, 1, 1, 0])
    a, _ = compute_advantages("grpo_passk", scores=scores, mask=torch.ones(6, 1),
                              index=torch.zeros(6, dtype=torch.long), pass_k=1)
    p = 0.5
    close(a[:, 0], (scores - p) / (math.sqrt(p * (1 - p)) + 1e-6))
    with pytest.raises(ValueError, match="pass_k"):
        adv.grpo_passk(scores=scores, mask=torch.ones(6, 1), index=torch.arange(6) // 3, pass_k=4)
    with pytest.raises(ValueError, match="binary"):
        adv.grpo_passk(scores=scores * 0.5, mask=torch.ones(6, 1), index=torch.zeros(6).long())


def test_gdpo_normalises_each_component_separately():
    # GRPO on the summed reward collapses totals [0,1] and [0,2] to the same ±0.707; GDPO keeps 2×
    comps = torch.tensor([[0.0, 0], [1, 0], [0, 0], [1, 1]])
    index, mask = torch.tensor([0, 0, 1, 1]), torch.ones(4, 3)
    g, _ = compute_advantages("grpo", scores=comps.sum(1), mask=mask, index=index)
    close(g[:, 0].abs(), torch.full((4,), 0.5 / (math.sqrt(0.5) + 1e-6)))
    a, _ = compute_advantages("gdpo", components=comps, mask=mask, index=index, whiten=False)
    u = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(a[:, 0], torch.tensor([-u, u, -2 * u, 2 * u]))
    w, ret = compute_advantages("gdpo", components=comps, mask=mask, index=index)
    weighted, _ = compute_advantages("gdpo", components=comps, mask=mask, index=index, whiten=False,
                                     component_weights=[1.0, 0.5])  # verl's gdpo_reward_weights
    close(weighted[:, 0], torch.tensor([-u, u, -u - 0.5 * u, u + 0.5 * u]))
    close(w, masked_whiten(a, mask))
    close(ret, comps.sum(1)[:, None].expand(4, 3))
    assert abs(float(w.mean())) < 1e-6 and abs(float(w.std()) - 1) < 1e-4


# ----------------------------------------------------------------------------- batch-normalised


def test_reinforce_pp_discounted_return_then_whitened():
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 1]])           # row 1 has a hole: skipped
    r = torch.tensor([[0.1, -0.2, 1.0], [0.3, 9.0, 2.0]])
    a, ret = compute_advantages("reinforce_pp", mask=mask, token_rewards=r, gamma=0.5)
    close(ret, torch.tensor([[0.1 - 0.1 + 0.25, -0.2 + 0.5, 1.0], [0.3 + 1.0, 0.0, 2.0]]))
    vals = ret[mask > 0]
    close(a[mask > 0], (vals - vals.mean()) / torch.sqrt(vals.var() + 1e-8))
    assert a[1, 1] == 0


def test_reinforce_pp_baseline_group_mean_then_whiten():
    scores, index = torch.tensor([1.0, 0, 3, 1]), torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    a, _ = compute_advantages("reinforce_pp_baseline", scores=scores, mask=mask, index=index)
    pre = torch.tensor([0.5, -0.5, 1.0, -1.0])[:, None] * mask
    vals = pre[mask > 0]
    close(a, torch.where(mask > 0, (pre - vals.mean()) / torch.sqrt(vals.var() + 1e-8), 0.0))


# ----------------------------------------------------------------------------- optimal token baseline


def test_otb_by_hand():
    # sample 0: π = [.5, .5], Σπ² = [.5, .5] → w = [.5, .5], W = [.5, 1]; G = [1, 1]
    # sample 1: π = [1, .25], Σπ² = [1, .25] → w = [0, .75], W = [0, .75]; G = [0, 0]
    # B_0 = (1·.5)/.5 = 1, B_1 = (1·1)/(1.75) = 4/7
    lp = torch.log(torch.tensor([[0.5, 0.5], [1.0, 0.25]]))
    a, ret = compute_advantages("otb", scores=torch.tensor([1.0, 0]), mask=torch.ones(2, 2),
                                index=torch.zeros(2, dtype=torch.long), old_logprobs=lp,
                                sum_sq_probs=torch.tensor([[0.5, 0.5], [1.0, 0.25]]))
    close(a, torch.tensor([[0.0, 3 / 7], [-1.0, -4 / 7]]))
    close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_otb_fallbacks_and_lone_timesteps():
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1], [1, 1, 0]])
    kw = dict(scores=torch.tensor([1.0, 0, 2]), mask=mask, index=torch.zeros(3, dtype=torch.long))
    # no logprobs: w = 1, W_t = t+1 for every live sample → baseline = plain mean of live G_t
    a, _ = compute_advantages("otb", **kw)
    close(a, torch.tensor([[1 - 1.0, 0, 0], [0 - 1.0, 0 - 1.0, 0.0], [2 - 1.0, 2 - 1.0, 0]]))
    # only sample 1 is live at t = 2 → advantage 0 there (group of one per timestep)
    lp = torch.log(torch.tensor([[0.9, 0.5, 0.5], [0.5, 0.2, 0.7], [0.3, 0.6, 0.5]]))
    a, _ = compute_advantages("otb", **kw, old_logprobs=lp)     # Σπ² ≈ π² → w = (1 − π)²
    w = (1 - lp.exp()) ** 2 * mask
    W = w.cumsum(1)
    G = kw["scores"][:, None] * mask
    b0 = (G[:, 0] * W[:, 0]).sum() / W[:, 0].sum()
    b1 = (G[1:, 1] * W[1:, 1]).sum() / W[1:, 1].sum()
    close(a[:, 0], G[:, 0] - b0)
    close(a[1:, 1], G[1:, 1] - b1)
    assert a[1, 2] == 0


# --------------------------------------------------------------------------- KL in the reward, new estimators


OUTCOME = ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk_max", "remax"]


@pytest.mark.parametrize("name", OUTCOME)
def test_outcome_estimators_score_the_sum_of_token_rewards(name):
    """--kl-in-reward used to vanish for these (token_rewards swallowed): now score = Σ_t token_rewards."""
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]])   # a hole in row 2
    tr = torch.tensor([[-0.1, -0.2, 1.0, 9.0], [-0.3, 0.5, 9.0, 9.0], [0.0, 7.0, -0.2, 1.0],
                       [-0.1, -0.1, -0.1, 0.0]])                                    # 9, 7: masked out
    hand = torch.tensor([0.7, 0.2, 0.8, -0.3])                                      # Σ over valid tokens
    kw = dict(mask=mask, index=torch.tensor([0, 0, 0, 0]), baselines=torch.tensor([0.1] * 4))
    kw = {k: v for k, v in kw.items() if k in estimator_inputs(name)}
    a_tr, ret = compute_advantages(name, token_rewards=tr, **kw)
    a_sc, _ = compute_advantages(name, scores=hand, **kw)
    if name == "remax":  # per-token reward-to-go, not the sum: checked by hand in its own test
        close(a_tr[:, 0], hand - 0.1)
    else:
        close(a_tr, a_sc)
        close(ret, hand[:, None] * mask)
    raw, _ = compute_advantages(name, scores=torch.tensor([1.0, 0.0, 1.0, 0.0]), **kw)
    assert not torch.allclose(raw, a_tr)                                            # the KL changed it


def test_remax_by_hand():
    # A_t = Σ_{s≥t} r_s (valid s; the hole at t=1 is skipped) − b
    mask = torch.tensor([[1.0, 0, 1, 1], [1, 1, 0, 0]])
    tr = torch.tensor([[0.1, 5.0, -0.2, 1.0], [-0.5, 2.0, 3.0, 3.0]])
    a, ret = compute_advantages("remax", token_rewards=tr, mask=mask, baselines=torch.tensor([0.5, 1.0]))
    rtg = [[0.1 - 0.2 + 1.0, 0.0, -0.2 + 1.0, 1.0], [-0.5 + 2.0, 2.0, 0.0, 0.0]]
    close(ret, torch.tensor(rtg))
    close(a, (torch.tensor(rtg) - torch.tensor([[0.5], [1.0]])) * mask)
    a, _ = compute_advantages("remax", scores=torch.tensor([1.0, 0.0]), mask=mask,
                              baselines=torch.tensor([0.5, 1.0]))
    close(a, torch.tensor([[0.5, 0, 0.5, 0.5], [-1.0, -1.0, 0, 0]]))


def test_grpo_passk_max_is_verls_best_minus_second():
    scores = torch.tensor([0.2, 0.9, 0.5, 1.0, 1.0, 0.0, 3.0])
    index = torch.tensor([0, 0, 0, 1, 1, 1, 2])        # group 1 ties at the top; group 2 is alone
    a, _ = compute_advantages("grpo_passk_max", scores=scores, mask=torch.ones(7, 2), index=index)
    std0 = torch.tensor([0.2, 0.9, 0.5]).std()
    close(a[:, 0], torch.tensor([0, (0.9 - 0.5) / (float(std0) + 1e-6), 0, 0, 0, 0, 0]))
    a, _ = compute_advantages("grpo_passk_max", scores=scores, mask=torch.ones(7, 2), index=index,
                              norm_by_std=False)
    close(a[:, 0], torch.tensor([0, 0.4, 0, 0, 0, 0, 0]))


def test_reinforce_pp_baseline_slime_form_and_unwhitened():
    scores, index = torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 1], [1, 1, 0]])
    pen = torch.tensor([[0.1, 0.2, 9.0], [0.0, 0.3, 0.1], [0.2, 9.0, 0.0], [0.1, 0.1, 9.0]])
    a, _ = compute_advantages("reinforce_pp_baseline", scores=scores, mask=mask, index=index,
                              kl_penalty=pen, whiten=False)
    hand = torch.zeros(4, 3)
    for i in range(4):                       # slime: (r − group mean) − β·KL_t, per token
        mean = scores[index == index[i]].mean()
        for t in range(3):
            if mask[i, t]:
                hand[i, t] = scores[i] - mean - pen[i, t]
    close(a, hand)
    w, _ = compute_advantages("reinforce_pp_baseline", scores=scores, mask=mask, index=index, kl_penalty=pen)
    v = hand[mask > 0]
    close(w[mask > 0], (v - v.mean()) / torch.sqrt(v.var() + 1e-8))


def test_otb_with_rollout_importance_weights_by_hand():
    # as test_otb_by_hand, with ρ̄ = [[1, 2], [1, 0.5]]: w·ρ̄² = [[.5, 2], [0, .1875]],
    # W = [[.5, 2.5], [0, .1875]]
    lp = torch.log(torch.tensor([[0.5, 0.5], [1.0, 0.25]]))
    kw = dict(scores=torch.tensor([1.0, 0]), mask=torch.ones(2, 2), index=torch.zeros(2, dtype=torch.long),
              old_logprobs=lp, sum_sq_probs=torch.tensor([[0.5, 0.5], [1.0, 0.25]]))
    a, _ = compute_advantages("otb", **kw, rollout_is_weights=torch.tensor([[1.0, 2.0], [1.0, 0.5]]))
    b1 = 2.5 / (2.5 + 0.1875)
    close(a, torch.tensor([[0.0, 1 - b1], [-1.0, -b1]]))
    assert not torch.allclose(a, compute_advantages("otb", **kw)[0])


def test_masked_whiten_keeps_the_mean_when_asked():
    x, m = torch.tensor([[1.0, 2.0, 9.0], [4.0, 5.0, 6.0]]), torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    v = torch.tensor([1.0, 2, 4, 5, 6])
    w = masked_whiten(x, m, shift_mean=False)
    close(w[m > 0], (v - v.mean()) / torch.sqrt(v.var() + 1e-8) + v.mean())
    assert w[0, 2] == 0
    a, ret = compute_advantages("reinforce_pp", scores=torch.tensor([1.0, 0.0]), mask=m, whiten=False)
    close(a, ret)


# ----------------------------------------------------------------------------- shared behaviour


def test_group_of_one_gives_zero_advantage():
    scores, index, mask = torch.tensor([1.0, 0, 0.5, 3.0]), torch.tensor([0, 0, 0, 1]), torch.ones(4, 2)
    lp = torch.full((4, 2), -0.5)
    for name in ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk", "grpo_passk_max", "otb", "gdpo"]:
        s = (scores > 0.6).float() if name == "grpo_passk" else scores
        kw = inputs_for(name, dict(scores=s, mask=mask, index=index, old_logprobs=lp, whiten=False))
        a, _ = compute_advantages(name, **kw)
        assert (a[3] == 0).all(), name
        assert (a[:3] != 0).any(), name


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="grpo") as e:
        compute_advantages("ppo_magic", scores=torch.zeros(1), mask=torch.ones(1, 1))
    assert "ppo_magic" in str(e.value) and "gae_chunked" in str(e.value)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_all_zero_mask_gives_finite_zeros(name):
    kw = inputs_for(name, full_inputs(mask=torch.zeros(6, 5)))
    a, ret = compute_advantages(name, **kw)
    assert a.dtype == torch.float32 and ret.dtype == torch.float32 and a.shape == (6, 5)
    assert (a == 0).all() and (ret == 0).all()


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_nan_inf_in_masked_positions_never_leak(name):
    mask = ragged_mask(6, 5, holes=True)
    clean = full_inputs(mask=mask)
    clean["token_rewards"] = torch.randn(6, 5) * mask
    dirty = dict(clean)
    pad = mask == 0
    for key, bad in [("token_rewards", float("nan")), ("values", float("inf")),
                     ("old_logprobs", float("-inf")), ("sum_sq_probs", float("nan"))]:
        dirty[key] = clean[key].masked_fill(pad, bad)
    a0, r0 = compute_advantages(name, **inputs_for(name, clean))
    a1, r1 = compute_advantages(name, **inputs_for(name, dirty))
    assert torch.isfinite(a1).all() and torch.isfinite(r1).all()
    assert (a1[pad] == 0).all() and (r1[pad] == 0).all()
    close(a1, a0)
    close(r1, r0)


def test_bad_input_raises_clear_errors():
    kw = full_inputs()
    g, r = inputs_for("gae", kw), inputs_for("grpo", kw)
    with pytest.raises(ValueError, match="values"):
        adv.gae(**{**g, "values": torch.zeros(6, 4)})
    with pytest.raises(ValueError, match="values"):
        adv.gae_chunked(**{**g, "values": None})
    with pytest.raises(ValueError, match="scores"):
        adv.grpo(**{**r, "scores": torch.tensor([float("nan")] * 6)})
    with pytest.raises(ValueError, match="scores"):
        adv.grpo(**{**r, "scores": torch.zeros(5)})
    with pytest.raises(ValueError, match="index"):
        adv.rloo(**{**inputs_for("rloo", kw), "index": torch.zeros(6)})  # float ids
    bad = kw["values"].clone()
    bad[0, 0] = float("nan")                                       # row 0 is full: valid position
    with pytest.raises(ValueError, match="NaN"):
        adv.gae(**{**g, "values": bad})
    with pytest.raises(ValueError, match="not both"):
        adv.grpo(**r, token_rewards=torch.zeros(6, 5))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_an_input_an_estimator_cannot_use_is_an_error(name):
    """Issue 19: estimators used to swallow unknown inputs through **_ (otb(..., rollout_is_weights=w)
    returned the unweighted result). Direct calls raise TypeError, the registry a ValueError naming it."""
    kw = inputs_for(name, full_inputs())
    with pytest.raises(TypeError, match="unexpected keyword"):
        ADVANTAGE_ESTIMATORS[name](**kw, rollout_is_weight=torch.ones(6, 5))  # a typo
    unused = sorted({"values", "components", "rollout_is_weights", "baselines", "kl_penalty"}
                    - estimator_inputs(name))[0]
    with pytest.raises(ValueError, match=f"{name}' cannot use {unused}"):
        compute_advantages(name, **kw, **{unused: torch.ones(6, 5)})


def test_masked_helpers_by_hand():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 6.0]])
    m = torch.tensor([[1.0, 1, 0], [1, 0, 1]])
    assert adv.masked_mean(x, m) == 3.0
    close(adv.masked_mean(x, m, dim=1), torch.tensor([1.5, 4.5]))
    assert adv.masked_var(x, m) == pytest.approx(((4 + 1 + 0 + 9) / 3))
    assert adv.masked_var(x, torch.zeros(2, 3)) == 0 and adv.masked_mean(x, torch.zeros(2, 3)) == 0
    w = masked_whiten(x, m)
    assert torch.isfinite(w).all() and w[0, 2] == 0 and w[1, 1] == 0
    close(adv.masked_mean(w, m), torch.tensor(0.0), atol=1e-6, rtol=0)


def test_module_is_self_contained(copied_alone):
    """advantage.py imports only torch + stdlib and, copied alone into an empty folder, runs."""
    mod = copied_alone("advantage")
    a, _ = mod.compute_advantages("rloo", scores=torch.tensor([1.0, 0.0]), mask=torch.ones(2, 1),
                                  index=torch.tensor([0, 0]))
    assert a.flatten().tolist() == [1.0, -1.0]
