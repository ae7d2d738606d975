"""KL estimators, straight-through variants, importance weighting, reward penalty, controllers.

Values are checked against hand computations; gradient claims against autograd, and the
"unbiased" claims by exact enumeration over a small categorical (no sampling noise).
"""
import math

import pytest
import torch

from nanorl.kl import (
    AdaptiveKLController,
    FixedKLController,
    importance_weighted_kl,
    kl_estimator,
    kl_penalized_rewards,
    masked_mean,
)

LOGP = [[-1.0, -2.0]]
REF = [[-1.5, -1.0]]  # log-ratio lr = logp - ref = [0.5, -1.0]


def _t(x, grad=False):
    return torch.tensor(x, dtype=torch.float32, requires_grad=grad)


def test_k1_k2_k3_abs_hand_values():
    logp, ref = _t(LOGP), _t(REF)
    assert torch.allclose(kl_estimator(logp, ref, "k1"), _t([[0.5, -1.0]]))
    assert torch.allclose(kl_estimator(logp, ref, "k2"), _t([[0.125, 0.5]]))
    k3 = [[math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]]  # e^{-lr} - 1 + lr
    assert torch.allclose(kl_estimator(logp, ref, "k3"), _t(k3), atol=1e-6)
    assert torch.allclose(kl_estimator(logp, ref, "abs"), _t([[0.5, 1.0]]))
    # aliases are the same estimators
    for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(kl_estimator(logp, ref, alias), kl_estimator(logp, ref, name))


