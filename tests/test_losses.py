"""Policy losses, off-policy corrections, value loss, aggregation and the total-loss assembly.

Hand-computed values for every branch; autograd for every gradient claim; the gradient-
accumulation invariance (micro-batch losses sum to the full-batch loss) for every mode and loss.
"""
import math

import pytest
import torch

from nanorl.kl import kl_estimator
from nanorl.losses import (
    AGG_MODES,
    COV_LOSSES,
    POLICY_LOSSES,
    DroParams,
    LossConfig,
    aggregate,
    cispo_loss,
    clip_cov_loss,
    cov_selection,
    dppo_kl_loss,
    dppo_tv_loss,
    global_denominators,
    gmpo_loss,
    gspo_loss,
    kl_cov_loss,
    log_ratio_and_ratio,
    ppo_clip_loss,
    sapo_loss,
    top_entropy_mask,
    total_loss,
    value_loss,
)

NAN, INF = float("nan"), float("inf")


def _t(x, grad=False):
    return torch.tensor(x, dtype=torch.float32, requires_grad=grad)


def _grad(loss_mat, x):
    (g,) = torch.autograd.grad(loss_mat.sum(), x)
    return g


def test_log_ratio_clamped_before_exp():
    lr, r = log_ratio_and_ratio(_t([[50.0, -50.0, 0.5]]), torch.zeros(1, 3))
    assert torch.allclose(lr, _t([[20.0, -20.0, 0.5]]))
    assert torch.isfinite(r).all() and r[0, 2].item() == pytest.approx(math.exp(0.5))


# ratios [1.1, 1.5, 0.5, 1.5, 5.0, 0.5] with old_logp = 0, so logp = log(ratio)
RATIOS = [1.1, 1.5, 0.5, 1.5, 5.0, 0.5]
ADV = [1.0, 1.0, -1.0, -1.0, -1.0, 1.0]


def _ppo(dual_clip):
    logp = torch.log(_t([RATIOS])).requires_grad_()
    loss, stats = ppo_clip_loss(logp, torch.zeros(1, 6), _t([ADV]), torch.ones(1, 6), 0.2, 0.28, dual_clip)
    return loss, stats, _grad(loss, logp)


def test_ppo_every_branch_by_hand():
    loss, stats, g = _ppo(dual_clip=3.0)
    # a) A>0 r=1.1 inside        -> -1.1, grad -A·r = -1.1
    # b) A>0 r=1.5 > 1+0.28      -> -1.28 (clip-higher bound), grad 0
    # c) A<0 r=0.5 < 1-0.2       -> max(0.5, 0.8) = 0.8, grad 0
    # d) A<0 r=1.5 (pessimistic) -> max(1.5, 1.28) = 1.5, grad +1.5
    # e) A<0 r=5 > c=3 dual clip -> min(5, 3) = 3, grad 0
    # f) A>0 r=0.5               -> max(-0.5, -0.8) = -0.5, grad -0.5
    assert torch.allclose(loss, _t([[-1.1, -1.28, 0.8, 1.5, 3.0, -0.5]]), atol=1e-6)
    assert torch.allclose(g, _t([[-1.1, 0.0, 0.0, 1.5, 0.0, -0.5]]), atol=1e-6)
    assert stats["clip_high"].tolist() == [[False, True, False, False, False, False]]
    assert stats["clip_low"].tolist() == [[False, False, True, False, False, False]]
    assert stats["dual_clip"].tolist() == [[False, False, False, False, True, False]]
    loss, _, g = _ppo(dual_clip=None)  # textbook PPO: the A<0, r=5 token is unbounded
    assert loss[0, 4].item() == pytest.approx(5.0) and g[0, 4].item() == pytest.approx(5.0)


def test_dual_clip_bounds_loss_for_negative_advantages():
    logp = torch.randn(16, 32) * 3
    adv = -torch.rand(16, 32) - 0.1
    loss, _ = ppo_clip_loss(logp, torch.zeros(16, 32), adv, torch.ones(16, 32), dual_clip=3.0)
    assert (loss <= -3.0 * adv + 1e-6).all()
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, logp, adv, torch.ones(16, 32), dual_clip=1.0)


