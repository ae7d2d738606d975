"""Per-token log-probability and entropy without materialising the [tokens, vocab] probabilities.

Link 3 of the chain (logprob recompute of the old, reference and current policy) and its backward. For
each response token: logprob = log softmax(x / T)[y] of the sampled token y and the entropy
H = −Σ_j p_j log p_j, with T the sampling temperature (the trainer scores tokens under the distribution
the rollout sampled from); done naively the fp32 [N, V] temporaries are the largest activation of LLM RL.
Start at `fused_linear_logprobs_entropy` (hidden @ weightᵀ a chunk of tokens at a time, only one
[chunk, V] block alive) and `logprobs_and_entropy` (from logits); both run one `autograd.Function` whose
per-row math has two backends (`_backend`, chosen once per call): the Triton kernels
(nanorl/entropy_triton.py) and the chunked torch twin here. Key choices: one pass with
an online max, entropy accumulated about the running max (stable for large, peaked logits), an optional
support mask (KSM: ids outside it are −inf), Σπ² in the same pass on request. The math, the backends and
the comparison with verl's entropy: docs/from-slime-verl.md, "nanorl/entropy.py".

Test: python -m pytest tests/test_entropy.py -q   (runs the Triton kernels in the interpreter)
"""
import math
from typing import Callable, NamedTuple

import torch

# triton: the module or None (gpu_check.py reports its version)
from nanorl.entropy_triton import (  # noqa: F401
    HAS_TRITON,
    TRITON_INTERPRETED,
    triton,
    triton_backward,
    triton_forward,
)

# torch path: fp32 temporaries per row chunk (~4 live [rows, V])
_ROW_BUDGET_BYTES = 64 << 20
# fused-linear: bytes of one chunk's logits (+ its support mask)
_LINEAR_BUDGET_BYTES = 256 << 20
# torch path: stands in for log p = −inf where p = 0
_FAR = -1e20

