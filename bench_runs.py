"""bench_runs.py — bench.py's run-level entries: train.py as a user runs it, timed to an accuracy.

    python bench.py --threads 1 --only default,default_threads,async_steps,distill,lora_memory

`default` runs `python train.py --algo grpo` (seeds 0-4) and reports held-out accuracy at time marks
and the seconds to 90% / 95%; `default_threads` the same across torch thread counts; `async_steps`
synchronous against --async-steps 1 and 2; `distill` on-policy distillation against GRPO from one warm
start; `lora_memory` LoRA against full fine-tuning in trainer-state bytes and measured peaks, then the
same arithmetic for the Qwen2.5 sizes (`lora_arithmetic`). Each entry is a method of `RunEntries`,
which bench.Bench inherits (its timing and table helpers, and bench_steps.StepEntries' `default_run`
and `timed_steps`, come from there). Results: docs/bench_results.md.
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import time
from functools import partial

import numpy as np
import torch

from bench_steps import micro_batch_loss, random_batch
from nanorl import pipeline, precision, sources
from nanorl.config import PRESETS, Config, parse_args
from nanorl.policy import load_model
from nanorl.task import make_default
from train import evaluate_run, rl_step, setup


class RunEntries:
    """The run-level entries of bench.Bench (a mixin: self.pick, add, check, default_run come from Bench)."""

    def lora_memory(self):
        """LoRA vs full fine-tuning on the real-shape model (2 layers): trainer-state bytes (parameters,
        gradients, AdamW moments, the KL's reference) counted from the tensors after one step, and the
        resident memory one step (fwd + bwd + AdamW, bf16 autocast, one micro-batch) adds at its peak
        over the loaded model: the first step, which creates the gradients and AdamW's moments (and the
        second step's peak as torch's allocator counts it: deterministic, gradients again). LoRA:
        rank 8 on every linear layer, no reference copy (adapters off). Then the same state arithmetic
        for Qwen2.5-0.5B / 7B / 32B (counted on meta-device models) on one 80 GB / 141 GB GPU. Quick: a
        tiny stand-in for the measured model (Bench.real_shape_model)."""
        from nanorl import lora
        from nanorl.policy import frozen_copy
        rng, (P, R) = np.random.default_rng(0), self.pick((64, 64), (4, 4))
        lens = [(int(rng.integers(P // 2, 3 * P // 2)), int(rng.integers(R // 2, 3 * R // 2)))
                for _ in range(4)]
        for rank in (8, 0):  # LoRA first: the full run's freed pages cannot hide its peak
            model, name = self.real_shape_model()
            model.train()
            if rank:
                lora.apply(model, rank, 32.0, 0.0, "all-linear")
            ref = None if rank else frozen_copy(model, torch.bfloat16)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
            mb = random_batch(lens, model.config.vocab_size, self.device)
            took, sizes = [], {}
            peak = self.peak_mib(partial(_lora_memory_step, model, opt, mb, took, sizes))
            # a second step, by torch's allocator (deterministic): its gradients are allocated again
            second = self.allocated_peak_mib(partial(_lora_memory_step, model, opt, mb, [], {}))
            sizes["KL reference"] = sum(p.numel() * p.element_size() for p in ref.parameters()) if ref else 0
            state = sum(sizes.values())
            parts = " + ".join(f"{k} {v / 2**20:.1f}" for k, v in sizes.items())
            self.add("lora_memory", f"{name}, {int(mb.attention_mask.sum())} tokens, bf16",
                     f"LoRA r={rank}, all-linear" if rank else "full fine-tuning", dict(median=took[0]),
                     baseline=not rank, peak_mib=peak, state_bytes=state,
                     note=f"trainer state {state / 2**20:.0f} MiB = {parts}; 2nd step allocates "
                          f"{second:.0f} MiB at its peak")
            model = ref = opt = mb = None
        for line in lora_arithmetic():
            self.notes.append("lora_memory: " + line)

    def async_steps(self):
        """Synchronous vs --async-steps 1 and 2 (and 1 with TIS, which adds the π_old recompute to the
        trainer's side; and both at half the lr, where one step of staleness costs no accuracy) on the
        default task (train.py --algo grpo), one after the other in this process (with --threads 1:
        one torch thread for the trainer, one for the rollout worker): steps/s over the steps after the
        first (the worker's start-up), the training seconds (evaluations excluded) until the held-out
        greedy accuracy first reaches 90% (evaluated every 25 steps; the run stops there), and where a
        step's time goes. Quick: 3 steps, no accuracy target."""
        steps, every, target = self.pick(800, 3), self.pick(25, 0), 0.9
        modes = {"sync": {}, "async K=1": dict(async_steps=1), "async K=2": dict(async_steps=2),
                 # staleness costs at lr 3e-4: a pair
                 "async K=1, TIS 2": dict(async_steps=1, tis_cap=2.0),
                 "sync, lr 1.5e-4": dict(lr=1.5e-4), "async K=1, lr 1.5e-4": dict(async_steps=1, lr=1.5e-4),
                 # LoRA at the README's lr (at 3e-3 K=1 diverged without --tis-cap: docs/async.md); a
                 # version carries the adapters alone (version_mib)
                 "sync, LoRA r8, lr 1e-3": dict(lora_rank=8, lr=1e-3),
                 "async K=1, LoRA r8, lr 1e-3": dict(async_steps=1, lora_rank=8, lr=1e-3)}
        if importlib.util.find_spec("vllm") is not None:  # the vLLM engine, in the trainer / in the worker
            modes.update({"sync, vLLM": dict(engine="vllm"),
                          "async K=1, vLLM": dict(async_steps=1, engine="vllm"),
                          "async K=1, TIS 2, vLLM": dict(async_steps=1, tis_cap=2.0, engine="vllm")})
        for name, flags in modes.items():
            # each lr: its own sync baseline
            K, lr = flags.get("async_steps", 0), flags.get("lr", Config.lr)
            engine = flags.get("engine", "hf")
            lora = f"LoRA r{flags['lora_rank']}, " if flags.get("lora_rank") else ""
            case = (f"default task, {engine} engine, {lora}lr {lr:g}, ≤{steps} steps, "
                    f"{self.threads or 'default'} thread(s) per side")
            # what `train.py --algo grpo` runs
            run = self.default_run(steps=steps, **PRESETS["grpo"][1], **flags)
            if K:  # as train.run_training: the worker becomes the sample source
                run.pipeline = pipeline.start(run)
                run.source = sources.Worker(run.pipeline, run.source)
            took, per, accs, reached = [], [], [], None
            try:
                while run.step < steps and reached is None:
                    t = time.perf_counter()
                    per.append(rl_step(run))
                    run.step += 1
                    took.append(time.perf_counter() - t)
                    if every and run.step % every == 0:
                        accs.append(evaluate_run(run)["eval/accuracy"])
                        reached = (run.step, sum(took)) if accs[-1] >= target else None
            finally:
                if run.pipeline is not None:
                    run.pipeline.close()
                if hasattr(run.engine, "close"):  # vLLM: one engine per process at a time
                    run.engine.close()
                run.rewards.close()
                run.logger.close()
            warm, ms = took[1:] or took, per[1:] or per
            phase = lambda k: 1e3 * statistics.median(m.get(k, 0.0) for m in ms)  # noqa: E731  ms per step
            where = (f"train {phase('perf/time/train'):.0f} ms, logprob+advantage "
                     f"{phase('perf/time/logprob') + phase('perf/time/advantage'):.0f} ms, "
                     + (f"waits {phase('perf/time/generate'):.0f} ms for data; worker: generate "
                        f"{phase('perf/async/generate_s'):.0f} ms, load "
                        f"{phase('perf/async/load_s'):.0f} ms, waits "
                        f"{phase('perf/async/engine_wait_s'):.0f} ms for weights"
                        if K else f"generate {phase('perf/time/generate'):.0f} ms, reward "
                                  f"{phase('perf/time/reward'):.0f} ms"))
            # the bytes one published version carries to the worker (the policy, or LoRA's adapters)
            mib = ms[-1].get("rollout/async/version_mib") if K else None
            self.add("async_steps", case, name, dict(median=statistics.median(warm)),
                     baseline=K == 0, steps_per_s=len(warm) / sum(warm), steps_run=run.step, version_mib=mib,
                     step_to_90=reached[0] if reached else None,
                     seconds_to_90=reached[1] if reached else None,
                     best_accuracy=max(accs, default=None),
                     note=f"{len(warm) / sum(warm):.2f} steps/s; " +
                     (f"{mib:.3f} MiB per version; " if K else "") +
                     (f"90% at step {reached[0]}, {reached[1]:.0f} s; "
                          if reached else f"90% not reached (best {max(accs):.3f}); " if accs else "") +
                     where)

    def default(self):
        """`python train.py --algo grpo` as a user runs it (parse_args, train.setup, train.rl_step — the
        same loop), seeds 0-4: held-out greedy accuracy after 30/60/90/120 s of training and at the end
        (evaluation time excluded; evaluated every 25 steps and at each mark), the training seconds
        until 90% and 95%, and the median step split by phase. Quick: one seed, 3 steps."""
        seeds, steps = self.pick(range(5), range(1)), self.pick(None, 3)
        marks, every = (30, 60, 90, 120), self.pick(25, 0)
        for seed in seeds:
            argv = ["--algo", "grpo", "--seed", str(seed), "--quiet", "--eval-every", "0",
                    # one task dir: built once
                    "--out-dir", os.path.join(self.workdir, "default")]
            argv += ["--threads", str(self.threads)] * bool(self.threads) + ["--steps",
                                                                             str(steps)] * bool(steps)
            # builds the built-in task in out_dir/task, as train.py does
            run = setup(parse_args(argv))
            accs, reach, per, trained, due = {}, {}, [], 0.0, list(marks)
            before = evaluate_run(run)["eval/accuracy"]
            try:
                while run.step < run.cfg.steps:
                    t = time.perf_counter()
                    per.append(rl_step(run))
                    run.step += 1
                    trained += time.perf_counter() - t
                    passed = [m for m in due if trained >= m]
                    if passed or (every and run.step % every == 0) or run.step == run.cfg.steps:
                        acc = evaluate_run(run)["eval/accuracy"]
                        for m in passed:
                            accs[m], due = acc, [d for d in due if d != m]
                        for goal in (0.90, 0.95):
                            if acc >= goal and goal not in reach:
                                reach[goal] = (run.step, trained)
            finally:
                run.rewards.close()
                run.logger.close()
            phase = {k[len("perf/time/"):]: 1e3 * statistics.median(m.get(k, 0.0) for m in per)
                     # ms per step
                     for k in per[0] if k.startswith("perf/time/")}
            at = lambda g: (  # noqa: E731
                f"{reach[g][1]:.0f} s (step {reach[g][0]})" if g in reach else "not reached")
            self.add("default", f"train.py --algo grpo, {self.threads or 'auto'} thread(s), {run.step} steps",
                     f"seed {seed}", dict(median=phase["step"] / 1e3), baseline=seed == 0,
                     accuracy_before=before,
                     accuracy_at_s={m: accs.get(m) for m in marks}, accuracy_end=acc, train_s=trained,
                     s_to_90=reach.get(0.90, (None, None))[1], s_to_95=reach.get(0.95, (None, None))[1],
                     phase_ms=phase,
                     note=(f"{100 * before:.1f}% → " +
                           " ".join(f"{m}s {100 * accs[m]:.1f}%" for m in marks if m in accs)
                           + f" end {100 * acc:.1f}% ({trained:.0f} s); 90% at {at(0.90)}, "
                             f"95% at {at(0.95)}; step "
                           + ", ".join(f"{k} {v:.0f}" for k, v in phase.items()) + " ms"))

    def default_threads(self):
        """The built-in run's median step at 1 thread vs 2, on the machine as it is and with one core kept
        busy by another process (a Python spin loop, as a second run or a pip install would): why the
        built-in task defaults to 1 thread (Config.flag_default('threads')). 15 steps each after one
        warm-up."""
        n, burn, restore = self.pick(15, 2), [sys.executable, "-c",
                                              "while True: pass"], torch.get_num_threads()
        for busy in (False, True):
            spinner = subprocess.Popen(burn) if busy else None
            try:
                for threads in (1, 2):
                    run = setup(parse_args(["--algo", "grpo", "--quiet", "--threads", str(threads),
                                            "--out-dir", os.path.join(self.workdir, "default")]))
                    took = []
                    for _ in range(n + 1):
                        t = time.perf_counter()
                        rl_step(run)
                        run.step += 1
                        took.append(time.perf_counter() - t)
                    run.rewards.close()
                    run.logger.close()
                    self.add("default_threads", "one core busy" if busy else "machine as it is",
                             f"{threads} thread(s)",
                             dict(median=statistics.median(took[1:]), max=max(took[1:])),
                             baseline=threads == 1,
                             note=f"median {1e3 * statistics.median(took[1:]):.0f} ms, worst "
                                  f"{1e3 * max(took[1:]):.0f} ms")
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
        torch.set_num_threads(restore)

    def distill(self):
        """On-policy distillation vs GRPO from the same warm start (the 60-step SFT, 27.5% held-out),
        side by side: --algo distill with a teacher that is the same model given 300 more SFT steps
        (98% held-out) against --algo grpo, lr 3e-4 both, seeds 0-2, 150 steps, held-out greedy
        accuracy every 10 steps: the steps (and training seconds) to 60% — a level the warm start is far
        from — and the accuracy at the end. Quick: one seed, 3 steps, a 5-step teacher."""
        from nanorl import task
        seeds, steps, every = self.pick(range(3), range(1)), self.pick(150, 3), self.pick(10, 3)
        paths = make_default(os.path.join(self.workdir, "distill"), sft_steps=60)
        model, tok = load_model(paths["model"])
        task.warm_start(model, tok, task.problems()[0], steps=self.pick(300, 5), seed=1)
        teacher = os.path.join(self.workdir, "distill", "teacher")
        task.save_model_dir(model, tok, teacher)
        data = ["--model", paths["model"], "--train-data", paths["train"], "--test-data", paths["test"]]
        for algo, extra in (("grpo", []), ("distill", ["--teacher", teacher])):
            for seed in seeds:
                run = setup(parse_args(data + extra + [
                    "--algo", algo, "--seed", str(seed), "--steps", str(steps), "--lr", "3e-4", "--quiet",
                    "--eval-every", "0", "--out-dir", os.path.join(self.workdir, "distill", f"{algo}{seed}")]
                    + ["--threads", str(self.threads)] * bool(self.threads)))
                before, trained, reach, acc = evaluate_run(run)["eval/accuracy"], 0.0, None, 0.0
                try:
                    while run.step < steps:
                        t = time.perf_counter()
                        rl_step(run)
                        run.step += 1
                        trained += time.perf_counter() - t
                        if run.step % every == 0 or run.step == steps:
                            acc = evaluate_run(run)["eval/accuracy"]
                            reach = reach or ((run.step, trained) if acc >= 0.6 else None)
                finally:
                    run.rewards.close()
                    run.logger.close()
                self.add("distill", f"from the 60-step warm start, {steps} steps, lr 3e-4",
                         f"{algo} seed {seed}",
                         dict(median=trained / steps), baseline=algo == "grpo" and seed == 0,
                         accuracy_before=before, accuracy_end=acc, train_s=trained,
                         steps_to_60=reach[0] if reach else None,
                         note=f"{100 * before:.1f}% → {100 * acc:.1f}%; 60% at " + (
                             f"step {reach[0]} ({reach[1]:.0f} s)" if reach else "not reached"))


# Qwen2.5 shapes (their config.json files): hidden, MLP, layers, heads, KV heads, vocabulary, tied
QWEN25 = {"0.5B": (896, 4864, 24, 14, 2, 151936, True), "7B": (3584, 18944, 28, 28, 4, 152064, False),
          "32B": (5120, 27648, 64, 40, 8, 152064, False)}


def lora_arithmetic(rank: int = 8, gpus=(80, 141)) -> list[str]:
    """Trainer-state GB of full fine-tuning vs LoRA (rank `rank`, every linear layer but the head) for
    the QWEN25 sizes, parameters counted on meta-device models (no memory): full = fp32 weights, fp32
    gradients, AdamW's two fp32 moments (16 B/param) + the KL's bf16 reference (2 B/param); LoRA = the
    fp32 base as nanorl holds it (4 B/param; 2 if it were kept in bf16: it never updates) + 16 B per
    adapter parameter, no reference. What each leaves of one GPU for activations, vLLM's bf16 copy
    (2 B/param) and its KV cache."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    lines = []
    for name, (h, i, layers, heads, kv, vocab, tied) in QWEN25.items():
        cfg = Qwen2Config(hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                          tie_word_embeddings=tied)
        with torch.device("meta"):
            model = Qwen2ForCausalLM(cfg)
        n = sum(p.numel() for p in model.parameters())
        adapters = sum(rank * (m.in_features + m.out_features) for k, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and k != "lm_head")
        full, base = 18 * n / 1e9, 4 * n / 1e9
        lo, lo16 = base + 16 * adapters / 1e9, base / 2 + 16 * adapters / 1e9
        left = lambda x: ", ".join(f"{g} GB: {g - x:+.0f}" for g in gpus)  # noqa: E731
        lines.append(f"Qwen2.5-{name} ({n / 1e9:.2f}B params, LoRA r={rank} {adapters / 1e6:.1f}M): full "
                     f"{full:.1f} GB ({left(full)}); LoRA fp32 base {lo:.1f} GB ({left(lo)}); LoRA bf16 base "
                     f"{lo16:.1f} GB ({left(lo16)}); + vLLM bf16 weights {2 * n / 1e9:.1f} GB")
    return lines


def _lora_memory_step(model, opt, mb, took, sizes):
    """One fwd + bwd + AdamW step of the policy loss (lora_memory); `sizes` gets the state's bytes."""
    t = time.perf_counter()
    with precision.autocast(mb.input_ids.device, torch.bfloat16):
        adv = torch.randn(mb.response_ids.shape)
        loss = micro_batch_loss(model, mb, adv, mb.response_mask.sum(), mb.input_ids.shape[0])
    loss.backward()
    unique = {id(p): p for p in model.parameters()}.values()  # tied weights once
    sizes["params"] = sum(p.numel() * p.element_size() for p in unique)
    sizes["grads"] = sum(p.grad.numel() * p.grad.element_size() for p in unique if p.grad is not None)
    opt.step()
    opt.zero_grad(set_to_none=True)
    took.append(time.perf_counter() - t)
    sizes["AdamW"] = sum(x.numel() * x.element_size() for st in opt.state.values() for x in st.values()
                         if torch.is_tensor(x) and x.dim() > 0)