def test_gspo_ratio_is_geometric_mean_and_gradient():
    logp = _t([[-0.1, -0.5, -1.0, 0.0], [-0.2, -0.3, 0.0, 0.0]], grad=True)
    old = _t([[-0.3, -0.2, -1.5, 7.0], [-0.1, -0.6, 0.0, 0.0]])
    mask = _t([[1, 1, 1, 0], [1, 1, 0, 0]])
    ratios = torch.exp(logp.detach() - old)
    geo = [math.prod(ratios[0, :3].tolist()) ** (1 / 3), math.prod(ratios[1, :2].tolist()) ** (1 / 2)]
    adv = _t([[1.0] * 4, [1.0] * 4])
    loss, _ = gspo_loss(logp, old, adv, mask, clip_low=10.0, clip_high=10.0)  # no clipping
    assert torch.allclose(loss, -_t([[geo[0]] * 3 + [0.0], [geo[1]] * 2 + [0.0, 0.0]]), atol=1e-6)
    # seq-mean-token-mean gives the paper's gradient: -A · s_i · (1/|y_i|) ∇ log π(y_i,t)
    g = _grad(aggregate(loss, mask, "seq-mean-token-mean").unsqueeze(0), logp)
    assert torch.allclose(g, _t([[-geo[0] / 6] * 3 + [0.0], [-geo[1] / 4] * 2 + [0.0, 0.0]]), atol=1e-6)
    # with GSPO's tiny ε, the sequence ratio s = exp(0.2) is clipped at 1+4e-4: zero gradient for A>0
    loss, stats = gspo_loss(logp, logp.detach() - 0.2, adv, mask)
    assert torch.allclose(_grad(loss, logp), torch.zeros(2, 4)) and stats["clip_high"][mask > 0].all()


def test_cispo_gradient_flows_only_through_logp():
    old = _t([[0.0, -1.0, 0.0]])
    logp = (old + torch.log(_t([[2.0, 1.1, 0.5]]))).requires_grad_()  # ratios 2, 1.1, 0.5; logp ≠ 0
    adv = _t([[1.5, -1.0, 2.0]])
    loss, stats = cispo_loss(logp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2)
    w = _t([[1.2, 1.1, 0.8]])  # clip(r, 0.8, 1.2), detached
    assert torch.allclose(loss, -w * adv * logp.detach(), atol=1e-6)
    # d/dlogp = -w·A exactly: no r·logp term from the weight; the clipped token keeps a gradient
    assert torch.allclose(_grad(loss, logp), -w * adv, atol=1e-6)
    assert stats["clip"].tolist() == [[True, False, True]]


def test_gmpo_clips_in_log_space_per_sequence():
    logp = _t([[0.1, 0.6]], grad=True)  # log-ratios 0.1, 0.6 (old = 0); ε = 0.4
    mask, zero = torch.ones(1, 2), torch.zeros(1, 2)
    loss, _ = gmpo_loss(logp, zero, _t([[1.0, 1.0]]), mask)  # A>0: 0.6 capped at 0.4 -> exp(0.25)
    assert torch.allclose(loss, -torch.full((1, 2), math.exp(0.25)), atol=1e-6)
    g = _grad(loss[:, :1], logp)  # one token's copy of the sequence loss: d/dlogp_1 = -exp(.25)/2
    assert torch.allclose(g, _t([[-math.exp(0.25) / 2, 0.0]]), atol=1e-6)
    loss, _ = gmpo_loss(logp, zero, _t([[-1.0, -1.0]]), mask)  # A<0: the upside is not capped
    assert torch.allclose(loss, torch.full((1, 2), math.exp(0.35)), atol=1e-6)