# ----------------------------------------------------------------------------------------------------
# Chunked torch: the same formulas, a few rows at a time so fp32 temporaries stay bounded.
def _row_chunks(N, V):
    step = max(1, _ROW_BUDGET_BYTES // (4 * 4 * max(V, 1)))
    return [(i, min(i + step, N)) for i in range(0, N, step)]


def _z(x_chunk, inv_temp):
    # no copy when already fp32
    z = x_chunk.float()
    return z * inv_temp if inv_temp != 1.0 else z


def _torch_forward(x, targets, inv_temp, ignore_index, want_sq=False):
    N, V = x.shape
    lp, ent = (torch.empty(N, device=x.device, dtype=torch.float32) for _ in range(2))
    # rows: m, ls (lse = m + ls)
    norm = torch.empty(2, N, device=x.device, dtype=torch.float32)
    # Σπ² (OTB)
    sq = torch.empty(N if want_sq else 0, device=x.device, dtype=torch.float32)
    for a, b in _row_chunks(N, V):
        z = _z(x[a:b], inv_temp)                                         # [n, V]
        m = z.amax(1)                                                    # [n]
        # guard (−inf) − (−inf)
        m = torch.where(torch.isneginf(m), 0.0, m)
        logp = z - m[:, None]                                            # [n, V]
        # 0 on −inf columns
        p = logp.exp()
        s = p.sum(1)                                                     # [n], 0 for a dead row
        # lse = m + ls
        ls = torch.where(s > 0, s.log(), 0.0)
        p.div_(torch.where(s > 0, s, 1.0)[:, None])
        ignored = targets[a:b] == ignore_index
        if want_sq:
            sq[a:b] = torch.where(ignored, 0.0, (p * p).sum(1))
        # Clamped far below any real log-prob: p·logp is then 0·finite, not 0·(−inf) = NaN.
        logp.sub_(ls[:, None]).clamp_(min=_FAR)
        z_t = z.gather(1, torch.where(ignored, 0, targets[a:b])[:, None]).squeeze(1)
        lp_c = torch.where(z_t == float("-inf"), float("-inf"), (z_t - m) - ls)
        lp[a:b] = torch.where(ignored, 0.0, lp_c)
        ent[a:b] = torch.where(ignored, 0.0, -(p * logp).sum(1))
        norm[0, a:b], norm[1, a:b] = m, ls
    return lp, ent, norm, sq


def _torch_backward(x, targets, norm, ent, g_lp, g_ent, inv_temp, ignore_index, out):
    for a, b in _row_chunks(*x.shape):
        z = _z(x[a:b], inv_temp)                                         # [n, V]
        t = targets[a:b]
        active = t != ignore_index
        # Per-row scalars, so the [n, V] work is p·(c0 + c1·log p) (−inf columns: p = 0 → 0).
        gl = torch.where(active, g_lp[a:b], 0.0) * inv_temp              # [n]
        ge = torch.where(active, g_ent[a:b], 0.0) * inv_temp             # [n]
        logp = (z - norm[0, a:b, None]).sub_(norm[1, a:b, None])         # [n, V]
        p = logp.exp()
        grad = logp.clamp_(min=_FAR).mul_(-ge[:, None]).add_((-gl - ge * ent[a:b])[:, None]).mul_(p)
        t_safe = torch.where(active, t, 0)[:, None]
        live_t = z.gather(1, t_safe).squeeze(1) != float("-inf")
        # the δ_jy term
        grad.scatter_add_(1, t_safe, torch.where(live_t, gl, 0.0)[:, None])
        out[a:b] = grad
    return out


# Auto-dispatch can be overridden process-wide: the test suite sets "torch" outside the kernel tests,
# because TRITON_INTERPRET=1 (needed before triton's first import) would otherwise route every
# trainer forward through the slow interpreter.
DEFAULT_BACKEND: str | None = None


def _backend(x, backend=None):
    backend = backend if backend is not None else DEFAULT_BACKEND
    if backend is not None:
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
        if backend == "triton" and not (HAS_TRITON and (x.is_cuda or TRITON_INTERPRETED)):
            raise ValueError("backend='triton' needs triton and a CUDA tensor or TRITON_INTERPRET=1")
        return backend
    return "triton" if HAS_TRITON and (x.is_cuda or TRITON_INTERPRETED) else "torch"


class _Rows(NamedTuple):
    """A backend's per-row pair: forward(x, targets, inv_temp, ignore_index, want_sq) -> (logprobs [N],
    entropy [N], norm [2, N], Σπ² [N] if want_sq else [0]); backward(x, targets, norm, ent, g_lp, g_ent,
    inv_temp, ignore_index, out) writes ∂/∂x into out (which may be x itself)."""
    forward: Callable
    backward: Callable


# resolved once per call (`_backend`'s name), not per chunk
ROWS = {"triton": _Rows(triton_forward, triton_backward), "torch": _Rows(_torch_forward, _torch_backward)}


def _grads_or_zeros(g_lp, g_ent, like):
    g_lp = torch.zeros_like(like) if g_lp is None else g_lp.float().contiguous()
    g_ent = torch.zeros_like(like) if g_ent is None else g_ent.float().contiguous()
    return g_lp, g_ent


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, inv_temp, ignore_index, backend):
        rows = ROWS[backend]
        lp, ent, norm, _ = rows.forward(logits, targets, inv_temp, ignore_index)
        ctx.save_for_backward(logits, targets, norm, ent)
        ctx.args = (inv_temp, ignore_index, rows)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, norm, ent = ctx.saved_tensors
        inv_temp, ignore_index, rows = ctx.args
        g_lp, g_ent = _grads_or_zeros(g_lp, g_ent, ent)
        grad = torch.empty_like(logits)
        rows.backward(logits, targets, norm, ent, g_lp, g_ent, inv_temp, ignore_index, grad)
        return grad, None, None, None, None


# ----------------------------------------------------------------------------------------------------
# Input checks and the support mask.
def _check(logits_shape, targets, temperature, support, ignore_index):
    N, V = logits_shape
    if targets.dim() != 1 or targets.shape[0] != N:
        raise ValueError(f"targets must have shape [{N}], got {list(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if not (isinstance(temperature, (int, float)) and temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature!r}")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
    if bool(bad.any()):
        raise ValueError(f"targets out of range [0, {V}) (and not ignore_index={ignore_index})")
    if support is not None:
        if support.dim() != 2 or support.shape[0] != N:
            raise ValueError(f"support must have shape [{N}, K], got {list(support.shape)}")
        if bool(((support < -1) | (support >= V)).any()):
            raise ValueError(f"support ids must lie in [0, {V}) or be -1 (padding)")


def _support_keep(support, V):
    """support [n, K] long (-1 pad) -> bool [n, V], True where kept; an all -1 row keeps everything."""
    n = support.shape[0]
    # pads go to a spare column V
    ids = torch.where(support < 0, V, support).long()
    keep = torch.zeros(n, V + 1, dtype=torch.bool, device=support.device)
    keep.scatter_(1, ids, True)
    keep = keep[:, :V]
    return keep | ~(support >= 0).any(1, keepdim=True)


