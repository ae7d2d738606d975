"""Tests for nanorl/sampling.py: sampler distribution, reported logprobs, Keep Sampling Mask.

Expected values are computed by hand from a fixed distribution P (see _P), not with the sampler.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from nanorl.sampling import (
    apply_support,
    draw,
    keep_mask,
    sample_next,
    stack_steps,
    support_bytes_per_token,
    support_from_topk_logprobs,
    support_to_mask,
)

_P = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]  # sums to 1; logits = log P + const
_PERM = [3, 0, 6, 2, 5, 1, 4]  # token id of P[i] is _PERM[i]: kept ids are not a vocab prefix
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}  # chi2 0.999 quantiles


def _logits() -> torch.Tensor:
    z = torch.empty(len(_P))
    for i, p in enumerate(_P):
        z[_PERM[i]] = math.log(p) + 3.0  # [V]
    return z


def _expected(weights: list[float]) -> torch.Tensor:
    """Renormalised kept distribution over the vocab, from weights on the first entries of P."""
    out = torch.zeros(len(_P), dtype=torch.float64)
    for i, w in enumerate(weights):
        out[_PERM[i]] = w / sum(weights)
    return out


def _frequencies(n: int, **kw) -> torch.Tensor:
    z = _logits()[None, :].expand(n, -1).contiguous()  # [n, V]
    g = torch.Generator().manual_seed(1234)
    tokens, _, _ = sample_next(z, generator=g, **kw)
    return torch.bincount(tokens, minlength=len(_P)).double() / n  # [V]


@pytest.mark.parametrize("kw, weights", [
    (dict(temperature=1.0, top_k=3), _P[:3]),
    (dict(temperature=1.0, top_p=0.85), _P[:4]),  # mass above 4th = .8 < .85, above 5th = .9
    # top-k THEN top-p: renormalised top-3 is [.5, .3125, .1875]; mass above 3rd = .8125 >= .75.
    # (top-p alone on P would keep 3 tokens: mass above 3rd = .65 < .75.)
    (dict(temperature=1.0, top_k=3, top_p=0.75), _P[:2]),
    (dict(temperature=0.5), [p ** 2 for p in _P]),
    (dict(temperature=2.0), [p ** 0.5 for p in _P]),
    # temperature before top-p: P^2 renormalised = [.617, .241, .087, ...]; mass above 3rd = .857
    (dict(temperature=0.5, top_p=0.8), [p ** 2 for p in _P[:2]]),
])
def test_empirical_frequencies_match_renormalised_kept_distribution(kw, weights):
    n = 40_000
    freq = _frequencies(n, **kw)
    expected = _expected(weights)
    kept = expected > 0
    assert freq[~kept].sum() == 0, "a token outside the kept set was drawn"
    tv = 0.5 * (freq - expected).abs().sum()
    assert tv < 0.015, f"total variation {tv:.4f}"
    chi2 = float((n * (freq[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    df = int(kept.sum()) - 1
    assert chi2 < _CHI2_999[df], f"chi-square {chi2:.2f} with {df} dof"


def test_reported_logprob_renormalised_with_support_full_without():
    z = _logits()[None, :].expand(64, -1).contiguous()  # [64, V]
    tok, lp, sup = sample_next(z, 1.0, top_p=0.85, record_support=True,
                               generator=torch.Generator().manual_seed(0))
    kept_mass = sum(_P[:4])
    for t, l in zip(tok.tolist(), lp.tolist()):
        i = _PERM.index(t)
        assert l == pytest.approx(math.log(_P[i] / kept_mass), abs=1e-6)
    assert sorted(sup[0].tolist()) == sorted(_PERM[:4])  # width = |S| = 4, no padding needed
    assert sup[0].tolist() == _PERM[:4]  # most probable first
    tok, lp, sup = sample_next(z, 0.5, top_p=0.85, record_support=False,
                               generator=torch.Generator().manual_seed(0))
    assert sup is None
    z2 = sum(p ** 2 for p in _P)
    for t, l in zip(tok.tolist(), lp.tolist()):
        assert l == pytest.approx(math.log(_P[_PERM.index(t)] ** 2 / z2), abs=1e-6)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (20, 1.0), (20, 0.9)])
def test_ksm_first_epoch_ratio_is_one_full_vocab_is_not(top_k, top_p):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(256, 500, generator=g) * 3.0  # [N, V]
    T = 0.9
    stats = {}
    tok, lp, sup = sample_next(logits, T, top_k=top_k, top_p=top_p, generator=g,
                               record_support=True, support_cap=500, stats=stats)
    assert stats["overflow_tokens"] == 0 and stats["restricted_tokens"] == 256
    # Trainer recompute with the recorded support (Keep Sampling Mask): ratio exactly 1.
    # logits * (1/T) is the sampler's and the trainer kernels' op (sampling.py docstring, step 1).
    ksm = torch.log_softmax(apply_support(logits * (1.0 / T), sup), -1)
    ksm = ksm.gather(-1, tok[:, None])[:, 0]  # [N]
    ratio = torch.exp(torch.clamp(ksm - lp, -20, 20))  # [N]
    assert (ratio - 1).abs().max() <= 1e-6
    # Full-vocab recompute: ratio = Z_S = kept mass < 1, off by exactly -log Z_S per token.
    full = torch.log_softmax(logits * (1.0 / T), -1).gather(-1, tok[:, None])[:, 0]
    ratio_full = torch.exp(torch.clamp(full - lp, -20, 20))  # [N]
    assert (ratio_full - 1).abs().max() > 1e-2
    assert (ratio_full <= 1 + 1e-6).all()
    kept_mass = (torch.softmax(logits * (1.0 / T), -1) * support_to_mask(sup, 500)).sum(-1)  # [N]
    torch.testing.assert_close(full - lp, kept_mass.log(), atol=1e-5, rtol=0)
    if top_k:
        assert (sup >= 0).sum(-1).max() <= top_k


def test_overflow_row_stored_unrestricted_and_scored_full_vocab():
    V = 200
    peaked = torch.full((V,), -10.0)
    peaked[[4, 9, 17]] = torch.tensor([5.0, 4.0, 3.5])
    flat = torch.linspace(0.0, 0.1, V)  # top-p 0.9 keeps ~180 ids > cap
    logits = torch.stack([peaked, flat])  # [2, V]
    stats = {}
    tok, lp, sup = sample_next(logits, 1.0, top_p=0.9, record_support=True, support_cap=64,
                               generator=torch.Generator().manual_seed(3), stats=stats)
    assert stats == {"sampled_tokens": 2, "restricted_tokens": 1, "overflow_tokens": 1,
                     "support_ids": sup[0].ge(0).sum().item()}
    assert set(sup[0][sup[0] >= 0].tolist()) <= {4, 9, 17}
    assert sup.shape[1] <= 3 and (sup[1] == -1).all()  # width follows the stored rows only
    full = torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    assert lp[1] == full[1]  # overflow row reports the full-vocab logprob...
    recompute = torch.log_softmax(apply_support(logits, sup), -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(recompute, lp, atol=1e-6, rtol=0)  # ...so both rows stay exact
    assert support_bytes_per_token(sup) <= 4 * 64


def test_top_p_ties_are_kept_together_and_order_free():
    # p = [.447, .164, .164, .164, .060]: mass above each tied token is .447 < .5, so all three
    # are kept (a sort-position rule would keep one of them, chosen by sort order).
    z = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    assert keep_mask(z, top_p=0.5).tolist() == [[True, True, True, True, False]]
    perm = torch.tensor([4, 2, 0, 3, 1])
    assert keep_mask(z[:, perm], top_p=0.5).tolist() == [[False, True, True, True, True]]
    tok, _, sup = sample_next(z.expand(3000, -1), 1.0, top_p=0.5, record_support=True,
                              generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {0, 1, 2, 3}
    assert sorted(sup[0].tolist()) == [0, 1, 2, 3]
    # Exact boundary (probs [.5, .25, .25] are exact in fp32): the nucleus {0} already has mass
    # p = .5, so nothing else is kept; just above .5 both tied .25 tokens enter together.
    z3 = torch.tensor([[math.log(2.0), 0.0, 0.0]])
    assert keep_mask(z3, top_p=0.5).tolist() == [[True, False, False]]
    assert keep_mask(z3, top_p=0.5000001).tolist() == [[True, True, True]]
    # top-k ties with the k-th value are kept too (HF / vLLM behaviour): 3 ids for k = 2.
    assert keep_mask(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), top_k=2).tolist() == [
        [True, True, True, False]]


def test_top_p_keeps_at_least_one_token():
    z = torch.tensor([[0.3, 2.0, -1.0, 1.9]]).expand(50, -1)
    tok, lp, sup = sample_next(z, 1.0, top_p=1e-9, record_support=True)
    assert (tok == 1).all() and (lp == 0).all() and sup.tolist() == [[1]] * 50
    tok, lp, sup = sample_next(z, 1.0, top_k=1, record_support=True)  # top-1: same thing
    assert (tok == 1).all() and (lp == 0).all()
    tied = torch.tensor([[1.0, 1.0, 0.0]])  # tied maxima both survive a tiny p
    _, lp, sup = sample_next(tied, 1.0, top_p=1e-9, record_support=True)
    assert sorted(sup[0].tolist()) == [0, 1] and lp.item() == pytest.approx(math.log(0.5))


def test_greedy_temperature_zero():
    z = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 4.0]])
    tok, lp, sup = sample_next(z, 0.0, top_k=2, top_p=0.5, record_support=True)
    assert tok.tolist() == [1, 0]
    # Temperature-1, full-vocab logprob of the argmax (documented), rows unrestricted.
    torch.testing.assert_close(lp, torch.log_softmax(z, -1)[[0, 1], [1, 0]])
    assert (sup == -1).all()
    assert sample_next(z, 0.0)[2] is None


def test_no_filter_records_unrestricted_rows_and_generator_reproducible():
    logits = torch.randn(8, 50)
    stats = {}
    a = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(5), record_support=True,
                    stats=stats)
    b = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(5), record_support=True)
    assert torch.equal(a[0], b[0]) and a[2].shape == (8, 1) and (a[2] == -1).all()
    assert stats["restricted_tokens"] == 0 and stats["overflow_tokens"] == 0
    torch.testing.assert_close(a[1], torch.log_softmax(logits, -1).gather(-1, a[0][:, None])[:, 0])


def test_bad_arguments_raise():
    z = torch.randn(2, 5)
    for kw in (dict(temperature=-1.0), dict(temperature=1.0, top_p=0.0),
               dict(temperature=1.0, top_p=1.5), dict(temperature=1.0, top_k=-1),
               dict(temperature=1.0, support_cap=0)):
        with pytest.raises(ValueError):
            sample_next(z, **kw)
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sample_next(z[0], 1.0)
    with pytest.raises(ValueError, match="support ids"):
        support_to_mask(torch.tensor([[5]]), 5)
    with pytest.raises(ValueError, match="agree"):
        apply_support(z, torch.tensor([[1]]))


def test_support_to_mask_apply_support_bytes_and_stacking():
    sup = torch.tensor([[2, 0, -1], [-1, -1, -1]])
    assert support_to_mask(sup, 4).tolist() == [[True, False, True, False], [True] * 4]
    z = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    out = apply_support(z, sup)
    assert out[0].tolist() == [1.0, float("-inf"), 3.0, float("-inf")]
    assert torch.equal(out[1], z[1])
    assert support_bytes_per_token(sup) == 12.0  # dense int32: 4 * K
    assert support_bytes_per_token(sup, layout="csr") == (4 * 2 + 4 + 4 * 0 + 4) / 2
    assert support_bytes_per_token(sup, mask=torch.tensor([1, 0]), layout="csr") == 12.0
    stacked = stack_steps([torch.tensor([[-1], [3]]), torch.tensor([[1, 2], [0, -1]])])
    assert stacked.tolist() == [[[-1, -1], [1, 2]], [[3, -1], [0, -1]]]


def test_support_from_vllm_topk_logprobs():
    inf = float("inf")
    positions = [
        {5: -0.1, 7: -2.4, 9: -inf},  # complete: a -inf entry ranks below all of S
        {5: SimpleNamespace(logprob=-0.5), 7: SimpleNamespace(logprob=-1.0)},  # cannot prove
        {3: -9999.0, 1: -0.0},  # the OpenAI server's floor for -inf
    ]
    sup, overflow = support_from_topk_logprobs(positions)
    assert sup.tolist() == [[5, 7], [-1, -1], [1, -1]]
    assert overflow.tolist() == [False, True, False]
    # Round trip: mimic vLLM processed_logprobs for top-k = 4, request logprobs = k + 1.
    logits = torch.randn(6, 40)
    tok, lp, ours = sample_next(logits, 0.7, top_k=4, record_support=True)
    processed = torch.log_softmax(apply_support(logits * (1.0 / 0.7), ours), -1)  # [6, 40]
    vals, ids = processed.topk(5, -1)
    dicts = [dict(zip(i.tolist(), v.tolist())) | {int(t): float(p[t])}
             for i, v, t, p in zip(ids, vals, tok, processed)]
    rebuilt, overflow = support_from_topk_logprobs(dicts)
    assert not overflow.any()
    assert [sorted(r[r >= 0].tolist()) for r in rebuilt] == [sorted(r.tolist()) for r in ours]
    assert [d[int(t)] for d, t in zip(dicts, tok)] == pytest.approx(lp.tolist(), abs=1e-6)


def test_matches_trainer_support_hook_when_available():
    from nanorl import entropy  # written: a missing or renamed function fails, never skips
    logits = torch.randn(32, 300) * 3.0
    tok, lp, sup = sample_next(logits, 0.8, top_k=20, top_p=0.9, record_support=True,
                               generator=torch.Generator().manual_seed(1))
    trainer_lp, _ = entropy.naive_logprobs_entropy(logits, tok, temperature=0.8, support=sup)
    assert (torch.exp(trainer_lp.float() - lp) - 1).abs().max() <= 1e-6
    # the dispatched kernel (Triton interpreter here)
    kernel_lp, _ = entropy.logprobs_and_entropy(logits, tok, temperature=0.8, support=sup)
    assert (torch.exp(kernel_lp.float() - lp) - 1).abs().max() <= 1e-6


def _keep_mask_full_sort(z, top_k, top_p):
    """keep_mask as it was written first: the whole row sorted (the reference for the partial sort)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.shape[-1]:
        keep = z >= z.topk(top_k, dim=-1).values[:, -1:]
    q = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    q_sorted = q.sort(dim=-1, descending=True).values
    cum = torch.cumsum(q_sorted, dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    n_keep = (mass_before < top_p).sum(dim=-1, keepdim=True)
    return keep & (q >= q_sorted.gather(-1, n_keep - 1))


@pytest.mark.parametrize("scale", [8.0, 2.0, 0.3])  # peaked (nucleus < 1024), wider, flat (full sort)
def test_top_p_partial_sort_keeps_what_the_full_sort_keeps(scale):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 20000, generator=g) * scale  # [B, V]
    z[0, :50] = z[0].max()  # a tie spanning the boundary
    for top_k, top_p in ((0, 0.9), (0, 0.5), (300, 0.95), (0, 0.999)):
        assert torch.equal(keep_mask(z, top_k, top_p), _keep_mask_full_sort(z, top_k, top_p)), (top_k, top_p)


