"""gpu_check.py — the one-shot device check: what a lent GPU machine runs once, in ~6 minutes.

    python gpu_check.py --json gpu_check.json  # one CUDA device (same as: python bench.py --gpu --json ...)
    python gpu_check.py --cpu                  # the CPU dry run, every stage at tiny sizes (test_gpu_check)
    python gpu_check.py --help                 # the stages, in run order, with their time limits

Made for one CUDA device without vLLM, flash-attn or network: models are real shapes with random weights
built in memory (nanorl/task.py). Eleven stages run in order of value, each under its own time limit: 1 step
(fwd+bwd+AdamW of the Qwen2.5-0.5B shape: time, MFU, peak memory), 2 head (the Triton fused head against
torch and fp32), then what issue 45 fixes and only a GPU shows: 7 B1 (the async vLLM worker's weight
channel on one GPU, two processes), 8 M4 (the memory plan against a 7B shape's measured peak), 6 MoE
(B2: routing replay's recompute with the batch on the GPU), 9 M2 (the fused head on a second GPU), 10
TF32 (the fp32 sync bound); then 4 FSDP (save/resume equivalence), 5 async, 3 README (train.py with the
README's GPU line), 11 N2 (vLLM's model runner and its sync check across sleep; skipped without vLLM).
A stage whose dependency is absent is skipped with the reason, a stage that raises or runs out of time
is a FAIL row, and the next stage runs; the table is printed and written (--table).
Each stage's pass criterion is a pure function over its measured results (`crit_*`), so tests feed it
planted faults. --cpu runs every stage's code with the device parts stood in for (the host's shared
memory for CUDA IPC, tensor bytes for the allocator, the torch path for a second GPU). Start at `main`,
then `run_stage`. Sizes and criteria of stages 1-6: docs/from-slime-verl.md, "gpu_check.py"; MFU:
`step_flops`. Rewards: --reward math needs math-verify (not on the device image: docs/bench_results.md);
without it stage 3 is skipped and 5 and 6 use a stand-in reward.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import importlib.util
import json
import math
import os
import pathlib
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

# random_batch, micro_batch_loss (never `bench`: bench imports this file)
import bench_steps
from nanorl import batching, entropy, precision
from nanorl.rollout import HFEngine, SamplingConfig
from nanorl.task import (
    ENDOFTEXT,
    IM_END,
    QWEN25_05B,
    build_real_shape_tokenizer,
    gsm8k_rows,
    save_model_dir,
)

ROOT = pathlib.Path(__file__).resolve().parent
# Dense bf16 tensor-core peaks (NVIDIA datasheets), matched in order against the device name, case
# ignored. PCIe / NVL boards have lower clocks and other figures: n/a rather than the SXM number.
PEAK_BF16 = (("pcie", None), ("nvl", None), ("h100", 989e12), ("h200", 989e12), ("a100", 312e12))
# Qwen3-30B-A3B's config.json, 2 of its 48 layers
QWEN3_MOE = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 vocab_size=151936, max_position_embeddings=40960, norm_topk_prob=True, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, num_hidden_layers=2)
# Qwen/Qwen2.5-7B-Instruct's config.json: stage 8's shape (7.62B parameters)
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                 tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6)
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, num_hidden_layers=2)


@dataclasses.dataclass(frozen=True)
class Sizes:
    # Qwen2Config fields of stage 1's model
    model: dict
    # train step: rows × T tokens
    rows: int
    T: int
    # generate: prompts × new tokens, prompts of prompt_len tokens
    prompts: int
    prompt_len: int
    new_tokens: int
    # timed repetitions after one warm-up
    reps: int
    # ((H, V), ...) of stage 2, N tokens in chunks of `chunk`
    head: tuple
    N: int
    chunk: int
    # Qwen2Config fields of stages 3 and 5 (vocabulary: the real one)
    dense: dict
    # Qwen3MoeConfig fields of stage 6
    moe: dict
    # stage 3 (the README's 1024); stages 5-6 use moe_new_tokens
    max_new_tokens: int
    moe_new_tokens: int
    # Qwen2Config fields of stage 8's model, and its micro-batch: big_rows × big_T tokens
    big: dict
    big_rows: int
    big_T: int


FULL = Sizes(dict(QWEN25_05B, num_hidden_layers=24), rows=4, T=2048, prompts=64, prompt_len=128,
             new_tokens=128,
             reps=5, head=((896, 151936), (3584, 152064)), N=16384, chunk=2048,
             dense=dict(QWEN25_05B, num_hidden_layers=24), moe=QWEN3_MOE, max_new_tokens=1024,
             moe_new_tokens=128, big=QWEN25_7B, big_rows=8, big_T=2048)
SMOKE = Sizes(dict(QWEN25_05B, **TINY, vocab_size=512), rows=2, T=32, prompts=4, prompt_len=8, new_tokens=8,
              reps=2, head=((32, 151936), (48, 152064)), N=64, chunk=16,
              dense=dict(QWEN25_05B, **TINY),
              moe=dict(QWEN3_MOE, **TINY, moe_intermediate_size=16, num_experts=8,
                                                         num_experts_per_tok=2, head_dim=8),
              max_new_tokens=8, moe_new_tokens=8, big=dict(QWEN25_7B, **TINY, vocab_size=512), big_rows=2,
              big_T=32)


# ----------------------------------------------------------------------------- FLOPs and peaks
def block_matmul_params(model) -> int:
    """N of the MFU formula: weights of every nn.Linear inside the transformer blocks."""
    return sum(m.weight.numel() for m in model.base_model.layers.modules() if isinstance(m, torch.nn.Linear))


def step_flops(model, rows: int, T: int, scored: int) -> float:
    """Model FLOPs of one training step (forward + backward), for MFU, model FLOPs utilisation (not
    hardware FLOPs: gradient checkpointing's recompute and the fused head's logit recompute are not
    counted). FLOPs of one step, for `rows` rows of T tokens and S scored tokens:

        6·N·rows·T  +  12·L·d·T·rows·T  +  6·V·h·S

    N = weights of the transformer blocks' matmuls (non-embedding; biases and norms left out), 6 = 2 (a
    multiply-add) × 3 (forward, and backward's two products); 12·L·d·T per token = QKᵀ and AV (2·2·d·T
    each forward) × 3, L layers, d = heads × head dim, counting the full T×T scores as PaLM does
    (Chowdhery et al. 2022, app. B); 6·V·h per scored token = the LM head. MFU = FLOPs / step time /
    peak, peak = the GPU's dense bf16 tensor-core figure from PEAK_BF16 by device name, else "n/a"."""
    c = model.config
    d = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    tokens = rows * T
    return (6 * block_matmul_params(model) * tokens + 12 * c.num_hidden_layers * d * T * tokens
            + 6 * c.vocab_size * c.hidden_size * scored)