def naive_logprobs_entropy(logits, targets, temperature=1.0, support=None, ignore_index=-100, *,
                           sum_sq=False):
    """The materialised reference: log_softmax over the full [N, V]. Same args/returns as below
    (sum_sq=True adds Σ_v π_v² [N], no gradient, as fused_linear_logprobs_entropy)."""
    _check(logits.shape, targets, temperature, support, ignore_index)
    z = logits.float() / temperature                                    # [N, V]
    if support is not None:
        z = z.masked_fill(~_support_keep(support, z.shape[1]), float("-inf"))
    logp = torch.log_softmax(z, dim=-1)                                 # [N, V]
    live = z != float("-inf")
    # zero BEFORE multiplying
    logp_safe = torch.where(live, logp, 0.0)
    ent = -(logp_safe.exp() * live * logp_safe).sum(-1)                 # [N]
    ignored = targets == ignore_index
    lp = logp.gather(1, torch.where(ignored, 0, targets).long()[:, None]).squeeze(1)
    lp = torch.where(ignored, 0.0, lp)
    ent = torch.where(ignored | ~live.any(-1), 0.0, ent)
    if not sum_sq:
        return lp, ent
    p = logp_safe.detach().exp() * live                                 # [N, V]
    return lp, ent, torch.where(ignored | ~live.any(-1), 0.0, (p * p).sum(-1))


def logprobs_and_entropy(logits, targets, temperature=1.0, support=None, ignore_index=-100, *,
                         backend=None):
    """Per-row logprob of `targets` and entropy under softmax(logits / temperature).

    logits [N, V] (any float dtype; math in fp32), targets [N] long, support None or [N, K] long kept
    ids (-1 pad). backend None = auto (CUDA → Triton, TRITON_INTERPRET=1 → interpreter, else torch),
    or "triton" / "torch" to force one. Returns (logprobs [N] fp32, entropy [N] fp32), differentiable
    w.r.t. logits.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {list(logits.shape)}")
    _check(logits.shape, targets, temperature, support, ignore_index)
    # out of place: autograd keeps the original; costs one [N, V] copy
    if support is not None:
        logits = logits.masked_fill(~_support_keep(support, logits.shape[1]), float("-inf"))
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _LogprobEntropy.apply(logits, targets.long().contiguous(), 1.0 / temperature,
                                 int(ignore_index), _backend(logits, backend))


# ----------------------------------------------------------------------------------------------------
# Fused linear: hidden [N, H] @ weight[V, H]ᵀ one token chunk at a time.
def _chunk_rows(V, itemsize, with_support, chunk_size):
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return int(chunk_size)
    return max(1, _LINEAR_BUDGET_BYTES // (V * (itemsize + (1 if with_support else 0))))


def _cpu_half(x) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def _mm(x, y):
    """x @ y. On CPU, bf16/fp16 operands are upcast (exactly) to fp32, multiplied with fp32
    accumulation and the result rounded back: what a GPU's bf16 GEMM computes (half inputs, fp32
    accumulation), without CPUs' missing half-precision GEMM units — the [n, V] @ [V, H] of grad_h
    took 42 s in bf16 vs 0.9 s this way for 64 rows of a 152k vocabulary, on this project's CPUs."""
    return (x.float() @ y.float()).to(x.dtype) if _cpu_half(x) else x @ y


def _addmm_(out, x, y):
    """out += x @ y into an fp32 accumulator `out` (∂W summed over token chunks). Same dtype: in
    place (no [V, H] temporary). Half x, y: on CPU the fp32 product straight into out (exact
    upcasts, fp32 accumulation, no rounding at all); on GPU the half GEMM (fp32 accumulation inside
    it) rounded once per chunk, then summed in fp32 — a bf16 accumulator would round the running
    sum at every chunk, an error that grows with the number of chunks (m2 of issue 30)."""
    if x.dtype == out.dtype:
        out.addmm_(x, y)
    elif _cpu_half(x):
        out.addmm_(x.float(), y.float())
    else:
        out.add_(x @ y)


def _chunk_logits(hidden, weight, bias, support, a, b):
    logits = _mm(hidden[a:b], weight.T)                                  # [n, V]
    if bias is not None:
        logits += bias
    # in place: this buffer is private to the chunk
    if support is not None:
        logits.masked_fill_(~_support_keep(support[a:b], logits.shape[1]), float("-inf"))
    return logits


