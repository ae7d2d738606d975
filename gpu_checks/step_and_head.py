"""gpu_check.py stages 1 and 2: one training step of the 0.5B shape, and the Triton fused LM head.

Stage 1 (`step_stage`): fwd + bwd + AdamW of the Qwen2.5-0.5B shape on rows x T tokens, with and
without activation checkpointing: time, MFU, peak memory. Stage 2 (`head_stage`, `head_case`): the
fused head's logprobs, entropies and gradients (Triton on CUDA) against the torch path and an fp32
reference, on peaked logits (`peaked_head`: real models put most mass on a few tokens), at the real
hidden sizes and vocabularies. Their pass criteria (`crit_step`, `crit_head`, `crit_heads`) are pure
functions over the measured results, so tests/test_gpu_check.py feeds them planted faults.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time

import torch

# random_batch, micro_batch_loss (never `bench`: bench imports this file)
from gpu_checks.common import Check, finite, fmt_s, peak_bf16, peak_mib, seconds, step_flops, sync
from nanorl import entropy
from nanorl.rollout import HFEngine, SamplingConfig


def crit_step(r: dict) -> list[str]:
    """Stage 1: the step computes something, checkpointing saves memory, generation runs to length."""
    bad = [] if finite(r["loss"]) else [f"loss {r['loss']} not finite"]
    if not (finite(r["grad_norm"]) and r["grad_norm"] > 0):
        bad.append(f"gradient norm {r['grad_norm']}: not finite and > 0")
    if not (finite(r["step_s"]) and r["step_s"] > 0):
        bad.append(f"step time {r['step_s']}")
    if r.get("peak_on") is not None and r.get("peak_off") is not None and not r["peak_on"] < r["peak_off"]:
        bad.append(f"checkpointing on peaks at {r['peak_on']:.0f} MiB, not below off's {r['peak_off']:.0f}")
    if r["gen_lengths"] != [r["gen_expected"]] * len(r["gen_lengths"]) or not r["gen_lengths"]:
        bad.append(f"generated lengths {sorted(set(r['gen_lengths']))}, want all {r['gen_expected']}")
    return bad


def step_stage(c: Check) -> dict:
    """Step time, tokens/s and MFU (checkpointing off), peak memory off and on, HF-engine generation."""
    s = c.sizes
    step, scored, out = c.train_step(checkpointing=False)
    t = statistics.median(seconds(step, s.reps, c.device))
    flops = step_flops(c.model(), s.rows, s.T, scored)
    name = torch.cuda.get_device_name(c.device) if c.device.type == "cuda" else "cpu"
    peak = peak_bf16(name) if c.device.type == "cuda" else None
    mfu = flops / t / peak if peak else None
    c.row("1 step", f"{s.model['num_hidden_layers']}-layer Qwen2.5-0.5B shape, {s.rows}×{s.T}, bf16 autocast",
          fmt_s(t), f"{s.rows * s.T / t:.0f} tok/s, MFU {f'{100 * mfu:.1f}%' if mfu else 'n/a'} ({name}, "
          f"{flops / 1e12:.2f} TFLOP/step)", seconds=t, tokens_per_s=s.rows * s.T / t, mfu=mfu, flops=flops)
    r = dict(loss=out["loss"], grad_norm=out["grad_norm"], step_s=t)
    for ckpt in (False, True):
        step, _, _ = c.train_step(checkpointing=ckpt)
        # the optimizer state exists from here on, as in a run
        step()
        r["peak_on" if ckpt else "peak_off"] = mib = peak_mib(step, c.device)
        c.row("1 step", f"peak memory, checkpointing {'on' if ckpt else 'off'}",
              "n/a (no CUDA)" if mib is None else f"{mib:.0f} MiB added", peak_mib=mib)
    engine = HFEngine(c.model(), pad_id=0, compute_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, c.model().config.vocab_size, (s.prompts, s.prompt_len), generator=g).tolist()
    sp = SamplingConfig(max_new_tokens=s.new_tokens, stop_token_ids=(), seed=0)
    t0 = time.perf_counter()
    samples = engine.generate(prompts, 1, sp)
    sync(c.device)
    t = time.perf_counter() - t0
    c.row("1 step", f"HF engine, {s.prompts} prompts × {s.new_tokens} new tokens",
          f"{s.prompts * s.new_tokens / t:.0f} tok/s", f"{fmt_s(t)} per call (first call, bf16 autocast)",
          tokens_per_s=s.prompts * s.new_tokens / t)
    r.update(gen_lengths=[len(x.response_ids) for x in samples], gen_expected=s.new_tokens)
    return r


def peaked_head(N: int, H: int, V: int, device, seed: int = 0):
    """hidden [N, H] bf16 and fp32 master weight [V, H] whose logits are peaked as a trained LM's: per
    row a Gaussian with std 1.5–9 (N(0,1) logits over 152k tokens have entropy ≈ ln V − ½: uniform)."""
    g = torch.Generator().manual_seed(seed)
    spread = 1.5 + 7.5 * torch.rand(N, 1, generator=g)                                   # [N, 1]
    h = (torch.randn(N, H, generator=g) * spread).to(device, torch.bfloat16)              # [N, H]
    w = (torch.randn(V, H, generator=g) * H ** -0.5).to(device)                          # [V, H]
    return h, w


def fp32_rows(h, w, targets, temperature, support, chunk):
    """The fp32 reference over row chunks: fp32 matmul at full precision (no TF32), naive log_softmax;
    returns (lp, ent, sq, grad h, grad w) of Σ lp + 0.1 Σ ent, and each row's largest |logit|."""
    outs, gh, gw = [], [], torch.zeros_like(w)
    wf = w.detach().float().requires_grad_()
    for a in range(0, h.shape[0], chunk):
        hc = h[a:a + chunk].detach().float().requires_grad_()
        x = hc @ wf.T                                                                     # [chunk, V]
        sup = None if support is None else support[a:a + chunk]
        lp, ent, sq = entropy.naive_logprobs_entropy(x, targets[a:a + chunk], temperature, sup, sum_sq=True)
        dh, dw = torch.autograd.grad(lp.sum() + 0.1 * ent.sum(), [hc, wf])
        outs.append((lp.detach(), ent.detach(), sq, x.detach().abs().amax(1)))
        gh.append(dh)
        gw += dw
    cat = [torch.cat(x) for x in zip(*outs)]
    return cat[0], cat[1], cat[2], torch.cat(gh), gw, cat[3]