def peak_bf16(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU by its torch.cuda.get_device_name, None if not in PEAK_BF16."""
    return next((peak for key, peak in PEAK_BF16 if key in name.lower()), None)


# ----------------------------------------------------------------------------- shared pieces
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn, reps: int, device: torch.device) -> list[float]:
    """Wall time of each of `reps` calls of fn, after one warm-up call (kernel compiles, allocator)."""
    fn()
    out = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def fmt_s(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.1f} ms"


def peak_mib(step, device) -> float | None:
    """MiB one call of step() adds at its peak (CUDA allocator statistics); None off CUDA."""
    if torch.device(device).type != "cuda":
        step()
        return None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def machine(device: torch.device) -> dict:
    import transformers
    return dict(logical_cpus=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=transformers.__version__, triton=getattr(entropy.triton, "__version__", None),
                python=platform.python_version(), device=str(device),
                load_avg_1m=round(os.getloadavg()[0], 1),
                gpu=torch.cuda.get_device_name() if device.type == "cuda" else None)


@dataclasses.dataclass
class Check:
    """One run: sizes, device, the rows printed at the end, and what the stages share (models, dirs)."""
    sizes: Sizes
    device: torch.device
    workdir: str
    smoke: bool = False
    # time.monotonic() at which the running stage is stopped
    deadline: float = math.inf
    rows: list = dataclasses.field(default_factory=list)
    _model: object = None
    _optimizer: object = None
    _dirs: dict = dataclasses.field(default_factory=dict)

    @property
    def threads(self) -> list[str]:
        return ["--threads", "1"] if self.device.type == "cpu" else []

    def row(self, section: str, what: str, value: str, note: str = "", **data):
        self.rows.append(dict(section=section, what=what, value=value, note=note, **data))
        print(f"  {section} | {what} | {value} | {note}", file=sys.stderr, flush=True)

    def reward(self) -> str:
        """--reward math where math-verify imports, else a stand-in reward file (its values vary)."""
        if math_reward_or_skip() is None:
            return "math"
        path = pathlib.Path(self.workdir, "stand_in_reward.py")
        path.write_text(STAND_IN_REWARD)
        return f"{path}:reward"

    def real_format(self, kind: str) -> dict:
        """A random-init model of the real tokenizer's format ("dense": Qwen2, sizes.dense; "moe":
        Qwen3-MoE, sizes.moe) saved in bf16 with GSM8K-format data: {"model", "train", "test"}, made once."""
        if kind in self._dirs:
            return self._dirs[kind]
        import transformers
        from transformers import GenerationConfig
        out = pathlib.Path(self.workdir, f"real_{kind}")
        out.mkdir(parents=True, exist_ok=True)
        rows = gsm8k_rows(72)
        paths = {"model": str(out / "model"), "train": str(out / "train.jsonl"),
                 "test": str(out / "test.jsonl")}
        for split, items in (("train", rows[:64]), ("test", rows[64:])):
            pathlib.Path(paths[split]).write_text("".join(json.dumps(x) + "\n" for x in items))
        cls = transformers.Qwen2Config if kind == "dense" else transformers.Qwen3MoeConfig
        config = cls(bos_token_id=ENDOFTEXT, eos_token_id=IM_END, pad_token_id=ENDOFTEXT,
                     **(self.sizes.dense if kind == "dense" else self.sizes.moe))
        torch.manual_seed(0)
        # initialised in place: no host copy of GBs of weights
        with torch.device(self.device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.generation_config = GenerationConfig(bos_token_id=ENDOFTEXT, eos_token_id=[IM_END, ENDOFTEXT],
                                                   pad_token_id=ENDOFTEXT)
        save_model_dir(model.cpu(), build_real_shape_tokenizer(), paths["model"])
        del model
        self._dirs[kind] = paths
        return paths

    def model(self):
        """Stage 1's policy (fp32 master weights, the trainer's attention kernel), built once."""
        if self._model is None:
            from transformers import Qwen2Config, Qwen2ForCausalLM
            torch.manual_seed(0)
            config = Qwen2Config(**self.sizes.model, attn_implementation=batching.best_attn_implementation(
                torch.bfloat16))
            with torch.device(self.device):
                self._model = Qwen2ForCausalLM(config)
            # training forwards; the engine asks for its cache itself
            self._model.config.use_cache = False
            self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=1e-6, betas=(0.9, 0.99))
        return self._model

    def train_step(self, checkpointing: bool):
        """(step function, scored tokens, its last {loss, grad_norm}): one rows × T micro-batch, loss →
        backward → clip → AdamW step."""
        s, model = self.sizes, self.model()
        P = s.T // 4
        batch = bench_steps.random_batch([(P, s.T - P)] * s.rows, model.config.vocab_size, self.device)
        adv = torch.randn(batch.response_ids.shape, device=self.device)  # [rows, T − P]
        scored = int(batch.response_mask.sum())
        if checkpointing:
            precision.enable_gradient_checkpointing(model)
        else:
            model.gradient_checkpointing_disable()
        # Hugging Face checkpoints only in train mode (dropout is 0 in Qwen2)
        model.train()
        out = {}

        def step():
            with precision.autocast(self.device, torch.bfloat16):
                loss = bench_steps.micro_batch_loss(model, batch, adv, scored, s.rows)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
            out.update(loss=float(loss), grad_norm=float(norm))
        return step, scored, out


# ----------------------------------------------------------------------------- pass criteria (pure)
# Each takes a stage's measured results (plain numbers and dicts) and returns the reasons it fails:
# [] passes. tests/test_gpu_check.py feeds each one a planted fault.
MISMATCH_TOL, ESS_MIN = 0.05, 0.9


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


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


def step_rows(lines: list[dict]) -> dict[int, dict]:
    """metrics.jsonl lines → {step: metrics} of the training steps (lines with a train/ or rollout/
    metric: a step whose samples all left it — failed, filtered — logs no train/ metric but is a step)."""
    out = {}
    for x in lines:
        if any(k.startswith(("train/", "rollout/")) for k in x):
            out.setdefault(x["step"], {}).update(x)
    return out


def crit_run(r: dict) -> list[str]:
    """Stages 3, 5, 6: a train.py run finished its steps, every number finite, no reward fault, trainer
    and engine agree (train/mismatch/*); with `attn` (a {dtype: calls} audit) every attention call in
    bf16; with `need` every named metric logged on every step."""
    bad = [] if r.get("rc", 0) == 0 else [f"exit status {r['rc']}: {r.get('error', '')[-300:]}"]
    steps = r["steps"]
    if sorted(steps) != list(range(1, r["want_steps"] + 1)):
        bad.append(f"steps logged {sorted(steps)}, want 1..{r['want_steps']}")
    for s, m in sorted(steps.items()):
        nan = [k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)]
        faults = {k: v for k, v in m.items() if "reward_faults/" in k and v}
        if nan:
            bad.append(f"step {s}: not finite: {nan[:5]}")
        if faults:
            bad.append(f"step {s}: reward faults {faults}")
        if not any(k.startswith("train/") for k in m):
            dropped = {k: v for k, v in m.items() if k.startswith("rollout/dropped")}
            bad.append(f"step {s}: no update (every sample left the step: {dropped})")
            continue
        mean, ess = m.get("train/mismatch/ratio_mean"), m.get("train/mismatch/ratio_ess")
        if not (finite(mean) and abs(mean - 1) <= MISMATCH_TOL and finite(ess) and ess >= ESS_MIN):
            bad.append(f"step {s}: mismatch ratio_mean {mean}, ess {ess} (want |mean − 1| <= {MISMATCH_TOL}, "
                       f"ess >= {ESS_MIN})")
        missing = [k for k in r.get("need", ()) if k not in m]
        if missing:
            bad.append(f"step {s}: missing {missing}")
    if "attn" in r:
        calls = r["attn"]
        if not calls:
            bad.append("attention audit: no attention call seen (not dispatched through AttentionInterface)")
        elif set(calls) != {"torch.bfloat16"}:
            bad.append(f"attention audit: calls by compute dtype {dict(calls)}, want bf16 only")
    return bad


def crit_resume(r: dict) -> list[str]:
    """Stage 4: the resumed run's last step equals the uninterrupted run's, metric by metric (perf/
    aside: the machine, not the math), within rel_tol; both runs exited 0."""
    bad = [f"{k} exit status {rc}" for k, rc in r["rc"].items() if rc != 0]
    a, b = r["first"], r["again"]
    if not a or a.keys() - {"step"} != b.keys() - {"step"} and not bad:
        bad.append(f"resumed step logs other metrics: {sorted(a.keys() ^ b.keys())[:5]}")
    for k, v in a.items():
        w = b.get(k)
        if k.startswith("perf/") or not isinstance(v, (int, float)) or w is None:
            continue
        if not abs(v - w) <= r["rel_tol"] * max(abs(v), abs(w), 1e-12):
            bad.append(f"resume mismatch {k}: {v!r} vs {w!r}")
    if not r.get("resumed"):
        bad.append("the second run did not resume from the step-2 checkpoint")
    return bad


# ----------------------------------------------------------------------------- stage 1: today's checks
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


# ----------------------------------------------------------------------------- stage 2: the Triton head
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


def crit_heads(r: dict) -> list[str]:
    return [f"{k}: {why}" for k, case in r.items() for why in crit_head(case)]


# ----------------------------------------------------------------------------- stages 3-6: train.py runs
# README's
PROMPT_TEMPLATE = "{prompt} Please reason step by step, and put your final answer within \\boxed{}."
STAND_IN_REWARD = "def reward(prompt, response, label):\n    return float(len(response) % 3 == 0)\n"


def rehearsal_argv(paths: dict, out_dir: str, engine: str, max_new_tokens: int = 1024, steps: int = 3,
                   reward: str = "math") -> list[str]:
    """README's GPU command line (--algo grpo ... --reward math --max-new-tokens 1024 --dtype bfloat16;
    tests/test_gpu_check.py compares) on a real-shape model and GSM8K-format data, `steps` steps of 4 × 4."""
    return ["--algo", "grpo", "--model", paths["model"], "--train-data", paths["train"], "--test-data",
            f"gsm8k={paths['test']}", "--input-key", "question,problem", "--label-key", "answer",
            "--prompt-template",
            PROMPT_TEMPLATE, "--reward", reward, "--engine", engine,
            "--max-new-tokens", str(max_new_tokens), "--dtype", "bfloat16", "--steps", str(steps),
            "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-limit", "4", "--out-dir", out_dir,
            "--quiet"]


@contextlib.contextmanager
def attention_audit():
    """Count every attention call transformers dispatches (AttentionInterface's global mapping: sdpa,
    flash, flex) by the dtype it computes in: autocast's when autocast is on for the query's device
    (sdpa runs in it; the flash path casts to it), else the query's. Yields the Counter."""
    from transformers.modeling_utils import AttentionInterface
    mapping, calls = AttentionInterface._global_mapping, collections.Counter()
    saved = dict(mapping)

    def wrapped(fn):
        def audited(module, query, *args, **kwargs):
            kind = query.device.type
            on = torch.is_autocast_enabled(kind)
            calls[str(torch.get_autocast_dtype(kind) if on else query.dtype)] += 1
            return fn(module, query, *args, **kwargs)
        return audited
    mapping.update({k: wrapped(f) for k, f in saved.items()})
    try:
        yield calls
    finally:
        mapping.update(saved)


def math_reward_or_skip() -> str | None:
    if importlib.util.find_spec("math_verify") is None:
        return ("math-verify not installed (--reward math): pip install --no-index --find-links wheels "
                "math-verify, see docs/bench_results.md")
    return None


def read_steps(out_dir: str) -> dict[int, dict]:
    path = pathlib.Path(out_dir, "metrics.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return step_rows(lines)


def train_in_process(argv: list[str]) -> dict:
    """train.main(argv) here (so the attention hook sees its forwards); rc 1 and the error if it raises."""
    import train
    try:
        out = train.main(argv)
        return dict(rc=0 if out["step"] else 1, error="")
    except Exception as e:  # noqa: BLE001  (a finding of the stage, reported by crit_run)
        return dict(rc=1, error=f"{type(e).__name__}: {e}")


def train_subprocess(c: Check, argv: list[str], nofile: int | None = None, torchrun: bool = False) -> dict:
    """train.py argv in a fresh process (a process group of its own; `nofile`: RLIMIT_NOFILE's soft limit,
    as `ulimit -n` sets it), within the stage's time left."""
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                               str(29600 + os.getpid() % 300)] if torchrun else []) + ["train.py", *argv]
    limit = None if nofile is None else (lambda: resource.setrlimit(
        resource.RLIMIT_NOFILE, (min(nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),) * 2))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, preexec_fn=limit,
                          timeout=max(10, c.deadline - time.monotonic()))
    return dict(rc=proc.returncode, error=(proc.stderr or proc.stdout)[-2000:], stdout=proc.stdout)


def readme_stage(c: Check) -> dict:
    """3: the README GPU line, HF engine, 3 steps, attention calls audited."""
    out = pathlib.Path(c.workdir, "run_readme").as_posix()
    argv = rehearsal_argv(c.real_format("dense"), out, "hf", c.sizes.max_new_tokens)
    with attention_audit() as calls:
        t = time.perf_counter()
        r = train_in_process(argv + c.threads)
        took = time.perf_counter() - t
    r.update(steps=read_steps(out), want_steps=3, attn=dict(calls))
    last = r["steps"].get(3, {})
    c.row("3 README", f"train.py README GPU line, --engine hf, {c.sizes.dense['num_hidden_layers']}-layer "
                      "real shape",
          f"{fmt_s(last.get('perf/time/step', float('nan')))} last step",
          f"whole run {fmt_s(took)}; attention "
          f"calls {dict(calls)}; mismatch ratio_mean {last.get('train/mismatch/ratio_mean')}", argv=argv)
    return r


def fsdp_stage(c: Check) -> dict:
    """4: one FSDP2 rank (NCCL on CUDA, gloo on CPU): 3 steps saved each step == 2 + resume + 1."""
    out = pathlib.Path(c.workdir, "run_fsdp")
    argv = ["--fsdp", "--dtype", "bfloat16", "--steps", "3", "--save-every", "1", "--prompts-per-step", "8",
            "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "8", "--quiet", "--out-dir",
            str(out), *c.threads]
    first = train_subprocess(c, argv, torchrun=True)
    done = read_steps(out)
    import shutil
    shutil.rmtree(out / "checkpoints" / "step_000003", ignore_errors=True)
    again = train_subprocess(c, argv + ["--resume", "latest"], torchrun=True)
    redone = read_steps(out)
    # CUDA kernels may reorder sums between two processes (atomics in backward): a relative 1e-4
    r = dict(rc={"first": first["rc"], "resumed": again["rc"]}, first=done.get(3, {}),
             again=redone.get(3, {}),
             rel_tol=0.0 if c.device.type == "cpu" else 1e-4, resumed="at step 2" in again["stdout"],
             error=first["error"] if first["rc"] else again["error"])
    c.row("4 FSDP", "torchrun 1 rank, --fsdp bf16, built-in task: 3 steps vs 2 + resume + 1",
          f"exit {first['rc']}, {again['rc']}", f"{len(r['first'])} metrics at step 3")
    return r


def async_stage(c: Check) -> dict:
    """5: --async-steps 1 and 3 on the real shape under ulimit -n 1024."""
    res = {}
    for K in (1, 3):
        out = pathlib.Path(c.workdir, f"run_async{K}").as_posix()
        argv = rehearsal_argv(c.real_format("dense"), out, "hf", c.sizes.moe_new_tokens, steps=2,
                              reward=c.reward()) + ["--async-steps", str(K), *c.threads]
        r = train_subprocess(c, argv, nofile=1024)
        r.update(steps=read_steps(out), want_steps=2)
        res[f"K{K}"] = r
        c.row("5 async", f"--async-steps {K}, ulimit -n 1024, {c.sizes.dense['num_hidden_layers']}-layer "
                         "real shape",
              f"exit {r['rc']}", f"{len(r['steps'])} steps; reward {c.reward()}")
    return res


def crit_async(r: dict) -> list[str]:
    return [f"{k}: {why}" for k, run in r.items() for why in crit_run(run)]


def moe_stage(c: Check) -> dict:
    """6 (B2): --routing-replay on a Qwen3-MoE shape, HF engine (records routing: R3), attention audited:
    the replayed recompute with the batch on the GPU; --reward math where math-verify imports, else the
    stand-in reward (no extra wheel needed)."""
    out = pathlib.Path(c.workdir, "run_moe").as_posix()
    argv = rehearsal_argv(c.real_format("moe"), out, "hf", c.sizes.moe_new_tokens, steps=2,
                          reward=c.reward()) + ["--routing-replay", *c.threads]
    with attention_audit() as calls:
        r = train_in_process(argv)
    r.update(steps=read_steps(out), want_steps=2, attn=dict(calls), need=("routing/disagreement",))
    last = r["steps"].get(2, {})
    c.row("6 MoE", f"--routing-replay, {c.sizes.moe['num_experts']} experts top "
                   f"{c.sizes.moe['num_experts_per_tok']}",
          f"replay mode {last.get('routing/replay_mode')}",
          f"disagreement {last.get('routing/disagreement')}, attention calls {dict(calls)}")
    return r


def need_math() -> str | None:
    return math_reward_or_skip()


def need_fsdp() -> str | None:
    import torch.distributed as dist
    if not dist.is_available():
        return "torch.distributed not available"
    if torch.cuda.is_available() and not dist.is_nccl_available():
        return "NCCL not available"
    return None


def need_moe() -> str | None:
    import transformers
    return None if hasattr(transformers, "Qwen3MoeConfig") else "transformers has no Qwen3MoeConfig"


# ----------------------------------------------------------------------------- stages 7-10: issue 45
# Stages whose failure can poison the process (an illegal memory access ends every later CUDA call) or
# whose memory must be measured alone run in a child process: `in_child` calls a function of this file
# there and reads its JSON answer.
CHILD_TAG = "gpu_check child result: "
CHILD = ("import json, sys, gpu_check; print(gpu_check.CHILD_TAG + json.dumps(getattr(gpu_check, sys.argv[1])"
         "(**json.loads(sys.argv[2])), default=str), flush=True)")


def in_child(c: Check, fn: str, kwargs: dict, **env: str) -> dict:
    """gpu_check.fn(**kwargs) in a fresh process (env added), within the stage's time left: its result,
    or {"error": ...} with the end of its output when it died."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, fn, json.dumps(kwargs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=max(10, c.deadline - time.monotonic()))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG):])
    return dict(error=f"child exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")


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
    from nanorl.rollout_worker import slot_layout
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
    r = in_child(c, "memory_child", dict(config=s.big, rows=s.big_rows, T=s.big_T, device=str(c.device)),
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


# 9 (M2): the fused head with its tensors on another device than the current one
def device_head_child(H: int, V: int, N: int, chunk: int, device: str, backend: str) -> dict:
    """The current device stays cuda:0, the head's tensors live on `device` (cuda:1): the Triton kernels
    must launch on their tensors' device. Compared with the torch path on the same tensors."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    h, w = peaked_head(N, H, V, dev)
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, V, (N,), generator=g).to(dev)                              # [N]
    out = {}
    for b in dict.fromkeys((backend, "torch")):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = entropy.fused_linear_logprobs_entropy(hh, ww, targets, 0.7, None, chunk_size=chunk,
                                                        backend=b)
        gh, gw = torch.autograd.grad(lp.sum() + 0.1 * ent.sum(), [hh, ww])
        sync(dev)
        out[b] = [x.detach().float() for x in (lp, ent, gh, gw)]
    errs = {n: float((a - b).abs().max() / (b.abs().max() if n.startswith("grad") else 1))
            for n, a, b in zip(("logprob", "entropy", "grad_h", "grad_w"), out[backend], out["torch"])}
    return dict(errors=errs, devices=sorted({str(x.device) for x in out[backend]}), want=str(dev),
                current=torch.cuda.current_device() if dev.type == "cuda" else None, backend=backend)


def need_second_gpu() -> str | None:
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        return "one GPU: M2 (the fused head on a second device) needs two"
    return None


def device_head_stage(c: Check) -> dict:
    """9 (M2): the Triton fused head (logprobs, entropy, both gradients) with its tensors on cuda:1 while
    cuda:0 is current, against the torch path, in a child process (a kernel launched on the wrong device
    can end the process's CUDA context). --cpu: the torch path on the host stands in."""
    H, V = c.sizes.head[-1]
    cuda = c.device.type == "cuda"
    r = in_child(c, "device_head_child", dict(H=H, V=V, N=c.sizes.N, chunk=c.sizes.chunk,
                                              device="cuda:1" if cuda else "cpu",
                                              backend="triton" if cuda else "torch"))
    if "errors" in r:
        c.row("9 M2", f"fused head on {r['want']}, current device {r['current']}, {r['backend']}",
              ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items()), "vs the torch path")
    return r


def crit_device_head(r: dict) -> list[str]:
    """Stage 9: no error, every output on the tensors' device, and the kernel agrees with the torch path
    (stage 2's "bf16 vs torch path" bounds)."""
    if "errors" not in r:
        return [f"error: {r.get('error', '')[-400:]}"]
    tol = dict(logprob=1e-3, entropy=1e-3, grad_h=1 / 64, grad_w=1 / 64)
    bad = [f"outputs on {r['devices']}, want {r['want']}"] if r["devices"] != [r["want"]] else []
    return bad + [f"{k} vs torch path: max|Δ| {v:.2e} > {tol[k]:.0e}" for k, v in r["errors"].items()
                  if not (finite(v) and v <= tol[k])]


# 10: TF32 against the fp32 sync bound
def tf32_stage(c: Check) -> dict:
    """10: an fp32 run's logprobs with TF32 matmuls (what train.py's precision.setup_device turns on) vs
    full fp32 (what vLLM computes by default), on the stage-1 shape with its LM head scaled to peaked
    logits; the statistic the sync check holds to the bound `vllm_engine.sync_bound` picks for this
    process's precision. --cpu: no TF32 (the precision setting is a no-op there)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nanorl.policy import response_logprobs
    from nanorl.vllm_engine import SYNC_BOUNDS, sync_bound
    s, dev = c.sizes, c.device
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen2ForCausalLM(Qwen2Config(**s.model, attn_implementation="sdpa"))
    model.config.use_cache = False
    model.eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # logits of std ~5: a trained model's spread (tied: embeddings too)
    P = s.T // 4
    batch = bench_steps.random_batch([(P, s.T - P)] * s.rows, model.config.vocab_size, dev)
    stat, bound, named = sync_bound(torch.float32, torch.float32)  # under this process's precision
    was, lp = torch.get_float32_matmul_precision(), {}
    try:
        for precision_ in ("highest", was):
            torch.set_float32_matmul_precision(precision_)
            with torch.no_grad():
                lp[precision_] = response_logprobs(model, batch, 1.0, entropy=False)[0]   # [rows, T − P]
    finally:
        torch.set_float32_matmul_precision(was)
    d = (lp[was] - lp["highest"]).abs()[batch.response_mask > 0]
    r = dict(precision=was, stat=stat, bound=bound, named=named, max=float(d.max()), mean=float(d.mean()),
             fp32_bound=SYNC_BOUNDS[torch.float32][1])
    c.row("10 TF32", f"fp32 logprobs, matmul precision {was} vs highest, {s.rows}×{s.T}",
          f"max {r['max']:.1e}, mean {r['mean']:.1e}", f"sync check: {stat} <= {bound:g} ({named}); the "
          f"fp32 max bound {r['fp32_bound']:g} would " + ("fail" if r["max"] > r["fp32_bound"] else "hold"))
    del model
    return r


def crit_tf32(r: dict) -> list[str]:
    """Stage 10: the sync check's statistic of the TF32 gap within the bound sync_bound picks here (a
    build that held a TF32 run to the fp32 max bound would raise a false sync error)."""
    value = r[r["stat"]]
    if not (finite(value) and value <= r["bound"]):
        return [f"{r['stat']} |Δlogprob| {value:.2e} > the sync bound {r['bound']:g} ({r['named']}, matmul "
                f"precision {r['precision']}): a healthy fp32 run would fail its sync check"]
    return []


# 11 (N2): vLLM's model runner, when vLLM is installed
N2_NOT_HERE = ("routed experts (R3) and LoRA adapters on V2 are not run here: tests/test_moe_replay.py and "
               "tests/test_lora_vllm.py on a GPU machine with vLLM")


def need_vllm() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM not installed: Model Runner V2 (N2: every CUDA run of vLLM 0.32) not checked; "
                "with vLLM this stage checks the runner, the sync check before and after a sleep/wake cycle; "
                + N2_NOT_HERE)
    return None


def runner_stage(c: Check) -> dict:
    """11 N2: which model runner vLLM runs here (V2 on CUDA, V1 on CPU: never run before on V2), and the
    engine's sync check on it: weights streamed in, then sleep (level 2: weights and KV cache dropped,
    with CUDA graphs captured) and wake through a second update, each version held to the sync bound
    against the trainer's own forward. A tiny fp32 Qwen2 shape: what V2 changes, not speed."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nanorl.vllm_engine import SyncError, VLLMEngine

    def version(v: int):
        torch.manual_seed(v)
        cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                          bos_token_id=0, eos_token_id=1, initializer_range=0.2)
        return Qwen2ForCausalLM(cfg).float().eval()
    path = pathlib.Path(c.workdir, "n2_tiny").as_posix()
    version(0).save_pretrained(path)
    cpu = c.device.type != "cuda"
    eng = VLLMEngine(path, dtype="float32", seed=0, max_model_len=256,
                     kv_cache_bytes=(4 << 20) if cpu else None, gpu_memory_utilization=0.1)
    r = dict(runner=eng.model_runner, want="v1" if cpu else "v2", sleep=eng.sleep_supported, checks=[],
             error="")
    prompts, sampling = [[0, 5, 6, 7] * 5, [0, 9] * 9], SamplingConfig(max_new_tokens=16, seed=0)
    try:
        for v in (1, 2):
            model = version(v).to(c.device)
            if v == 2:
                eng.sleep(2)  # CPU: no sleep mode, logged; CUDA: weights and KV cache dropped
            eng.update_weights(model, v)
            eng.generate(prompts, 2, sampling)
            r["checks"].append(eng.check_sync(model))
    except SyncError as e:  # the finding itself
        r["error"] = str(e)[:400]
    finally:
        eng.close()
    worst = max((x["max_abs_logprob_diff"] for x in r["checks"]), default=float("nan"))
    c.row("11 N2", f"vLLM model runner, tiny fp32 Qwen2, sleep {'level 2' if r['sleep'] else 'n/a'}",
          f"runner {r['runner'].upper()}", f"sync checks {len(r['checks'])}/2, max |Δlogprob| {worst:.1e}; "
          + N2_NOT_HERE)
    return r


def crit_runner(r: dict) -> list[str]:
    """Stage 11: the runner vLLM is expected to pick here (V2 on CUDA: otherwise V2 is still unrun), and
    both sync checks within their bound (before and after sleep)."""
    bad = [] if r["runner"] == r["want"] else [
        f"vLLM runs Model Runner {r['runner'].upper()}, want {r['want'].upper()} (its start-up log says why)"]
    if r["error"] or len(r["checks"]) != 2:
        bad.append(f"sync check: {r['error'] or 'did not run twice'}")
    return bad


# (label, stage, criterion, time limit in s on the device, dependency check → skip reason or None)
STAGES = (("1 step", step_stage, crit_step, 100, None),
          ("2 head", head_stage, crit_heads, 70, None),
          ("7 B1", transport_stage, crit_transport, 60, None),
          ("8 M4", memory_stage, crit_memory, 150, None),
          ("6 MoE", moe_stage, crit_run, 60, need_moe),
          ("9 M2", device_head_stage, crit_device_head, 60, need_second_gpu),
          ("10 TF32", tf32_stage, crit_tf32, 45, None),
          ("4 FSDP", fsdp_stage, crit_resume, 60, need_fsdp),
          ("5 async", async_stage, crit_async, 60, None),
          ("3 README", readme_stage, crit_run, 150, need_math),
          # last: vLLM in this process stays loaded
          ("11 N2", runner_stage, crit_runner, 120, need_vllm))


# ----------------------------------------------------------------------------- running and reporting
@contextlib.contextmanager
def time_limit(limit: int):
    """Raise TimeoutError in the running stage after `limit` seconds (SIGALRM: main thread, Unix)."""
    def stop(signum, frame):
        raise TimeoutError(f"still running after {limit} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(max(1, limit))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def table(rows: list) -> str:
    head = ("section", "what", "value", "note")
    lines = [tuple(str(r[k]) for k in head) for r in rows]
    widths = [max(len(x[i]) for x in lines + [head]) for i in range(len(head))]
    fmt = lambda x: " | ".join(v.ljust(w) for v, w in zip(x, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in lines])


def run_stage(c: Check, label: str, stage, criterion, limit: int, need) -> dict:
    """One stage: skipped with its reason, or run under its limit and judged by its criterion."""
    why = None if c.device.type == "cuda" or c.smoke else "no CUDA (use --smoke on a CPU)"
    why = why or (need() if need else None)
    if why:
        c.row(label, "stage", "SKIP", why)
        return dict(status="skip", reasons=[why])
    c.deadline = time.monotonic() + limit
    try:
        with time_limit(limit):
            results = stage(c)
        reasons = criterion(results)
    # One broken stage (an OOM, a kernel that fails to compile, a missing package) must not hide the
    # figures of the others: its error is its finding.
    except Exception as e:  # noqa: BLE001
        results, reasons = None, [f"{type(e).__name__}: {str(e)[:400]}"]
    c.row(label, "pass criterion", "FAIL" if reasons else "PASS", "; ".join(reasons)[:600])
    return dict(status="fail" if reasons else "pass", reasons=reasons, results=results)


def stage_list() -> str:
    """--help's list: each stage in run order, its time limit on the device and its first doc line."""
    def first(doc: str) -> str:  # its first sentence, on one line
        words = re.sub(r"^\d+:? ", "", " ".join(doc.split()).split(". ")[0])  # the label says it
        return words if len(words) <= 92 else words[:89] + "..."
    lines = [f"  {label:<9} {limit:>4} s  {first(stage.__doc__)}" for label, stage, _, limit, _ in STAGES]
    return "stages, in run order (--only takes their numbers):\n" + "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, epilog=stage_list(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true",
                   help="the CPU dry run: tiny sizes, every stage on the host (CUDA hidden), the device "
                        "parts stood in for")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, every stage, on this machine's device (figures mean nothing)")
    p.add_argument("--json", default="", help="also write machine, sizes, rows and each stage's results here")
    p.add_argument("--table", default="gpu_check.txt", help="write the printed table here too")
    p.add_argument("--only", default="", help="comma-separated stage numbers to run (e.g. 1,2); default all")
    p.add_argument("--budget", type=int, default=360,
                   help="seconds for the whole run; later stages are skipped")
    args = p.parse_args(argv)
    if args.cpu:  # before CUDA starts: this process and every child see no GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    smoke = args.smoke or args.cpu
    device = torch.device("cuda" if not args.cpu and torch.cuda.is_available() else "cpu")
    # TF32 for the fp32 matmuls, as train.py sets it
    precision.setup_device(device)
    info = machine(device)
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), file=sys.stderr, flush=True)
    start, sizes, stages = time.monotonic(), SMOKE if smoke else FULL, {}
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    with tempfile.TemporaryDirectory(prefix="nanorl-gpu-check-") as workdir:
        c = Check(sizes, device, workdir, smoke=smoke)
        for label, stage, criterion, limit, need in STAGES:
            left = int(args.budget - (time.monotonic() - start))
            if only and label.split()[0] not in only:
                continue
            print(f"[{time.monotonic() - start:5.0f} s] {label} ...", file=sys.stderr, flush=True)
            if left <= 0:
                c.row(label, "stage", "SKIP", "out of time (--budget)")
                stages[label] = dict(status="skip", reasons=["out of time"])
                continue
            # smoke: CPU sizes, but a busy CPU is slower than the device: limits at 3×
            stages[label] = run_stage(c, label, stage, criterion, min(limit * (3 if smoke else 1), left),
                                      need)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    failed = [f"{k}: {'; '.join(v['reasons'])}" for k, v in stages.items() if v["status"] == "fail"]
    total = round(time.monotonic() - start, 1)
    report = table(c.rows) + f"\nfailed: {failed or 'none'}\nseconds: {total}"
    print(report, flush=True)
    if args.table:
        pathlib.Path(args.table).write_text(report + "\n")
    if args.json:
        out = dict(machine=info, smoke=smoke, sizes=dataclasses.asdict(sizes), rows=c.rows,
                   stages=stages,
                   failed=failed, seconds=total)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