def test_draw_is_multinomials_draw_bit_for_bit():
    """Same ids as torch.multinomial(p, 1) and the generator left in the same state (the next draws agree)."""
    z = torch.randn(8, 151936) * 3  # [B, V] a real vocabulary
    z[1] = 0.0  # uniform: every id ties
    z[2, 100:] = float("-inf")  # a filtered row: 100 ids, zero probability elsewhere
    z[3] = z[3].round()  # many tied probabilities
    logp = torch.log_softmax(z, dim=-1)
    # shapes alternate: draw's reused buffers (one shape held at a time) follow the input's shape
    small = torch.log_softmax(torch.randn(3, 1000) * 3, dim=-1)  # [3, 1000]
    tiny = torch.randn(4, 20) * 3  # [4, 20] under _RACE_MIN_V: multinomial itself
    tiny[1], tiny[2, 5:] = 0.0, float("-inf")
    tiny = torch.log_softmax(tiny, dim=-1)
    for seed in range(6):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for lp in (logp, small, tiny) if seed % 2 else (logp, tiny):
            assert torch.equal(draw(lp, g1), torch.multinomial(lp.exp(), 1, generator=g2).squeeze(-1))
            assert torch.equal(g1.get_state(), g2.get_state())


def test_draw_takes_the_race_where_multinomial_would_raise():
    """Under _RACE_MIN_V ids a row multinomial refuses (all zero, NaN) still gets an id, as before."""
    logp = torch.full((2, 10), float("-inf"))  # [B, V] no mass at all
    logp[1, 3] = float("nan")
    assert draw(logp, torch.Generator().manual_seed(0)).tolist() == [0, 3]


def test_nan_or_inf_logits_raise():
    z = torch.randn(3, 10)
    z[1, 4] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or inf in rows \[1\]"):
        sample_next(z, 1.0, generator=torch.Generator().manual_seed(0))
    z[1, 4] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        sample_next(z, 0.7, top_p=0.9, generator=torch.Generator().manual_seed(0))