@contextlib.contextmanager
def full_fp32():
    """fp32 matmuls at full precision inside (setup_device turned TF32 on, as train.py does)."""
    was = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(was)


def head_inputs(h, w, temperature: float, K: int, chunk: int, seed: int = 0):
    """targets [N] drawn from softmax(logits / T) (on its top-K support in odd rows: KSM), every 16th
    row ignored (-100); support [N, K] of the odd rows' top-K ids, -1 (the full vocabulary) elsewhere."""
    g = torch.Generator(h.device).manual_seed(seed)
    targets, support = [], []
    with torch.no_grad(), full_fp32():
        for a in range(0, h.shape[0], chunk):
            z = (h[a:a + chunk].float() @ w.T) / temperature                            # [chunk, V]
            top = z.topk(K, dim=1).indices                                               # [chunk, K]
            odd = (torch.arange(a, a + z.shape[0], device=z.device) % 2 == 1)[:, None]  # [chunk, 1]
            keep = torch.zeros_like(z, dtype=torch.bool).scatter_(1, top, True) | ~odd
            y = torch.multinomial(torch.softmax(z.masked_fill(~keep, float("-inf")), 1), 1, generator=g)[:, 0]
            targets.append(y)
            support.append(torch.where(odd, top, -1))
    targets, support = torch.cat(targets), torch.cat(support)                            # [N], [N, K]
    targets[::16] = -100
    return targets, support


