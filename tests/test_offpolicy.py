"""Off-policy corrections (nanorl/offpolicy.py): TIS with a lower clip and at sequence level, masked IS,
OPSM's token rule, and the weight / ratio metrics — each against values computed here by hand.

Run: python -m pytest tests/test_offpolicy.py -q
"""
import math

import pytest
import torch

from nanorl.losses import LossConfig, total_loss
from nanorl.offpolicy import is_metrics, is_weights, opsm_mask


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


RHO = [[3.0, 0.5, 1.0, 0.1]]  # π_old/π_rollout per token (rollout = 0, old = log ρ)


def test_tis_upper_only_and_with_a_lower_clip():
    old, roll, mask = torch.log(_t(RHO)), torch.zeros(1, 4), torch.ones(1, 4)
    w, changed, rho = is_weights(old, roll, mask, tis=(0.0, 2.0))           # verl: clamp above only
    assert torch.allclose(w, _t([[2.0, 0.5, 1.0, 0.1]])) and changed.tolist() == [[True, False, False, False]]
    assert torch.allclose(rho, _t(RHO))
    w, changed, _ = is_weights(old, roll, mask, tis=(0.2, 2.0))             # slime: tis_clip_low too
    assert torch.allclose(w, _t([[2.0, 0.5, 1.0, 0.2]])) and changed.tolist() == [[True, False, False, True]]


def test_sequence_level_weight_is_the_product_over_valid_tokens():
    old, mask = torch.log(_t([[3.0, 0.5, 1.0, 7.0], [0.5, 0.5, 1.0, 1.0]])), _t([[1, 1, 1, 0], [1, 1, 0, 0]])
    w, _, _ = is_weights(old, torch.zeros(2, 4), mask, level="sequence", tis=(0.0, 2.0))
    assert torch.allclose(w, _t([[1.5, 1.5, 1.5, 0.0], [0.25, 0.25, 0.0, 0.0]]))  # 3·0.5·1; 0.5·0.5
    w, changed, _ = is_weights(old, torch.zeros(2, 4), mask, level="sequence", mis=(0.3, 2.0))
    assert torch.allclose(w, _t([[1.5, 1.5, 1.5, 0.0], [0.0, 0.0, 0.0, 0.0]]))   # row 1 leaves the band
    assert changed.tolist() == [[False] * 4, [True, True, False, False]]


def test_masked_is_drops_tokens_outside_the_band_and_combines_with_tis():
    old, roll, mask = torch.log(_t([[0.4, 1.0, 6.0, 4.0]])), torch.zeros(1, 4), torch.ones(1, 4)
    w, changed, _ = is_weights(old, roll, mask, mis=(0.5, 5.0))             # ICEPOP's band
    assert torch.allclose(w, _t([[0.0, 1.0, 0.0, 4.0]])) and changed.tolist() == [[True, False, True, False]]
    w, _, _ = is_weights(old, roll, mask, tis=(0.0, 2.0), mis=(0.5, 5.0))   # truncated inside the band
    assert torch.allclose(w, _t([[0.0, 1.0, 0.0, 2.0]]))
    with pytest.raises(ValueError, match="MIS needs"):
        is_weights(old, roll, mask, mis=(1.5, 5.0))
    with pytest.raises(ValueError, match="level"):
        is_weights(old, roll, mask, level="batch", tis=(0.0, 2.0))


def test_weight_and_ratio_metrics_by_hand():
    rho = _t([[3.0, 0.5, 1.0, 0.1], [1.2, 9.0, 9.0, 9.0]])
    mask = _t([[1, 1, 1, 1], [1, 0, 0, 0]])
    w, changed, r = is_weights(torch.log(rho), torch.zeros(2, 4), mask, tis=(0.0, 2.0))
    m = is_metrics(w, changed, r, mask)
    wv, rv = [2.0, 0.5, 1.0, 0.1, 1.2], [3.0, 0.5, 1.0, 0.1, 1.2]
    assert m["is_weight_mean"] == pytest.approx(sum(wv) / 5, rel=1e-6)
    assert m["is_weight_max"] == pytest.approx(2.0) and m["is_clipfrac"] == pytest.approx(1 / 5)
    assert m["is_ess"] == pytest.approx(sum(wv) ** 2 / (5 * sum(x * x for x in wv)), rel=1e-6)
    mean = sum(rv) / 5
    assert m["is_ratio_var"] == pytest.approx(sum(x * x for x in rv) / 5 - mean ** 2, rel=1e-5)
    assert m["is_ratio_tail"] == pytest.approx(2 / 5)  # 3.0 and 0.1 lie outside [1/2, 2]