def test_dppo_tv_mask_and_truncated_weight():
    # q = 0.5 everywhere except the last token (q = 0.01)
    p = _t([[0.7, 0.6, 0.3, 0.7, 0.15]])
    q = _t([[0.5, 0.5, 0.5, 0.5, 0.01]])
    adv = _t([[1.0, 1.0, -1.0, -1.0, 2.0]])
    logp = torch.log(p).requires_grad_()
    loss, stats = dppo_tv_loss(logp, torch.log(q), adv, torch.ones(1, 5))
    # p-q: 0.2 > δ (A>0, dropped) | 0.1 kept | -0.2 < -δ (A<0, dropped) | A<0 moving up: kept |
    # 0.14 kept but r = 15 is truncated to C = 10
    keep = _t([[0, 1, 0, 1, 1]])
    weight = _t([[1.4, 1.2, 0.6, 1.4, 10.0]])
    assert torch.allclose(_grad(loss, logp), -adv * weight * keep, atol=1e-5)
    assert stats["clip"].tolist() == [[True, False, True, False, False]]


def test_dppo_kl_binary_divergence():
    p, q = _t([[0.7, 0.55, 0.7, 0.3]]), torch.full((1, 4), 0.5)
    adv = _t([[1.0, 1.0, -1.0, -1.0]])
    logp = torch.log(p).requires_grad_()
    loss, _ = dppo_kl_loss(logp, torch.log(q), adv, torch.ones(1, 4))
    # D(0.5‖0.7) = 0.0872 > 0.05 and p > q with A > 0: dropped; D(0.5‖0.55) = 0.0050: kept;
    # A < 0 and p > q: kept whatever D; D(0.5‖0.3) = 0.0872, p < q with A < 0: dropped
    d = 0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)
    assert d == pytest.approx(0.08718, abs=1e-5)
    expected = -adv * (p / q) * _t([[0, 1, 1, 0]])
    assert torch.allclose(_grad(loss, logp), expected, atol=1e-5)


def test_sapo_soft_gate_value_and_gradient():
    # f(r) = σ(τ(r − 1))·4/τ; d/dlogp (−A·f) = −A·4·σ(1 − σ)·r; τ = 1 for A > 0, 1.05 for A ≤ 0
    ratios, adv = [1.0, 1.5, 0.5, 2.0], [1.0, 1.0, -1.0, -2.0]
    logp = torch.log(_t([ratios])).requires_grad_()
    loss, _ = sapo_loss(logp, torch.zeros(1, 4), _t([adv]), torch.ones(1, 4))
    val, grad = [], []
    for r, a in zip(ratios, adv):
        tau = 1.0 if a > 0 else 1.05
        sig = 1 / (1 + math.exp(-tau * (r - 1)))
        val.append(-a * sig * 4 / tau)
        grad.append(-a * 4 * sig * (1 - sig) * r)
    assert torch.allclose(loss, _t([val]), atol=1e-6)
    assert torch.allclose(_grad(loss, logp), _t([grad]), atol=1e-6)
    assert grad[0] == pytest.approx(-1.0)  # on-policy (r = 1) the gate's slope is 1: REINFORCE


@pytest.mark.parametrize("name", ["reinforce", "gpg", "dro"])
def test_reinforce_gpg_and_dro_by_hand(name):
    logp = _t([[-0.5, -1.0, -2.0]], grad=True)
    old, adv, mask = _t([[-0.7, -1.0, -1.5]]), _t([[1.0, -2.0, 0.5]]), _t([[1, 1, 0]])
    cfg = LossConfig(policy=name, params=DroParams(dro_beta=0.5) if name == "dro" else None, dual_clip=None)
    loss, m = total_loss(cfg, logp, old, adv, mask, num_tokens=2)
    if name == "dro":  # −(A·logp − ½β·lr²), grad −A + β·lr with lr = logp − old = [0.2, 0.0]
        vals, grads = [-(1.0 * -0.5 - 0.25 * 0.04), -(-2.0 * -1.0)], [-1.0 + 0.5 * 0.2, 2.0, 0.0]
    else:              # −A·logp, grad −A
        vals, grads = [0.5, -2.0], [-1.0, 2.0, 0.0]
    assert loss.item() == pytest.approx(sum(vals) / 2, abs=1e-6)
    assert torch.allclose(_grad(loss.unsqueeze(0), logp), _t([grads]) / 2, atol=1e-6)


