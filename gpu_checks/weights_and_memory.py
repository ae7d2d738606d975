"""gpu_check.py stages 7 and 8 (issue 45): the async worker's weight channel and the memory plan.

Stage 7 (B1, `transport_stage`): --async-steps with --engine vllm on one GPU, without vLLM: the
transport weight_broadcast picks for trainer and worker on one device (CUDA IPC), versions of the
stage-1 shape into a spawned worker (`transport_worker`), each checksummed on both ends (`checksum`),
the worker's own GPU allocations. Stage 8 (M4, `memory_stage`): a 7B shape's measured training peak,
in a child process (`memory_child`), against nanorl/memory_plan.py's estimate. --cpu runs the same
code with the host's shared memory for CUDA IPC and tensor bytes for the allocator.
"""
from __future__ import annotations

import os
import statistics
import time
import traceback

import torch

# random_batch, micro_batch_loss (never `bench`: bench imports this file)
import bench_steps
from gpu_checks.common import Check, fmt_s, in_child, sync
from nanorl import batching, precision


# 7 (B1): the async vLLM worker's weight channel on one GPU, without vLLM
def checksum(t: torch.Tensor) -> int:
    """A position-weighted sum of a tensor's bit patterns (int64, wrapping): the same on both ends when
    every bit crossed, moved by a flipped, lost or shifted element."""
    words = t.detach().reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                         8: torch.int64}[t.element_size()])
    pos = torch.arange(words.numel(), device=t.device) % 65521 + 1
    return int((words.to(torch.int64) * pos).sum())


def transport_worker(spec, env: dict, versions: list[int], out) -> None:
    """Stage 7's worker process, what rollout_worker does with the channel minus vLLM: with the
    environment pipeline.worker_device gives the async worker (CUDA_VISIBLE_DEVICES naming only its
    GPU), it finds that GPU by UUID, takes each version, checksums every tensor, says whether the version
    is held in its host memory (not in the trainer's shared slot), and releases it; last, what it
    allocated on its GPU at most (M3: nothing, the landing slot is the trainer's)."""
    from nanorl import weight_broadcast
    try:
        os.environ.update(env)  # before CUDA starts in this process
        rx = weight_broadcast.Receiver(spec)
        shared = weight_broadcast._open(spec.shared, rx.device)
        lo, hi = shared.data_ptr(), shared.data_ptr() + shared.numel()
        for v in versions:
            if not rx.wait_for(v, timeout=120):
                raise TimeoutError(f"version {v} did not arrive in 120 s")
            views = rx.slot(v)
            host = all(t.device.type == "cpu" and not lo <= t.data_ptr() < hi for t in views.values())
            out.put(("version", v, [checksum(views[names[0]]) for names, *_ in spec.layout], host,
                     str(rx.device)))
            rx.release(v)
        peak = torch.cuda.max_memory_allocated(rx.device) if rx.device.type == "cuda" else 0
        out.put(("done", peak))
    except Exception:  # noqa: BLE001  (the stage reports it)
        out.put(("error", traceback.format_exc()[-1500:]))


