"""Tests for nanorl/entropy.py and nanorl/entropy_triton.py: the Triton kernels (run in the interpreter,
see conftest.py), the chunked torch fallback and the fused-linear path, all against a float64
log_softmax reference.

Run: python -m pytest tests/test_entropy.py -q
"""
import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import nanorl
from nanorl import entropy as E, entropy_triton as ET

BACKENDS = ["triton", "torch"] if E.TRITON_INTERPRETED else ["torch"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Blocks of 256 so V = 1001 / 4096 take 4 / 16 steps of the online max (1001: masked tail)."""
    monkeypatch.setattr(ET, "_MAX_BLOCK_V", 256)


def reference(logits, targets, temperature=1.0, keep=None, ignore_index=-100):
    """float64 log_softmax reference; keep [N, V] bool applied with masked_fill."""
    z = logits.double() / temperature
    if keep is not None:
        z = z.masked_fill(~keep, NEG_INF)
    logp = torch.log_softmax(z, -1)
    live = z != NEG_INF
    logp0 = torch.where(live, logp, 0.0)
    ent = -(logp0.exp() * live * logp0).sum(-1)
    ignored = targets == ignore_index
    lp = logp.gather(1, torch.where(ignored, 0, targets)[:, None]).squeeze(1)
    return torch.where(ignored, 0.0, lp), torch.where(ignored, 0.0, ent)


def grads_of(fn, inputs, g_lp, g_ent):
    """Gradient of Σ g_lp·logprob + g_ent·entropy with respect to each input."""
    lp, ent = fn(*inputs)
    loss = (g_lp.to(lp.dtype) * lp).sum() + (g_ent.to(ent.dtype) * ent).sum()
    return (lp, ent), torch.autograd.grad(loss, inputs)


def make_case(N, V, scale=3.0):
    """Random logits: −inf columns in row 1, an ignore_index row 2, row 3's first block all −inf and
    row 0's max in its last column (the running max moves late); targets on live columns."""
    x = torch.randn(N, V) * scale
    x[1, 1::2] = NEG_INF                      # half of row 1 masked out (incl. the padded tail block)
    x[0, -1] += 4 * scale
    x[3, : min(V - 1, 256)] = NEG_INF         # (−inf) − (−inf) guard of the first block
    t = torch.randint(0, V, (N,))
    t[1], t[2], t[3] = 0, -100, V - 1
    return x, t


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("V", [7, 1001, 4096])
def test_forward_backward_match_reference(V, backend):
    x, t = make_case(5, V)
    g_lp, g_ent = torch.randn(5), torch.randn(5)
    T = 0.7
    (lp, ent), (g,) = grads_of(lambda a: E.logprobs_and_entropy(a, t, T, backend=backend),
                               [x.clone().requires_grad_()], g_lp, g_ent)
    (lp_r, ent_r), (g_r,) = grads_of(lambda a: reference(a, t, T), [x.double().requires_grad_()],
                                     g_lp, g_ent)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ent_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(g.double(), g_r, atol=1e-5, rtol=0)
    assert not torch.isnan(g).any()
    assert (g[1, 1::2] == 0).all()                      # −inf columns: exactly zero gradient
    assert lp[2] == 0 and ent[2] == 0 and (g[2] == 0).all()  # ignore_index row


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed_values(backend):
    # Row 0: uniform over 5 → H = log 5, logprob = −log 5. Row 1: logits [0, log 3] at T = 1 →
    # p = [1/4, 3/4]. Row 2: the same row at T = 2 → logits/2 = [0, log √3], p = [1/(1+√3), √3/(1+√3)].
    x = torch.tensor([[2.0] * 5, [0.0, math.log(3), NEG_INF, NEG_INF, NEG_INF],
                      [0.0, math.log(3), NEG_INF, NEG_INF, NEG_INF]])
    t = torch.tensor([4, 1, 0])
    lp01, ent01 = E.logprobs_and_entropy(x[:2], t[:2], 1.0, backend=backend)
    lp2, ent2 = E.logprobs_and_entropy(x[2:], t[2:], 2.0, backend=backend)
    q = 1 / (1 + math.sqrt(3))
    expect_lp = [-math.log(5), math.log(0.75), math.log(q)]
    expect_ent = [math.log(5), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)),
                  -(q * math.log(q) + (1 - q) * math.log(1 - q))]
    torch.testing.assert_close(torch.cat([lp01, lp2]), torch.tensor(expect_lp), atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([ent01, ent2]), torch.tensor(expect_ent), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_keep_entropy_precise(backend):
    # Logits near 1000 (fp32 ulp ≈ 6e-5) and a fairly peaked row: lse − Σ p·x in fp32 is off by
    # ~1e-4; accumulating about the running max (Triton) / −Σ p log p (torch) stays within 2e-6.
    x = 1000.0 + torch.randn(3, 1001) * 2.0
    x[:, 5] += 12.0
    t = torch.tensor([5, 0, 7])
    lp, ent = E.logprobs_and_entropy(x, t, backend=backend)
    lp_r, ent_r = reference(x, t)
    cancelling = torch.logsumexp(x, -1) - (torch.softmax(x, -1) * x).sum(-1)
    assert (cancelling.double() - ent_r).abs().max() > 2e-5          # the trap is real here
    torch.testing.assert_close(ent.double(), ent_r, atol=2e-6, rtol=0)
    torch.testing.assert_close(lp.double(), lp_r, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs(backend):
    # Math runs in fp32 from exact bf16 inputs, so values match to fp32 accuracy; the bf16 gradient
    # may differ from the rounded reference by 1 ulp (relative 2^-7): the interpreter truncates.
    x, t = make_case(4, 1001)
    x = x.bfloat16()
    g_lp, g_ent = torch.randn(4), torch.randn(4)
    (lp, ent), (g,) = grads_of(lambda a: E.logprobs_and_entropy(a, t, 0.9, backend=backend),
                               [x.clone().requires_grad_()], g_lp, g_ent)
    (lp_r, ent_r), (g_r,) = grads_of(lambda a: reference(a, t, 0.9), [x.double().requires_grad_()],
                                     g_lp, g_ent)
    assert g.dtype == torch.bfloat16 and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ent_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(g.double(), g_r, atol=1e-6, rtol=2 ** -7)


def _support_case(N=6, V=50, K=4):
    support = torch.stack([torch.randperm(V)[:K] for _ in range(N)])  # [N, K]
    support[1, 2:] = -1                       # padded row: 2 kept ids
    support[3] = -1                           # all -1: unrestricted
    support[4, 1] = support[4, 0]             # duplicate id: harmless
    keep = torch.zeros(N, V, dtype=torch.bool)
    for i in range(N):
        ids = support[i][support[i] >= 0]
        keep[i, ids] = True
        if len(ids) == 0:
            keep[i] = True
    t = torch.tensor([int(support[i, 0]) if support[i, 0] >= 0 else 3 for i in range(N)])
    t[5] = -100
    return support, keep, t


@pytest.mark.parametrize("backend", BACKENDS)
def test_support_mask_equals_masked_fill_reference(backend):
    support, keep, t = _support_case()
    x = torch.randn(6, 50)
    g_lp, g_ent = torch.randn(6), torch.randn(6)
    (lp, ent), (g,) = grads_of(lambda a: E.logprobs_and_entropy(a, t, 1.3, support, backend=backend),
                               [x.clone().requires_grad_()], g_lp, g_ent)
    (lp_r, ent_r), (g_r,) = grads_of(lambda a: reference(a, t, 1.3, keep),
                                     [x.double().requires_grad_()], g_lp, g_ent)
    torch.testing.assert_close(lp.double(), lp_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ent_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(g.double(), g_r, atol=1e-5, rtol=0)
    assert (g[~keep] == 0).all() and not torch.isnan(g).any()
    torch.testing.assert_close(ent[1].double(), ent_r[1])   # 2 kept tokens: entropy ≤ log 2
    assert ent[1] <= math.log(2) + 1e-6
    lp_n, ent_n = E.naive_logprobs_entropy(x, t, 1.3, support)
    torch.testing.assert_close(lp_n.double(), lp_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_n.double(), ent_r, atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: log(0) in the dead row, by design
@pytest.mark.parametrize("backend", BACKENDS)
def test_target_outside_support_and_dead_row_never_nan(backend):
    x = torch.randn(2, 9)
    x[1] = NEG_INF                            # a row with nothing left: entropy 0, logprob −inf
    support = torch.tensor([[0, 1, -1], [-1, -1, -1]])
    t = torch.tensor([5, 2])                  # row 0's target 5 is outside its support
    xg = x.clone().requires_grad_()
    lp, ent = E.logprobs_and_entropy(xg, t, 1.0, support, backend=backend)
    assert lp.tolist() == [NEG_INF, NEG_INF]
    assert abs(ent[0].item() - reference(x, t, 1.0, torch.arange(9)[None] < 2)[1][0].item()) < 1e-6
    assert ent[1] == 0
    (g,) = torch.autograd.grad(ent.sum() + lp.clamp(min=-20).sum(), xg)
    assert not torch.isnan(g).any() and (g[0, 2:] == 0).all() and (g[1] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_matches_naive(backend, dtype, monkeypatch):
    N, H, V, chunk = 13, 16, 1001, 4          # 4 chunks, the last one partial
    hidden, weight, bias = torch.randn(N, H), torch.randn(V, H) / 4, torch.randn(V) / 4
    hidden, weight, bias = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
    t = torch.randint(0, V, (N,))
    t[3] = -100
    support = torch.full((N, 5), -1)
    support[0] = torch.tensor([t[0].item(), 1, 2, 3, 4])   # one restricted row
    g_lp, g_ent = torch.randn(N), torch.randn(N)
    seen_rows = []
    rows = E.ROWS[backend]
    monkeypatch.setitem(E.ROWS, backend, rows._replace(
        forward=lambda x, *a: seen_rows.append(x.shape[0]) or rows.forward(x, *a)))
    ins = [a.clone().requires_grad_() for a in (hidden, weight, bias)]
    (lp, ent), grads = grads_of(
        lambda h, w, b: E.fused_linear_logprobs_entropy(h, w, t, 0.8, support, chunk_size=chunk, bias=b,
                                                        backend=backend), ins, g_lp, g_ent)
    assert seen_rows == [4, 4, 4, 1]           # the [N, V] logits never exist at once
    ref_ins = [a.double().requires_grad_() for a in (hidden, weight, bias)]
    keep = E._support_keep(support, V)
    (lp_r, ent_r), grads_r = grads_of(lambda h, w, b: reference(h @ w.T + b, t, 0.8, keep), ref_ins,
                                      g_lp, g_ent)
    tol = dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(lp.double(), lp_r, **tol)
    torch.testing.assert_close(ent.double(), ent_r, **tol)
    for got, want in zip(grads, grads_r):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, **tol)
    if dtype == torch.float32:                 # same answer as the materialised path, to fp32 noise
        lp_n, ent_n = E.naive_logprobs_entropy(hidden @ weight.T + bias, t, 0.8, support)
        torch.testing.assert_close(lp, lp_n, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ent_n, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sum_sq_probs_is_a_by_product_of_the_same_pass(backend, monkeypatch):
    """Σ_v π_v² (the optimal token baseline's ||∇_z log π||² = 1 − 2π_y + Σπ²) from the fused pass,
    chunked, with a support row and an ignored row, against softmax(z / T)² summed by hand; asking
    for it changes neither the logprobs nor the gradients."""
    monkeypatch.setattr(ET, "_MAX_BLOCK_V", 64)  # 5 vocabulary blocks: the running max moves between them
    N, H, V = 9, 8, 300
    hidden, weight = torch.randn(N, H), torch.randn(V, H)
    weight[-1] = hidden[0] * 3                  # row 0's largest logit sits in the last block
    t = torch.randint(0, V, (N,))
    t[4] = -100
    support = torch.full((N, 3), -1)
    support[2] = torch.tensor([t[2].item(), 5, 6])
    h = hidden.clone().requires_grad_()
    lp, ent, sq = E.fused_linear_logprobs_entropy(h, weight, t, 0.7, support, chunk_size=4, backend=backend,
                                                  sum_sq=True)
    z = (hidden @ weight.T) / 0.7
    z[2] = z[2].masked_fill(~E._support_keep(support[2:3], V)[0], NEG_INF)
    hand = (z.softmax(-1) ** 2).sum(-1)
    hand[4] = 0.0
    torch.testing.assert_close(sq, hand, atol=1e-6, rtol=1e-5)
    assert not sq.requires_grad
    (g,) = torch.autograd.grad((lp + ent).sum(), h)
    h2 = hidden.clone().requires_grad_()
    lp2, ent2 = E.fused_linear_logprobs_entropy(h2, weight, t, 0.7, support, chunk_size=4, backend=backend)
    (g2,) = torch.autograd.grad((lp2 + ent2).sum(), h2)
    assert torch.equal(lp, lp2) and torch.equal(g, g2)
    _, _, sq_n = E.naive_logprobs_entropy(hidden @ weight.T, t, 0.7, support, sum_sq=True)
    torch.testing.assert_close(sq_n, hand, atol=1e-6, rtol=1e-5)


def test_fused_linear_chunk_size_from_budget(monkeypatch):
    monkeypatch.setattr(E, "_LINEAR_BUDGET_BYTES", 10 * 100 * 4)   # 10 fp32 rows of V = 100
    assert E._chunk_rows(100, 4, False, None) == 10
    assert E._chunk_rows(100, 2, True, None) == 13                  # bf16 logits + bool mask
    assert E._chunk_rows(100, 4, False, 3) == 3
    hidden, weight, t = torch.randn(25, 8), torch.randn(100, 8), torch.randint(0, 100, (25,))
    lp, ent = E.fused_linear_logprobs_entropy(hidden, weight, t, backend="torch")
    lp_r, ent_r = reference(hidden @ weight.T, t)
    torch.testing.assert_close(lp.double(), lp_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ent_r, atol=1e-5, rtol=0)


def test_torch_fallback_chunks_rows(monkeypatch):
    monkeypatch.setattr(E, "_ROW_BUDGET_BYTES", 3 * 16 * 64)        # 3 rows of V = 64 per chunk
    assert E._row_chunks(7, 64) == [(0, 3), (3, 6), (6, 7)]
    x, t = make_case(7, 64)
    g_lp, g_ent = torch.randn(7), torch.randn(7)
    (lp, ent), (g,) = grads_of(lambda a: E.logprobs_and_entropy(a, t, 1.5, backend="torch"),
                               [x.clone().requires_grad_()], g_lp, g_ent)
    (lp_r, ent_r), (g_r,) = grads_of(lambda a: reference(a, t, 1.5), [x.double().requires_grad_()],
                                     g_lp, g_ent)
    torch.testing.assert_close(lp.double(), lp_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(g.double(), g_r, atol=1e-5, rtol=0)


def test_bad_input_raises():
    x, t = torch.randn(3, 10), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="temperature"):
        E.logprobs_and_entropy(x, t, 0.0)
    with pytest.raises(ValueError, match="out of range"):
        E.logprobs_and_entropy(x, torch.tensor([1, 2, 10]))
    with pytest.raises(ValueError, match="targets must have shape"):
        E.logprobs_and_entropy(x, t[:2])
    with pytest.raises(ValueError, match="support ids"):
        E.logprobs_and_entropy(x, t, support=torch.tensor([[1], [2], [10]]))
    with pytest.raises(ValueError, match="dtypes differ"):
        E.fused_linear_logprobs_entropy(torch.randn(3, 4), torch.randn(10, 4).double(), t)
    with pytest.raises(ValueError, match="backend"):
        E.logprobs_and_entropy(x, t, backend="cuda")


def test_dispatch_on_cpu():
    x = torch.randn(2, 5)
    assert E._backend(x) == ("triton" if E.TRITON_INTERPRETED else "torch")


@pytest.mark.skipif(not E.HAS_TRITON, reason="triton is not installed: no kernel is launched")
def test_kernels_launch_on_their_tensors_device(monkeypatch):
    """M2 (issue 45): Triton launches on torch's current CUDA device, not the tensors'; both launches
    must run inside torch.cuda.device(x.device). No GPU here: the guard and the kernels are recorders
    (the guard's own choice is checked below on a fake cuda:1 tensor, the launches on CPU tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    entered, launches = [], []

    class Device:  # stands in for torch.cuda.device: records where it would switch to
        def __init__(self, device):
            self.device = torch.device(device)

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.pop()

    monkeypatch.setattr(torch.cuda, "device", Device)
    with FakeTensorMode():
        on_gpu1 = torch.empty(3, 5, device="cuda:1")                          # [N, V], no storage
    guard = ET._launch_guard(on_gpu1)
    assert isinstance(guard, Device) and guard.device == torch.device("cuda", 1)
    assert not isinstance(ET._launch_guard(torch.empty(3, 5)), Device)     # CPU / interpreter: none

    class Kernel:  # kernel[grid](...) records the device in force at the launch
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, list(entered)))

    monkeypatch.setattr(ET, "_launch_guard", lambda x: Device(x.device))
    monkeypatch.setattr(ET, "_fwd_kernel", Kernel("fwd"))
    monkeypatch.setattr(ET, "_bwd_kernel", Kernel("bwd"))
    x, t = torch.randn(3, 5), torch.tensor([0, 1, 2])                        # [N, V], [N]
    _, ent, norm, _ = ET.triton_forward(x, t, 1.0, -100)
    ET.triton_backward(x, t, norm, ent, torch.ones(3), torch.ones(3), 1.0, -100, torch.empty_like(x))
    assert launches == [("fwd", [x.device]), ("bwd", [x.device])]


def _run_python(code, **env):
    full_env = dict(os.environ, PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_module_works_without_triton(monkeypatch):
    # Load a second copy of the module while `import triton` raises ImportError.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.delitem(sys.modules, "nanorl.entropy_triton")  # imported again, without triton
    monkeypatch.setattr(nanorl, "entropy_triton", ET)  # the package attribute the import rebinds
    spec = importlib.util.spec_from_file_location("entropy_no_triton", E.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    x = torch.zeros(1, 4, requires_grad=True)
    assert not mod.HAS_TRITON and mod._backend(x) == "torch"
    lp, ent = mod.logprobs_and_entropy(x, torch.tensor([2]))
    lp.sum().backward()
    assert abs(lp.item() + math.log(4)) < 1e-6 and abs(ent.item() - math.log(4)) < 1e-6
    torch.testing.assert_close(x.grad, torch.tensor([[-0.25, -0.25, 0.75, -0.25]]))


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton", reason="triton is not installed: nothing to compile")
    # Compiled in a fresh process: under TRITON_INTERPRET=1 triton's own @jit helpers (tl.max, ...)
    # are interpreter objects and cannot be lowered. GPUTarget(backend, arch, warp_size=32) = Hopper.
    out = _run_python("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from nanorl import entropy_triton as ET
        target = GPUTarget("cuda", 90, 32)
        options = triton.compiler.make_backend(target).parse_options({"num_warps": 8}).__dict__
        common = {"V": "i32", "inv_temp": "fp32", "ignore_index": "i32", "BLOCK_V": "constexpr"}
        for dt in ("bf16", "fp32"):
            fwd = {"x_ptr": f"*{dt}", "stride_x": "i64", "tgt_ptr": "*i64", "lp_ptr": "*fp32",
                   "ent_ptr": "*fp32", "m_ptr": "*fp32", "ls_ptr": "*fp32", "sq_ptr": "*fp32", **common,
                   "WITH_SQ": "constexpr"}
            bwd = {"x_ptr": f"*{dt}", "stride_x": "i64", "g_ptr": f"*{dt}", "stride_g": "i64",
                   "tgt_ptr": "*i64", "m_ptr": "*fp32", "ls_ptr": "*fp32", "ent_ptr": "*fp32",
                   "glp_ptr": "*fp32", "gent_ptr": "*fp32", **common}
            variants = [(ET._fwd_kernel, fwd, {"WITH_SQ": sq})
                        for sq in ((False, True) if dt == "bf16" else (True,))]
            for kernel, sig, extra in variants + [(ET._bwd_kernel, bwd, {})]:
                src = ASTSource(kernel, sig, constexprs={"BLOCK_V": ET._MAX_BLOCK_V, **extra})
                compiled = triton.compile(src, target=target, options=options)
                assert len(compiled.asm["cubin"]) > 0 and ".target sm_90" in compiled.asm["ptx"]
                print(compiled.metadata.name, dt, "ok")
    """, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(" ok") == 5