def test_cov_selection_kl_cov_and_clip_cov_by_hand():
    adv = _t([[1.0, 1.0, -1.0, -1.0], [2.0, 0.0, 0.0, 9.0]])
    logp = _t([[-0.5, -3.0, -0.5, -3.0], [-0.2, -1.0, -1.0, 7.0]])
    mask = _t([[1, 1, 1, 1], [1, 1, 1, 0]])
    a, lp = adv[mask > 0], logp[mask > 0]
    cov = torch.zeros(2, 4)
    cov[mask > 0] = (a - a.mean()) * (lp - lp.mean())   # token 0 of row 1 is the largest (≈ 1.9)
    k_tokens = cov.flatten().argsort(descending=True)[:2]
    sel = cov_selection(logp, adv, mask, ratio=2 / 7, mode="kl_cov")
    assert sel.sum() == 2 and sel.flatten()[k_tokens].all() and not sel[1, 3]
    band = cov_selection(logp, adv, mask, ratio=1.0, mode="clip_cov", bounds=(0.5, 5.0))
    assert torch.equal(band, (cov > 0.5) & (cov < 5.0) & (mask > 0))  # ratio 1: the whole band
    one = cov_selection(logp, adv, mask, ratio=0.01, mode="clip_cov", bounds=(0.5, 5.0),
                        generator=torch.Generator().manual_seed(3))
    assert one.sum() == 1 and (one <= band).all()       # k = max(1, ⌊0.01·7⌋) drawn from the band


def test_kl_cov_and_clip_cov_losses_and_gradients():
    logp = torch.log(_t([[1.1, 1.5, 0.5]])).requires_grad_()  # ratios (old = 0)
    adv, mask, sel = _t([[1.0, 1.0, -1.0]]), torch.ones(1, 3), torch.tensor([[True, False, True]])
    loss, st = kl_cov_loss(logp, torch.zeros(1, 3), adv, mask, sel, kl_coef=2.0)
    lr = torch.log(_t([[1.1, 1.5, 0.5]]))
    assert torch.allclose(loss, -adv * lr.exp() + 2.0 * lr.abs() * sel, atol=1e-6)
    # d/dlogp: −A·r, plus κ·sign(log r) on the selected tokens
    g = -adv * lr.exp() + 2.0 * torch.sign(lr) * sel
    assert torch.allclose(_grad(loss, logp), g, atol=1e-6) and st["clip"].tolist() == sel.tolist()
    loss, st = clip_cov_loss(logp, torch.zeros(1, 3), adv, mask, sel, 0.2, 0.2)
    # token 1 (r = 1.5 > 1.2) is PPO-clipped; tokens 0 and 2 are detached by selection: all grads 0
    assert torch.equal(_grad(loss, logp), torch.zeros(1, 3)) and loss[0, 1].item() == pytest.approx(-1.2)
    assert loss[0, 0] == 0 and loss[0, 2] == 0 and st["clip"].all()
    loss, _ = clip_cov_loss(logp, torch.zeros(1, 3), adv, mask, torch.zeros(1, 3, dtype=torch.bool))
    assert _grad(loss, logp)[0, 0].item() == pytest.approx(-1.1)  # unselected: PPO's gradient


def test_top_entropy_mask_keeps_the_top_q_of_valid_tokens():
    ent = _t([[0.1, 2.0, 0.5, 9.0], [1.5, 0.2, 3.0, 0.0]])
    mask = _t([[1, 1, 1, 0], [1, 1, 1, 1]])          # 9.0 is padding: never picked
    keep = top_entropy_mask(ent, mask, 0.2)           # ⌈0.2·7⌉ = 2: entropies 3.0 and 2.0
    assert keep.tolist() == [[False, True, False, False], [False, False, True, False]]
    assert top_entropy_mask(ent, mask, 1.0).tolist() == (mask > 0).tolist()