def transport_stage(c: Check) -> dict:
    """7 (B1): --async-steps K --engine vllm on one GPU. The transport weight_broadcast chooses for
    trainer and worker on the same GPU (ipc: NCCL refuses two ranks on one device), then 4 versions of
    the stage-1 shape in bf16 into a spawned worker through the trainer's one shared slot (M3: each
    copied out into the worker's host slots, 3 of them, before the next is written), each checksummed
    on both ends; time per version; the worker's own GPU allocations. --cpu: the host stand-in (the
    slot in shared memory, the same code otherwise)."""
    import torch.multiprocessing as mp

    from nanorl import pipeline, weight_broadcast
    from nanorl.shared_weights import slot_layout
    dev, model = c.device, c.model()
    want = "ipc"
    transport = weight_broadcast.backend_for(dev, dev) if dev.type == "cuda" else want
    layout, size = slot_layout(model, torch.bfloat16)
    spec = weight_broadcast.ChannelSpec(weight_broadcast.free_port(), transport, layout, size, slots=3,
                                        device=str(dev))
    r = dict(transport=transport, want=want, versions=[], sent={}, seconds=[], error="", gib=size / 2**30)
    if transport != want:  # NCCL between two ranks on one GPU: the B1 failure itself, not run
        return r
    tx = weight_broadcast.Sender(spec, dev)  # first: it puts the shared slots' openers into spec
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    current = torch.cuda.current_device() if dev.type == "cuda" else 0
    _, env = pipeline.worker_device(str(dev), os.environ, torch.cuda.device_count(), current)
    child = ctx.Process(target=transport_worker, args=(spec, env, [0, 1, 2, 3], out), daemon=True)
    child.start()

    def take() -> bool:
        """The worker's next report; False once it is done or failed."""
        got = tuple(out.get(timeout=max(1, c.deadline - time.monotonic())))
        r["versions"].append(got)
        return got[0] == "version"
    try:
        tx.connect()
        for v in [0, 1, 2, 3]:  # each publish waits for the worker to have copied the previous one out
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            state = model.state_dict()
            r["sent"][v] = [checksum(state[names[0]].to(dt)) for names, dt, _, _ in layout]
            sync(dev)
            t = time.perf_counter()
            tx.publish(model, v)
            r["seconds"].append(time.perf_counter() - t)
        while take():
            pass
    except Exception as e:  # noqa: BLE001  (a finding: reported by crit_transport)
        r["error"] = f"{type(e).__name__}: {e}"
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
        tx.close()
    errors = [g[1] for g in r["versions"] if g[0] == "error"]
    r["error"] = r["error"] or "; ".join(errors)
    per = statistics.median(r["seconds"]) if r["seconds"] else float("nan")
    c.row("7 B1", f"weight channel on one {dev.type} device: {len(layout)} tensors, {r['gib']:.2f} GiB bf16",
          f"transport {transport}", f"{fmt_s(per)} per version, {r['gib'] / per:.1f} GiB/s" if r["seconds"]
          else "no version sent", seconds=r["seconds"])
    return r


def crit_transport(r: dict) -> list[str]:
    """Stage 7: the one-device transport is ipc, every version arrived bit for bit (checksums) and is
    held in the worker's host memory, the worker allocated under one version's bytes on its GPU, no
    error."""
    if r["transport"] != r["want"]:
        return [f"transport {r['transport']} chosen for one device, want {r['want']} (NCCL refuses two ranks "
                "on one GPU)"]
    bad = [f"error: {r['error'][-400:]}"] if r["error"] else []
    got = {g[1]: g for g in r["versions"] if g[0] == "version"}
    if sorted(got) != sorted(r["sent"]) or not got:
        bad.append(f"versions received {sorted(got)}, sent {sorted(r['sent'])}")
    for v, g in sorted(got.items()):
        if g[2] != r["sent"].get(v):
            bad.append(f"version {v}: checksums differ in {sum(a != b for a, b in zip(g[2], r['sent'][v]))} "
                       "tensors")
        if not g[3]:
            bad.append(f"version {v}: not held in the worker's host memory (M3: no staging on the GPU)")
    peak = [g[1] for g in r["versions"] if g[0] == "done"]
    if peak and peak[0] >= r["gib"] * 2**30:
        bad.append(f"the worker allocated {peak[0] / 2**30:.2f} GiB on its GPU: a version's worth or more")
    return bad


