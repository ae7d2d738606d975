"""bench_components.py — bench.py's component entries: each against the loop most trainers write.

    python bench.py --threads 1 --only gae,group_adv,policy_loss,logprob,scaling,padding,ksm

GAE (the reverse loop against the chunked scan), group advantages, the policy loss, log-probs of
sampled tokens (the fused head against the [N, V] logits), how they scale with the vocabulary, the
padding a token budget saves, keep-sampling-mask's bytes, routing replay's recompute and the batched
reward model. Start at `ComponentEntries`: each entry is a method, which bench.Bench inherits (its
`compare`, `add`, `check` and peak-memory helpers come from there); the baselines are here as plain
functions (`group_adv_loop`, `loss_reference`, `logprob_steps`), on `rl_inputs`' synthetic tensors.
Where nanorl's result and the baseline's must agree, the entry checks it. Results:
docs/bench_results.md.
"""
from __future__ import annotations

import copy
import math
import os
from functools import partial

import numpy as np
import torch

from nanorl import advantage, batching, entropy, kl, moe_replay
from nanorl.losses import LossConfig, total_loss
from nanorl.policy import response_logprobs
from nanorl.rollout import HFEngine, SamplingConfig
from nanorl.sampling import support_bytes_per_token
from nanorl.trajectory import collate


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


# ----------------------------------------------------------------------------- the entries
class ComponentEntries:
    """The component entries of bench.Bench (a mixin: self.pick, compare, add, check come from Bench)."""

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
        cuda, avail = self.device.type == "cuda", self.mem_available()
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