def test_weights_multiply_the_policy_loss_only():
    logp = _t([[-0.5, -1.0]], grad=True)
    w, kl = _t([[2.0, 0.0]]), _t([[0.3, 0.3]])
    loss, m = total_loss(LossConfig(kl_coef=1.0, dual_clip=None), logp, logp.detach(), torch.ones(1, 2),
                         torch.ones(1, 2), kl=kl, weights=w)
    assert m["pg_loss"].item() == pytest.approx(-1.0) and loss.item() == pytest.approx(-1.0 + 0.3)
    assert torch.allclose(_grad(loss.unsqueeze(0), logp), _t([[-1.0, 0.0]]))
    assert m["kl_ref"].item() == pytest.approx(0.3)


def test_value_loss_clipping_by_hand():
    values = _t([[1.5, 1.1, 0.5]], grad=True)
    old, ret = _t([[1.0, 1.0, 1.0]]), _t([[2.0, 2.0, 0.0]])
    loss, stats = value_loss(values, old, ret, torch.ones(1, 3), clip=0.2)
    # 1: clipped V 1.2 -> (0.8)^2 = 0.64 beats 0.25 -> 0.32, grad 0
    # 2: inside the clip -> ½(0.9)^2 = 0.405, grad (V - R) = -0.9
    # 3: clipped V 0.8 -> 0.64 beats 0.25 -> 0.32, grad 0
    assert torch.allclose(loss, _t([[0.32, 0.405, 0.32]]), atol=1e-6)
    assert torch.allclose(_grad(loss, values), _t([[0.0, -0.9, 0.0]]), atol=1e-6)
    assert stats["clip"].tolist() == [[True, False, True]]
    loss, _ = value_loss(values, old, ret, torch.ones(1, 3), clip=None)
    assert torch.allclose(loss, _t([[0.125, 0.405, 0.125]]), atol=1e-6)


# rows of length 3, 1, 2 and an empty row; NaN wherever the mask is 0
RAGGED = [[1.0, 2.0, 3.0], [4.0, NAN, INF], [5.0, 6.0, NAN], [NAN, NAN, NAN]]
RAGGED_MASK = [[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]]


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 21 / 6),                   # (1+2+3+4+5+6) / 6 tokens
    ("token-sum", 21.0),                      # verl's token-sum: no denominator
    ("seq-mean-token-sum", (6 + 4 + 11) / 3),  # 3 non-empty sequences
    ("seq-mean-token-mean", (2 + 4 + 5.5) / 3),
    ("seq-mean-token-sum-norm", 21 / (3 * 3)),  # L defaults to T = 3
])
def test_aggregation_modes_on_ragged_lengths(mode, expected):
    assert aggregate(_t(RAGGED), _t(RAGGED_MASK), mode).item() == pytest.approx(expected)


def test_aggregation_norm_len_global_denominators_and_errors():
    assert aggregate(_t(RAGGED), _t(RAGGED_MASK), "seq-mean-token-sum-norm",
                     norm_len=4).item() == pytest.approx(21 / 12)
    assert aggregate(_t(RAGGED), _t(RAGGED_MASK), "token-mean", num_tokens=42).item() == pytest.approx(0.5)
    assert global_denominators(_t(RAGGED_MASK)) == (6, 3)
    for mode in AGG_MODES:
        assert aggregate(_t(RAGGED), torch.zeros(4, 3), mode).item() == 0.0
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate(_t(RAGGED), _t(RAGGED_MASK), "sum")
    with pytest.raises(ValueError, match="shape"):
        aggregate(torch.zeros(4, 2), _t(RAGGED_MASK))