def test_opsm_token_rule_on_token_level_advantages_by_hand():
    """DeepSeek-V3.2 / slime: mask token t when A_t < 0 and the sequence's mean(log π_b − log π_θ) > δ.
    With GAE-style token advantages the old sequence rule (mean advantage < 0) disagreed."""
    logp = torch.zeros(3, 3)
    behaviour = _t([[0.3, 0.2, 0.1], [0.3, 0.2, 0.1], [0.01, 0.01, 0.01]])   # seq KL 0.2, 0.2, 0.01
    adv = _t([[-1.0, 2.0, -0.5], [0.5, 0.5, -3.0], [-1.0, -1.0, -1.0]])    # row 0 mean > 0, row 1 < 0
    keep, masked = opsm_mask(logp, behaviour, adv, torch.ones(3, 3), delta=0.1)
    hand = torch.ones(3, 3)
    for i in range(3):
        if float((behaviour[i] - logp[i]).mean()) > 0.1:
            for t in range(3):
                if adv[i, t] < 0:
                    hand[i, t] = 0.0
    assert torch.equal(keep, hand) and keep.tolist() == [[0, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert masked.sum() == 3
    # as weights in the loss: the masked tokens get no gradient, the others keep theirs
    lp = torch.zeros(3, 3, requires_grad=True)
    loss, _ = total_loss(LossConfig(), lp, torch.zeros(3, 3), adv, torch.ones(3, 3), weights=keep)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.equal(g == 0, keep == 0)


def test_nan_on_masked_positions_never_reaches_weights_or_metrics():
    mask = _t([[1, 1, 0], [1, 0, 0]])
    old = _t([[0.1, -0.2, math.nan], [0.3, math.inf, -math.inf]])
    roll = _t([[0.0, 0.0, math.nan], [0.0, math.nan, 0.0]])
    w, changed, r = is_weights(old, roll, mask, level="sequence", tis=(0.1, 2.0), mis=(0.05, 5.0))
    assert torch.isfinite(w).all() and (w[mask == 0] == 0).all()
    assert all(math.isfinite(v) for v in is_metrics(w, changed, r, mask).values())
    keep, _ = opsm_mask(old, roll, _t([[-1.0, 1.0, math.nan], [-1.0, math.nan, 0.0]]), mask, 0.0)
    assert torch.isfinite(keep).all()


def test_module_is_self_contained(copied_alone):
    mod = copied_alone("offpolicy")
    w, _, _ = mod.is_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), tis=(0.0, 2.0))
    assert w.tolist() == [[1.0, 1.0]]


def test_mismatch_metrics_match_their_formulas_and_ignore_masked_nan():
    from nanorl.offpolicy import mismatch_metrics
    old = torch.tensor([[0.0, -1.0, -2.0, math.nan], [-0.5, -0.5, 0.0, 0.0]])   # [B, T] NaN on a pad
    roll = torch.tensor([[0.0, -1.5, -1.0, math.inf], [-0.5, 0.0, 0.0, 0.0]])  # [B, T]
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    m = mismatch_metrics(old, roll, mask)
    rho = torch.exp(torch.tensor([0.0, 0.5, -1.0, 0.0, -0.5]))  # the 5 valid tokens' π_old/π_rollout
    assert m["mismatch/ratio_mean"] == pytest.approx(float(rho.mean()))
    assert m["mismatch/ratio_max"] == pytest.approx(math.exp(0.5))
    assert m["mismatch/ratio_ess"] == pytest.approx(float(rho.sum() ** 2 / (5 * (rho * rho).sum())))
    assert m["mismatch/ratio_p50"] == pytest.approx(1.0)
    assert (m["mismatch/ratio_p01"] < m["mismatch/ratio_p50"] < m["mismatch/ratio_p99"]
            <= m["mismatch/ratio_max"])
    assert m["mismatch/seq_log_ratio_mean"] == pytest.approx((-0.5 + -0.5) / 2)  # rows: 0+0.5−1, 0−0.5
    assert m["mismatch/seq_log_ratio_abs_mean"] == pytest.approx(0.5)
    assert all(math.isfinite(v) for v in m.values())
    same = mismatch_metrics(roll.nan_to_num(posinf=0.0), roll.nan_to_num(posinf=0.0), mask)
    assert same["mismatch/ratio_ess"] == pytest.approx(1.0) and same["mismatch/seq_log_ratio_abs_mean"] == 0.0
    empty = mismatch_metrics(old, roll, torch.zeros_like(mask))  # a rank of pads: the same keys, ρ ≡ 1
    assert (set(empty) == set(m) and empty["mismatch/ratio_max"] == 1.0
            and empty["mismatch/seq_log_ratio_mean"] == 0.0)