def test_k3_nonnegative_and_clamped():
    logp = torch.randn(64, 32) * 5
    ref = torch.randn(64, 32) * 5
    k3 = kl_estimator(logp, ref, "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all()
    # lr = +30 -> u = -30 -> k3 = e^-30 - 1 + 30 ≈ 29, clamped to 10 (verl's clamp, chosen here)
    big = kl_estimator(_t([[0.0]]), _t([[-30.0]]), "k3")
    assert big.item() == pytest.approx(10.0)
    # lr = -30: exp argument clamped to 20 first, so the unclamped value is e^20 - 1 - 20, finite
    raw = kl_estimator(_t([[-30.0]]), _t([[0.0]]), "k3", k3_clamp=None)
    assert raw.item() == pytest.approx(math.expm1(20.0) - 20.0, rel=1e-6)


def test_gradients_of_plain_estimators():
    for kind, expected in (("k1", [1.0, 1.0]), ("k2", [0.5, -1.0]),
                           ("k3", [1 - math.exp(-0.5), 1 - math.exp(1.0)])):  # d/dlogp
        logp = _t(LOGP, grad=True)
        kl_estimator(logp, _t(REF), kind).sum().backward()
        assert torch.allclose(logp.grad, _t([expected]), atol=1e-6), kind


@pytest.mark.parametrize("kind,base", [("k3+", "k3"), ("low_var_kl+", "k3"), ("k1+", "k1"), ("abs+", "abs")])
def test_straight_through_has_value_of_named_and_gradient_of_k2(kind, base):
    logp = torch.randn(3, 7, requires_grad=True)
    ref = torch.randn(3, 7)
    out = kl_estimator(logp, ref, kind)
    assert torch.equal(out.detach(), kl_estimator(logp.detach(), ref, base))
    (g,) = torch.autograd.grad(out.sum(), logp)
    logp2 = logp.detach().clone().requires_grad_()
    (g2,) = torch.autograd.grad(kl_estimator(logp2, ref, "k2").sum(), logp2)
    assert torch.allclose(g, g2) and torch.allclose(g, logp.detach() - ref)  # ∇k2 = lr


def test_bad_kind_and_shape():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimator(_t(LOGP), _t(REF), "k4")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_estimator(torch.zeros(2, 3), torch.zeros(2, 4), "k1")


def _categorical():
    torch.manual_seed(1)
    theta = torch.randn(6, requires_grad=True)
    old = torch.randn(6)
    ref = torch.randn(6)
    return theta, torch.log_softmax(old, -1), torch.log_softmax(ref, -1)


def test_importance_weighted_k3_is_unbiased_in_value_and_gradient():
    """E_{a~π_old}[w·k3(a)] = KL(π_θ‖π_ref), and its gradient is ∇KL — exact enumeration over a."""
    theta, old_lp, ref_lp = _categorical()
    lp = torch.log_softmax(theta, -1)  # [V], every token treated as a sampled one
    exact = (lp.exp() * (lp - ref_lp)).sum()
    (g_exact,) = torch.autograd.grad(exact, theta, retain_graph=True)
    est = (old_lp.exp() * importance_weighted_kl(lp[None], ref_lp[None], old_lp[None], "k3",
                                                 k3_clamp=None)[0]).sum()
    (g_est,) = torch.autograd.grad(est, theta, retain_graph=True)
    assert est.item() == pytest.approx(exact.item(), rel=1e-5)
    assert torch.allclose(g_est, g_exact, atol=1e-6)
    # detached weight + straight-through k3+: value and gradient still unbiased
    st = importance_weighted_kl(lp[None], ref_lp[None], old_lp[None], "k3+", detach_weight=True)[0]
    (g_st,) = torch.autograd.grad((old_lp.exp() * st).sum(), theta, retain_graph=True)
    assert torch.allclose(g_st, g_exact, atol=1e-6)
    # the pitfall: detached weight + plain k3 gives the gradient of the REVERSE KL(π_ref‖π_θ)
    bad = importance_weighted_kl(lp[None], ref_lp[None], old_lp[None], "k3", detach_weight=True)[0]
    (g_bad,) = torch.autograd.grad((old_lp.exp() * bad).sum(), theta, retain_graph=True)
    (g_rev,) = torch.autograd.grad((ref_lp.exp() * (ref_lp - lp)).sum(), theta)
    assert torch.allclose(g_bad, g_rev, atol=1e-6) and not torch.allclose(g_bad, g_exact, atol=1e-3)


def test_importance_weighted_kl_hand_values():
    logp, ref = _t(LOGP, grad=True), _t(REF)
    # on-policy (old == logp): weight 1, value = k3, gradient = w·lr = lr (the k2 gradient)
    out = importance_weighted_kl(logp, ref, logp.detach(), "k3")
    assert torch.allclose(out.detach(), kl_estimator(logp.detach(), ref, "k3"))
    out.sum().backward()
    assert torch.allclose(logp.grad, _t([[0.5, -1.0]]), atol=1e-6)
    # off-policy: old = logp - ln 2  ->  w = 2
    old = _t(LOGP) - math.log(2.0)
    out = importance_weighted_kl(_t(LOGP), ref, old, "k1")
    assert torch.allclose(out, _t([[1.0, -2.0]]), atol=1e-6)


def test_kl_penalized_rewards_places_score_on_last_valid_token():
    kl = _t([[0.1, 0.2, 0.3, float("nan")], [0.5, float("inf"), 0.5, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = _t([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])  # row 1 has a hole (multi-turn), row 2 empty
    r = kl_penalized_rewards(_t([1.0, 2.0, 3.0]), kl, mask, beta=0.5)
    expected = _t([[-0.05, -0.1, -0.15 + 1.0, 0.0], [-0.25, 0.0, -0.25 + 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(r, expected)
    with pytest.raises(ValueError, match="scores"):
        kl_penalized_rewards(_t([1.0]), kl, mask, 0.5)


def test_masked_mean_ignores_nan_and_empty_mask():
    x = _t([[1.0, float("nan")], [3.0, float("inf")]])
    assert masked_mean(x, _t([[1, 0], [1, 0]])).item() == 2.0
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0


def test_adaptive_controller_moves_beta_the_right_way_and_clips():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(7.0, n_steps=256)  # error = 7/6 - 1 = 1/6: above target -> β up
    assert c.beta == pytest.approx(0.1 * (1 + (1 / 6) * 256 / 10000))
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(3.0, n_steps=256)  # error -0.5 clipped to -0.2: below target -> β down
    assert c.beta == pytest.approx(0.1 * (1 - 0.2 * 256 / 10000))
    c = AdaptiveKLController(0.1, target=1.0, horizon=100)
    c.update(50.0, n_steps=100)  # error 49 clipped to +0.2 -> exactly ×1.2
    assert c.beta == pytest.approx(0.12)
    c.update(1.0, n_steps=100)  # on target: unchanged
    assert c.beta == pytest.approx(0.12)
    with pytest.raises(ValueError, match="not finite"):
        c.update(float("nan"), 1)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_controller_state_dict_round_trip():
    a = AdaptiveKLController(0.2, target=2.0, horizon=50)
    a.update(4.0, 10)
    b = AdaptiveKLController(1.0, target=9.0, horizon=9)
    b.load_state_dict(a.state_dict())
    assert (b.beta, b.target, b.horizon) == (a.beta, 2.0, 50.0)
    assert b.update(4.0, 10) == a.update(4.0, 10)
    f = FixedKLController(0.05)
    assert f.update(100.0, 1000) == 0.05
    g = FixedKLController(0.0)
    g.load_state_dict(f.state_dict())
    assert g.beta == 0.05


def test_module_is_self_contained(copied_alone):
    """kl.py imports only torch + stdlib and, copied alone into an empty folder, loads and runs."""
    mod = copied_alone("kl")
    assert mod.kl_estimator(torch.zeros(1, 2), torch.zeros(1, 2), "k3+").sum().item() == 0.0