def _batch(B=8, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T) < lengths[:, None]).float()
    logp = -torch.rand(B, T, generator=g) * 3 - 0.01
    return dict(
        logp=logp, old_logp=logp + 0.3 * torch.randn(B, T, generator=g), mask=mask,
        advantages=torch.randn(B, 1, generator=g).expand(B, T).clone(),
        rollout_logp=logp + 0.3 * torch.randn(B, T, generator=g),
        entropy=torch.rand(B, T, generator=g), kl_ref=logp - 0.2 * torch.rand(B, T, generator=g),
        values=torch.randn(B, T, generator=g), old_values=torch.randn(B, T, generator=g),
        returns=torch.randn(B, T, generator=g), weights=torch.rand(B, T, generator=g) * 2)


def _run(cfg, b, rows, num_tokens=None, num_seqs=None, poison=False):
    """total_loss on a row subset, trimmed to its longest row (as PaddedBatch.select does)."""
    mask = b["mask"][rows]
    width = max(int(mask.sum(-1).max()), 1)
    s = {k: v[rows][:, :width].clone() for k, v in b.items()}
    if poison:  # NaN / inf wherever the mask is 0: nothing may leak
        for k in s:
            if k != "mask":
                s[k] = torch.where(s["mask"] > 0, s[k],
                                   torch.full_like(s[k], NAN if k != "advantages" else INF))
    logp = s["logp"].requires_grad_()
    values = s["values"].requires_grad_()
    kl = kl_estimator(logp, s["kl_ref"], "k3+", mask=s["mask"])
    sel = None
    if cfg.policy in COV_LOSSES:  # selected once over the whole step, as the trainer does
        full = cov_selection(b["logp"], b["advantages"], b["mask"], 0.1, cfg.policy, bounds=(-9.0, 9.0),
                             generator=torch.Generator().manual_seed(0))
        sel = full[rows][:, :width]
    loss, metrics = total_loss(cfg, logp, s["old_logp"], s["advantages"], s["mask"], entropy=s["entropy"],
                               kl=kl,
                               rollout_logp=s["rollout_logp"], values=values, old_values=s["old_values"],
                               returns=s["returns"], weights=s["weights"], selected=sel,
                               num_tokens=num_tokens, num_seqs=num_seqs)
    g_logp, g_values = torch.autograd.grad(loss, (logp, values), allow_unused=True)
    return loss, metrics, g_logp, g_values


CFG = dict(kl_coef=0.1, entropy_coef=0.01, vf_coef=0.5, norm_len=12)


