"""The Triton kernels of nanorl/entropy.py: per-row log-probability and entropy, forward and backward.

One program per row of x [N, V] (logits): the forward streams the row in BLOCK_V-wide blocks with an
online max and returns logprob, entropy, the row's normaliser (m, ls: lse = m + ls) and, on request,
Σπ²; the backward re-reads the row and writes ∂/∂x in place of (or beside) it. nanorl/entropy.py owns
the math's description, the chunked torch twin of these kernels, the backend choice and the autograd
Functions; start there. Here: `triton_forward` / `triton_backward` (the launches) and the two kernels.
Key choices: the kernels are written without helper functions, so that the same Python source
compiles with `triton.compile` for sm_90 even when the module was imported under TRITON_INTERPRET=1
(tests/test_entropy.py checks both); int64 row offsets (N·V can pass 2**31); every launch runs under
`torch.cuda.device(x.device)` (`_launch_guard`), since Triton launches on the current device.
Without triton installed, HAS_TRITON is False and nothing here is defined but the flags.

Test: python -m pytest tests/test_entropy.py -q   (runs the kernels in the interpreter)
"""
import contextlib
import os

import torch

# triton is optional: without it (or without a GPU / interpreter) the torch path is used
try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    triton = tl = None
    HAS_TRITON = False

# Kernels are wrapped for the interpreter at decoration time, so read the flag once, at import.
TRITON_INTERPRETED = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"
# Triton: vocabulary block per loop step (power of two)
_MAX_BLOCK_V = 4096

# ----------------------------------------------------------------------------------------------------
# Triton kernels (one program per row). Written without helper functions so that the same Python
# source compiles with `triton.compile` even when the module was imported under the interpreter.
if HAS_TRITON:

    @triton.jit
    def _fwd_kernel(x_ptr, stride_x, tgt_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr, sq_ptr, V, inv_temp,
                    ignore_index, BLOCK_V: tl.constexpr, WITH_SQ: tl.constexpr):
        # int64: row * stride exceeds 2**31 for N·V ≈ 6e8
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        # running max of z
        m = float("-inf")
        # Σ exp(z − m)
        s = 0.0
        # Σ exp(z − m)(z − m)
        d = 0.0
        # Σ exp(z − m)², for Σπ² = q / s² (OTB's path-variance proxy)
        q = 0.0
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, tl.max(z, 0))
            # Guard (−inf) − (−inf): while every z so far is −inf, shift by 0 (s = d = 0 anyway).
            m_new_s = tl.where(m_new == float("-inf"), 0.0, m_new)
            m_s = tl.where(m == float("-inf"), m_new_s, m)
            alpha = tl.exp(m_s - m_new_s)
            # 0 on −inf columns
            e = tl.exp(z - m_new_s)
            # zero BEFORE multiplying
            zc = tl.where(z == float("-inf"), 0.0, z - m_new_s)
            d = alpha * (d + s * (m_s - m_new_s)) + tl.sum(e * zc, 0)
            if WITH_SQ:
                q = alpha * alpha * q + tl.sum(e * e, 0)
            s = alpha * s + tl.sum(e, 0)
            m = m_new
        m_fin = tl.where(m == float("-inf"), 0.0, m)
        # lse = m + ls; a dead (all −inf) row keeps m = ls = 0
        ls = tl.where(s > 0.0, tl.log(s), 0.0)
        ent = tl.where(s > 0.0, ls - d / s, 0.0)
        tgt = tl.load(tgt_ptr + row)
        ignored = tgt == ignore_index
        z_t = tl.load(x_row + tl.where(ignored, 0, tgt)).to(tl.float32) * inv_temp
        # (z_t − m) − ls rather than z_t − lse: exact subtraction first keeps fp32 digits at |z| ≫ 1.
        lp = tl.where(z_t == float("-inf"), float("-inf"), (z_t - m_fin) - ls)
        tl.store(lp_ptr + row, tl.where(ignored, 0.0, lp))
        tl.store(ent_ptr + row, tl.where(ignored, 0.0, ent))
        tl.store(m_ptr + row, m_fin)
        tl.store(ls_ptr + row, ls)
        if WITH_SQ:
            tl.store(sq_ptr + row, tl.where(ignored | (s <= 0.0), 0.0, q / (s * s)))

    @triton.jit
    def _bwd_kernel(x_ptr, stride_x, g_ptr, stride_g, tgt_ptr, m_ptr, ls_ptr, ent_ptr, glp_ptr,
                    gent_ptr, V, inv_temp, ignore_index, BLOCK_V: tl.constexpr):
        # g_ptr may alias x_ptr: each block is read before it is overwritten by the same program.
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        g_row = g_ptr + row * stride_g
        tgt = tl.load(tgt_ptr + row)
        active = tgt != ignore_index
        m = tl.load(m_ptr + row)
        ls = tl.load(ls_ptr + row)
        ent = tl.load(ent_ptr + row)
        g_lp = tl.load(glp_ptr + row)
        g_ent = tl.load(gent_ptr + row)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            in_row = cols < V
            z = tl.load(x_row + cols, mask=in_row, other=float("-inf")).to(tl.float32) * inv_temp
            live = z != float("-inf")
            # zero BEFORE multiplying
            logp = tl.where(live, (z - m) - ls, 0.0)
            p = tl.where(live, tl.exp(logp), 0.0)
            grad = g_lp * (tl.where(cols == tgt, 1.0, 0.0) - p) - g_ent * p * (logp + ent)
            grad = tl.where(live & active, grad * inv_temp, 0.0)
            tl.store(g_row + cols, grad.to(g_ptr.dtype.element_ty), mask=in_row)


def _block_v(V):
    return min(triton.next_power_of_2(V), _MAX_BLOCK_V)


def _launch_guard(x):
    """Where a kernel reading x runs: Triton launches on torch's CURRENT CUDA device, not x's, so a
    tensor on another GPU (the async rollout worker's scoring, issue 45 M2) would be read from the
    wrong device (an illegal memory access). The interpreter (CPU tensors) needs no guard."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def triton_forward(x, targets, inv_temp, ignore_index, want_sq=False):
    """x [N, V] -> (logprobs [N], entropy [N], norm [2, N] = (m, ls), Σπ² [N] if want_sq else [0])."""
    N, V = x.shape
    lp, ent = (torch.empty(N, device=x.device, dtype=torch.float32) for _ in range(2))
    norm = torch.empty(2, N, device=x.device, dtype=torch.float32)
    sq = torch.empty(N if want_sq else 0, device=x.device, dtype=torch.float32)
    if N > 0:
        with _launch_guard(x):
            _fwd_kernel[(N,)](x, x.stride(0), targets, lp, ent, norm[0], norm[1], sq if want_sq else lp, V,
                              inv_temp, ignore_index, BLOCK_V=_block_v(V), WITH_SQ=want_sq, num_warps=8)
    return lp, ent, norm, sq


def triton_backward(x, targets, norm, ent, g_lp, g_ent, inv_temp, ignore_index, out):
    """∂/∂x [N, V] into out (out may be x: each block is read before it is overwritten)."""
    N, V = x.shape
    if N > 0:
        with _launch_guard(x):
            _bwd_kernel[(N,)](x, x.stride(0), out, out.stride(0), targets, norm[0], norm[1], ent, g_lp,
                              g_ent, V, inv_temp, ignore_index, BLOCK_V=_block_v(V), num_warps=8)
    return out