def head_case(c: Check, H: int, V: int, backend: str) -> dict:
    """One shape of stage 2: the kernel vs the torch path vs the fp32 reference, time and peak memory."""
    s, dev, T, K = c.sizes, c.device, 0.7, 32
    h, w = peaked_head(s.N, H, V, dev)
    targets, support = head_inputs(h, w, T, K, s.chunk)
    h.requires_grad_()
    w.requires_grad_()
    paths = {"kernel": backend, "torch": "torch"} if backend != "torch" else {"kernel": "torch"}
    got, times = {}, {}
    for name, b in paths.items():
        def fwd(b=b):
            return entropy.fused_linear_logprobs_entropy(h, w, targets, T, support, chunk_size=s.chunk,
                                                         backend=b, sum_sq=True)

        def bwd(out):
            return torch.autograd.grad(out[0].sum() + 0.1 * out[1].sum(), [h, w])
        out = fwd()
        got[name] = [out[0].detach(), out[1].detach(), out[2], *bwd(out)]
        f = statistics.median(seconds(fwd, 2, dev))
        b_ = statistics.median(seconds(lambda: bwd(fwd()), 2, dev)) - f
        times[name] = dict(fwd_ms=1e3 * f, bwd_ms=1e3 * b_, peak_mib=peak_mib(lambda: bwd(fwd()), dev))
        del out
    with full_fp32():
        ref = fp32_rows(h, w, targets, T, support, s.chunk)
        # the kernel on fp32 inputs (the --fp32-lm-head path), no TF32: only row arithmetic differs
        hf = h.detach().float().requires_grad_()
        out = entropy.fused_linear_logprobs_entropy(hf, w, targets, T, support, chunk_size=s.chunk,
                                                    backend=backend, sum_sq=True)
        got["fp32 kernel"] = [out[0].detach(), out[1].detach(), out[2],
                              *torch.autograd.grad(out[0].sum() + 0.1 * out[1].sum(), [hf, w])]
        del out
    lp, ent, _, gh, _ = got["kernel"]
    live = targets != -100

    def maxerr(xs, ys):
        """max|Δ| per output: absolute for logprob and entropy, relative to the row for Σπ², relative
        to the largest value for the gradients."""
        d = [(a.float() - b.float()).abs() for a, b in zip(xs, ys)]
        return {"logprob": float(d[0][live].max()), "entropy": float(d[1][live].max()),
                "sum_sq": float((d[2][live] / ys[2][live].clamp_min(1e-12)).max()),
                "grad_h": float(d[3].max() / ys[3].abs().max()),
                "grad_w": float(d[4].max() / ys[4].abs().max())}
    # bf16 run vs fp32: the kernel's logits are bf16 (each rounded by <= ½ ulp), so a logprob or an
    # entropy may move by about one bf16 ulp of the largest scaled logit, Σπ² by that relatively, and
    # gradients leave in bf16 from bf16 logits: a loose bound that catches only gross errors.
    ulp = 2.0 ** (math.floor(math.log2(float(ref[5].max()) / T)) - 7)
    errors = {"fp32 kernel vs fp32": maxerr(got["fp32 kernel"], ref),
              "bf16 vs fp32": maxerr(got["kernel"], ref)}
    tols = {"fp32 kernel vs fp32": dict(logprob=5e-4, entropy=5e-4, sum_sq=5e-4, grad_h=1e-3, grad_w=1e-3),
            "bf16 vs fp32": dict(logprob=ulp, entropy=ulp, sum_sq=2 * ulp, grad_h=1 / 8, grad_w=1 / 8)}
    # same bf16 chunk logits: only fp32 row arithmetic differs
    if "torch" in got:
        errors["bf16 vs torch path"] = maxerr(got["kernel"], got["torch"])
        tols["bf16 vs torch path"] = dict(logprob=1e-3, entropy=1e-3, sum_sq=1e-3, grad_h=1 / 64,
                                          grad_w=1 / 64)
    ign = targets == -100
    full = (support < 0).all(1) & ~ign
    r = dict(H=H, V=V, N=s.N, backend=backend, log_v=math.log(V), median_entropy=float(ref[1][full].median()),
             errors=errors, tols=tols, support_k=K, times=times,
             ignored_abs_max=float(max(lp[ign].abs().max(), ent[ign].abs().max(), gh[ign].abs().max())),
             support_entropy_max=float(ent[(support >= 0).any(1) & ~ign].max()))
    t = times["kernel"]
    c.row("2 head", f"{backend} N={s.N} H={H} V={V}, T {T}, chunk {s.chunk}", f"fwd {t['fwd_ms']:.1f} ms, "
          f"bwd {t['bwd_ms']:.1f} ms", f"peak {t['peak_mib']:.0f} MiB" if t["peak_mib"] is not None else
          "peak n/a", **t)
    for ref_name, errs in errors.items():
        c.row("2 head", f"H={H} V={V} {ref_name}", ", ".join(f"{n} {v:.1e}" for n, v in errs.items()),
              f"tol {', '.join(f'{v:.0e}' for v in tols[ref_name].values())}", max_abs=errs,
              tol=tols[ref_name])
    c.row("2 head", f"H={H} V={V} logits", f"median entropy {r['median_entropy']:.2f} nats",
          f"ln V = {math.log(V):.2f}: peaked (want <= ½ ln V)")
    return r


def head_stage(c: Check) -> dict:
    """2: the Triton fused head (logprobs, entropy, Σπ², gradients) against the torch path and fp32, at the
    Qwen2.5-0.5B and 7B head shapes: errors, time, peak memory."""
    backend = "triton" if c.device.type == "cuda" or entropy.TRITON_INTERPRETED else "torch"
    if backend == "torch":
        c.row("2 head", "backend", "torch", "no CUDA: the torch path stands in for the kernel (smoke)")
    return {f"H{H}_V{V}": head_case(c, H, V, backend) for H, V in c.sizes.head}


def crit_head(r: dict) -> list[str]:
    """Stage 2, one shape: realistic (peaked) logits, the kernel agrees with the torch path and the fp32
    reference, ignored rows score 0 with zero gradient, supported rows stay inside their support."""
    bad = []
    if not r["median_entropy"] <= 0.5 * r["log_v"]:
        bad.append(f"logits near-uniform: median entropy {r['median_entropy']:.2f} > ½ ln V = "
                   f"{0.5 * r['log_v']:.2f}")
    for ref, errs in r["errors"].items():
        for name, err in errs.items():
            tol = r["tols"][ref][name]
            if not (finite(err) and err <= tol):
                bad.append(f"{name} vs {ref}: max|Δ| {err:.2e} > {tol:.2e}")
    if r["ignored_abs_max"] != 0.0:
        bad.append(f"ignored rows: max |logprob|, |entropy|, |grad h| = {r['ignored_abs_max']:.2e}, want 0")
    if not r["support_entropy_max"] <= math.log(r["support_k"]) + 1e-3:
        bad.append(f"supported rows: entropy {r['support_entropy_max']:.3f} > ln K = "
                   f"{math.log(r['support_k']):.3f}")
    return bad


def crit_heads(r: dict) -> list[str]:
    return [f"{k}: {why}" for k, case in r.items() for why in crit_head(case)]