@pytest.mark.parametrize("policy", list(POLICY_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_sum_to_full_batch(policy, mode):
    b = _batch()
    cfg = LossConfig(policy=policy, agg_mode=mode, **CFG)
    full, _, g_full, gv_full = _run(cfg, b, list(range(8)))
    n_tok, n_seq = global_denominators(b["mask"])
    parts = [[0, 1, 2], [3, 4, 5], [6, 7]]
    outs = [_run(cfg, b, rows, n_tok, n_seq) for rows in parts]
    assert sum(o[0] for o in outs).item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
    for rows, o in zip(parts, outs):  # the gradient of each row is the full-batch one
        w = o[2].shape[1]
        assert torch.allclose(o[2], g_full[rows][:, :w], atol=1e-6)
        assert torch.allclose(o[3], gv_full[rows][:, :w], atol=1e-6)


def test_local_denominators_break_gradient_accumulation():
    """Why the global denominators exist (TRL #3021): averaging per-micro-batch token means
    over-weights tokens in short micro-batches."""
    b = _batch()
    cfg = LossConfig(agg_mode="token-mean")
    full = _run(cfg, b, list(range(8)))[0]
    local = sum(_run(cfg, b, rows)[0] for rows in ([0, 1, 2], [3, 4, 5], [6, 7])) / 3
    assert abs(local.item() - full.item()) > 1e-3


@pytest.mark.parametrize("policy", list(POLICY_LOSSES))
def test_nan_in_masked_positions_never_reaches_loss_grad_or_metrics(policy):
    b = _batch(seed=1)
    cfg = LossConfig(policy=policy, **CFG)
    clean = _run(cfg, b, list(range(8)))
    loss, metrics, g, gv = _run(cfg, b, list(range(8)), poison=True)
    assert torch.isfinite(loss) and torch.isfinite(g).all() and torch.isfinite(gv).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    assert loss.item() == pytest.approx(clean[0].item(), rel=1e-5)
    mask = b["mask"][:, : g.shape[1]]
    assert (g[mask == 0] == 0).all() and torch.allclose(g, clean[2], atol=1e-6)


def test_all_zero_mask_gives_finite_zero():
    b = _batch()
    b["mask"] = torch.zeros_like(b["mask"])
    for mode in AGG_MODES:
        loss, metrics, g, gv = _run(LossConfig(agg_mode=mode, **CFG), b, list(range(8)), poison=True)
        assert loss.item() == 0.0 and (g == 0).all() and (gv == 0).all()
        assert all(torch.isfinite(v) for v in metrics.values())


def test_total_loss_metrics_by_hand():
    logp = torch.log(_t([RATIOS])).requires_grad_()
    rollout = _t([[0.1, -0.3, 0.0, 0.0, 0.0, 0.0]])
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, entropy_coef=0.1, kl_coef=0.5)
    entropy, kl = torch.full((1, 6), 2.0), torch.full((1, 6), 0.4)
    loss, m = total_loss(cfg, logp, torch.zeros(1, 6), _t([ADV]), torch.ones(1, 6), entropy=entropy, kl=kl,
                         rollout_logp=rollout)
    pg = (-1.1 - 1.28 + 0.8 + 1.5 + 3.0 - 0.5) / 6
    assert m["pg_loss"].item() == pytest.approx(pg, abs=1e-6)
    assert loss.item() == pytest.approx(pg - 0.1 * 2.0 + 0.5 * 0.4, abs=1e-6)
    assert m["kl_loss"].item() == pytest.approx(0.4) and m["entropy"].item() == pytest.approx(2.0)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 6)
    assert m["pg_clipfrac_high"].item() == pytest.approx(1 / 6)
    assert m["pg_clipfrac_low"].item() == pytest.approx(1 / 6)
    assert m["dual_clipfrac"].item() == pytest.approx(1 / 6)
    assert m["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in RATIOS) / 6, abs=1e-6)
    assert m["ratio_mean"].item() == pytest.approx(sum(RATIOS) / 6, abs=1e-6)
    assert m["ratio_max"].item() == pytest.approx(5.0)
    assert m["logprob_diff_abs"].item() == pytest.approx(0.4 / 6, abs=1e-6)
    assert m["logprob_diff_abs_max"].item() == pytest.approx(0.3, abs=1e-6)
    assert m["num_tokens"].item() == 6 and all(not v.requires_grad for v in m.values())


def test_bad_input_gives_clear_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'.*ppo, gspo, cispo, gmpo, dppo_tv, "
                                         "dppo_kl"):
        total_loss(LossConfig(policy="ppo2"), z, z, z, torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages has shape"):
        total_loss(LossConfig(), z, z, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask must be"):
        ppo_clip_loss(z, z, z, torch.ones(3))
    with pytest.raises(ValueError, match="`selected` is for kl_cov / clip_cov"):
        total_loss(LossConfig(), z, z, z, torch.ones(2, 3), selected=z.bool())
    with pytest.raises(ValueError, match="old_values and returns"):
        total_loss(LossConfig(), z, z, z, torch.ones(2, 3), values=z)


def test_module_is_self_contained(copied_alone):
    """losses.py imports only torch + stdlib and, copied alone into an empty folder, loads and runs."""
    mod = copied_alone("losses")
    z = torch.zeros(2, 3)
    loss, _ = mod.total_loss(mod.LossConfig(), z, z, torch.ones(2, 3), torch.ones(2, 3))
    assert loss.item() == pytest.approx(-1.0)