class _FusedLinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, support, inv_temp, ignore_index, chunk, backend, want_sq):
        # fp32 masters: a compute copy, not saved
        w, rows = weight.to(hidden.dtype), ROWS[backend]
        # each chunk's (logprobs [n], entropy [n], norm [2, n], Σπ² [n] (no grad) or [0]), joined below;
        # N = 0 runs one empty chunk, so that there is something to join
        chunks = []
        for a in range(0, max(hidden.shape[0], 1), chunk):
            logits = _chunk_logits(hidden, w, bias, support, a, a + chunk)
            chunks.append(rows.forward(logits, targets[a:a + chunk], inv_temp, ignore_index, want_sq))
        lp, ent, norm, sq = (torch.cat(parts, dim=-1) for parts in zip(*chunks))
        ctx.save_for_backward(hidden, weight, bias, targets, support, norm, ent)
        ctx.args = (inv_temp, ignore_index, chunk, rows)
        ctx.mark_non_differentiable(sq)
        return lp, ent, sq

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_sq):
        hidden, weight, bias, targets, support, norm, ent = ctx.saved_tensors
        inv_temp, ignore_index, chunk, rows = ctx.args
        g_lp, g_ent = _grads_or_zeros(g_lp, g_ent, ent)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # the compute copy again (fp32 masters), or weight itself
        w = weight.to(hidden.dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        # ∂W accumulates over chunks in fp32 whatever the compute dtype: summed in bf16, each chunk's
        # addition rounds the running sum (~1% relative noise on a tied embedding's gradient).
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        # fp32
        grad_b = torch.zeros(weight.shape[0], device=weight.device) if need_b else None
        for a in range(0, hidden.shape[0], chunk):
            b = min(a + chunk, hidden.shape[0])
            # recompute, then overwrite with its grad
            logits = _chunk_logits(hidden, w, bias, support, a, b)
            rows.backward(logits, targets[a:b], norm[:, a:b], ent[a:b], g_lp[a:b], g_ent[a:b], inv_temp,
                          ignore_index, logits)
            if need_h:
                grad_h[a:b] = _mm(logits, w)
            if need_w:
                _addmm_(grad_w, logits.T, hidden[a:b])
            if need_b:
                grad_b += logits.float().sum(0)
        # fp32 masters: no rounding at all
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def fused_linear_logprobs_entropy(hidden, weight, targets, temperature=1.0, support=None,
                                  ignore_index=-100, chunk_size=None, *, bias=None, backend=None,
                                  sum_sq=False):
    """logprobs_and_entropy(hidden @ weightᵀ + bias, ...) without ever holding the [N, V] logits.

    hidden [N, H], weight [V, H] (the LM head: hidden's dtype, or fp32 master weights with bf16/fp16
    hidden — the matmuls then run in hidden's dtype and ∂W comes back in fp32, never rounded to
    half; ∂W is accumulated over chunks in fp32 either way), bias None or [V], targets [N] long,
    support None or [N, K] long. chunk_size = tokens per chunk; None picks it so one chunk's
    logits fit in _LINEAR_BUDGET_BYTES. Returns (logprobs [N] fp32, entropy [N] fp32), differentiable
    w.r.t. hidden, weight and bias; sum_sq=True adds Σ_v π_v² [N] fp32 (no gradient), accumulated in
    the same pass over the vocabulary (the optimal token baseline's ||∇_z log π||² = 1 − 2π_y + Σπ²).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [N, H] and weight [V, H], got {list(hidden.shape)} and "
                         f"{list(weight.shape)}")
    half = hidden.dtype in (torch.bfloat16, torch.float16)
    if hidden.dtype != weight.dtype and not (half and weight.dtype == torch.float32):
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) dtypes differ (only fp32 "
                         "master weights may come with bf16/fp16 hidden states)")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape [{weight.shape[0]}], got {list(bias.shape)}")
    V = weight.shape[0]
    _check((hidden.shape[0], V), targets, temperature, support, ignore_index)
    chunk = _chunk_rows(V, hidden.element_size(), support is not None, chunk_size)
    support = None if support is None else support.long().contiguous()
    lp, ent, sq = _FusedLinearLogprobEntropy.apply(hidden, weight, bias, targets.long().contiguous(), support,
                                                   1.0 / temperature, int(ignore_index), chunk,
                                                   _backend(hidden, backend), bool(sum_sq))
    return (lp, ent, sq) if sum_sq else (lp, ent)