# 8 (M4): the memory plan against a measured peak
def memory_child(config: dict, rows: int, T: int, device: str) -> dict:
    """In its own process (nothing else on the GPU): a random-init Qwen2 of `config` in fp32 masters,
    activation checkpointing, fused AdamW, bf16 autocast; two steps of two rows × T micro-batches (the
    second's forward holds the first's gradients and autocast's weight copies, as a run's does). The
    state bytes counted from the tensors, the allocator's peak over the second step, and the plan."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nanorl import build, memory_plan
    from nanorl.config import Config
    dev = torch.device(device)
    precision.setup_device(dev)
    torch.manual_seed(0)
    config = Qwen2Config(**config, attn_implementation=batching.best_attn_implementation(torch.bfloat16))
    with torch.device(dev):
        model = Qwen2ForCausalLM(config)
    model.config.use_cache = False
    precision.enable_gradient_checkpointing(model)
    model.train()
    cfg = Config.from_flags(model="random", dtype="bfloat16", gradient_checkpointing=True, kl_coef=0.0,
                            engine="hf",
                 max_tokens_per_micro_batch=rows * T)
    total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    plan = memory_plan.estimate(build.model_shape(model), cfg, vllm=False, device_bytes=total)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99), fused=True)
    P = T // 4
    batch = bench_steps.random_batch([(P, T - P)] * rows, config.vocab_size, dev)
    adv = torch.randn(batch.response_ids.shape, device=dev)  # [rows, T − P]
    scored = int(batch.response_mask.sum())
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    measured, t0 = dict(masters=nbytes(model.parameters())), time.perf_counter()
    r = dict(line=plan.line(), device_bytes=total, oom=False)
    try:
        for step in range(2):
            if dev.type == "cuda" and step == 1:
                torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(2):
                with precision.autocast(dev, torch.bfloat16):
                    loss = bench_steps.micro_batch_loss(model, batch, adv, 2 * scored, 2 * rows)
                loss.backward()
            measured["grads"] = nbytes(p.grad for p in model.parameters() if p.grad is not None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync(dev)
    except torch.OutOfMemoryError as e:
        r.update(oom=True, error=str(e)[:300])
    measured["adam"] = nbytes(t for s in optimizer.state.values() for k, t in s.items() if k != "step")
    measured["peak"] = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    # the training phase's peak: this process samples nothing
    planned = dict(masters=plan.resident["fp32 masters"], grads=plan.train["gradients"],
                   adam=plan.resident["Adam"], peak=sum(plan.resident.values()) + sum(plan.train.values()))
    r.update(measured=measured, estimate=planned, fits=plan.fits(), seconds=time.perf_counter() - t0,
             params=sum(p.numel() for p in model.parameters()))
    return r


def memory_stage(c: Check) -> dict:
    """8 (M4): the memory plan (nanorl/memory_plan.py) of a 7B shape with --kl-coef 0, the HF engine and a
    16k-token micro-batch, against the state counted from the tensors and the peak the allocator saw;
    a fresh process with expandable segments. --cpu: tiny sizes, the state terms only (no allocator)."""
    s = c.sizes
    r = in_child(c, f"{__name__}:memory_child",
                 dict(config=s.big, rows=s.big_rows, T=s.big_T, device=str(c.device)),
                 PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    if "measured" in r:
        m, e = r["measured"], r["estimate"]
        c.row("8 M4", f"{r['params'] / 1e9:.2f}B shape, {s.big_rows}×{s.big_T} tokens, checkpointing, fused "
                      "AdamW", "n/a (no CUDA)" if m["peak"] is None else f"peak {m['peak'] / 2**30:.1f} GiB",
              f"plan {e['peak'] / 2**30:.1f} GiB" + (" (OOM)" if r["oom"] else "") + "; counted: " +
              ", ".join(f"{k} {m.get(k, 0) / 2**30:.2f}" for k in ("masters", "grads", "adam")) + " GiB",
              line=r["line"])
    return r


def crit_memory(r: dict) -> list[str]:
    """Stage 8: the state terms (masters, gradients, AdamW moments) as the plan counts them (2%), and on
    CUDA the measured peak within 10% of the plan's training peak, without running out of memory where
    the plan says the run fits."""
    if "measured" not in r:
        return [f"error: {r.get('error', '')[-400:]}"]
    m, e, bad = r["measured"], r["estimate"], []
    for k in ("masters", "grads", "adam"):
        got = m.get(k, 0)  # an OOM before the first step leaves no gradients counted
        if not abs(got - e[k]) <= 0.02 * e[k]:
            bad.append(f"{k}: {got / 2**30:.2f} GiB counted, {e[k] / 2**30:.2f} GiB planned")
    if r["oom"] and r["fits"]:
        bad.append(f"out of memory where the plan fits ({e['peak'] / 2**30:.1f} GiB): {r.get('error', '')}")
    if m["peak"] is not None and not abs(m["peak"] - e["peak"]) <= 0.10 * e["peak"]:
        bad.append(f"peak {m['peak'] / 2**30:.1f} GiB measured, {e['peak'] / 2**30:.1f} GiB planned (±10%)")
    return bad
