"""gpu_check.py — nanorl's GPU figures in one short run, printed as one table.

    python gpu_check.py --json gpu_check.json    # on a CUDA machine (same as: python bench.py --gpu --json ...)
    python gpu_check.py --smoke                  # tiny sizes, any machine, no CUDA needed (tests/test_gpu_check.py)

Made for one CUDA device without vLLM, flash-attn or network and with minutes of device time: the model
is Qwen2.5-0.5B's shape (nanorl/task.py QWEN25_05B, 24 layers) with random weights, built in memory.
Every section catches its own failure, prints it and goes on (the exit status is 1 if any failed); a
section still running at its time limit (--section-limit, and the whole run's --budget) is stopped the
same way. Progress goes to stderr as it happens, the table to stdout at the end (and --json).

1. train step   policy-loss fwd+bwd + clip + AdamW step, bf16 autocast over fp32 master weights, rows of
                T = 2048 tokens (a quarter prompt, the rest scored response): step time, tokens/s, MFU.
2. memory       peak memory of that step (added to what was allocated before, and in total) with
                gradient checkpointing off and on.
3. logprob      fused log-prob + entropy at N = 8192, H = 896, V = 151936, bf16 inputs: the Triton
                kernels vs the chunked torch path vs naive materialised log_softmax; forward and backward
                time, peak memory, max |Δ| of logprobs, entropies and gradients, PASS/FAIL (tolerances printed).
4. generate     the HF engine's tokens/s, 64 prompts × 128 new tokens, bf16 autocast.
5. rehearsal    train.main with the README's GPU command line (--engine hf: no vLLM here) on a 4-layer
                make_real_shape model and its GSM8K-format data, 2 steps: pass/fail, step time.
6. vLLM         the same rehearsal with --engine vllm, or "vLLM not installed".

MFU, model FLOPs utilisation (not hardware FLOPs: gradient checkpointing's recompute and the fused head's
logit recompute are not counted). FLOPs of one step, for `rows` rows of T tokens and S scored tokens:
    6·N·rows·T  +  12·L·d·T·rows·T  +  6·V·h·S
N = weights of the transformer blocks' matmuls (non-embedding; biases and norms left out), 6 = 2 (a
multiply-add) × 3 (forward, and backward's two products); 12·L·d·T per token = QKᵀ and AV (2·2·d·T
each forward) × 3, L layers, d = heads × head dim, counting the full T×T scores as PaLM does (Chowdhery
et al. 2022, app. B; a causal kernel computes about half); 6·V·h per scored token = the LM head (V
vocabulary, h hidden; tied to the embedding, whose lookup is no matmul). MFU = FLOPs / step time / peak,
peak = the GPU's dense bf16 tensor-core figure from PEAK_BF16 by device name, else "n/a".
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import math
import pathlib
import signal
import statistics
import sys
import tempfile
import time

import torch

import bench  # peak_mib, machine
import bench_steps  # random_batch, micro_batch_loss
from nanorl import batching, entropy, precision
from nanorl.rollout import HFEngine, SamplingConfig
from nanorl.task import QWEN25_05B, make_real_shape

# Dense bf16 tensor-core peaks (NVIDIA datasheets), matched in order against the device name, case
# ignored. PCIe / NVL boards have lower clocks and other figures: n/a rather than the SXM number.
PEAK_BF16 = (("pcie", None), ("nvl", None), ("h100", 989e12), ("h200", 989e12), ("a100", 312e12))


@dataclasses.dataclass(frozen=True)
class Sizes:
    model: dict        # Qwen2Config fields
    rows: int          # train step: rows × T tokens
    T: int
    N: int             # logprob: tokens, hidden, vocabulary
    H: int
    V: int
    prompts: int       # generate: prompts × new tokens, prompts of prompt_len tokens
    prompt_len: int
    new_tokens: int
    rehearsal_layers: int
    reps: int          # timed repetitions after one warm-up


FULL = Sizes(dict(QWEN25_05B, num_hidden_layers=24), rows=4, T=2048, N=8192, H=896, V=151936,
             prompts=64, prompt_len=128, new_tokens=128, rehearsal_layers=4, reps=5)
SMOKE = Sizes(dict(QWEN25_05B, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=512, num_hidden_layers=2, max_position_embeddings=256),
              rows=2, T=32, N=64, H=32, V=1000, prompts=4, prompt_len=8, new_tokens=8, rehearsal_layers=2, reps=2)


# ----------------------------------------------------------------------------- FLOPs and peaks
def block_matmul_params(model) -> int:
    """N of the MFU formula: weights of every nn.Linear inside the transformer blocks."""
    return sum(m.weight.numel() for m in model.base_model.layers.modules() if isinstance(m, torch.nn.Linear))


def step_flops(model, rows: int, T: int, scored: int) -> float:
    """Model FLOPs of one training step (forward + backward), as the module docstring defines them."""
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


@dataclasses.dataclass
class Check:
    """One run: sizes, device, the rows printed at the end, and the model the sections share."""
    sizes: Sizes
    device: torch.device
    workdir: str
    rows: list = dataclasses.field(default_factory=list)
    failed: list = dataclasses.field(default_factory=list)
    _model: object = None
    _optimizer: object = None

    def row(self, section: str, what: str, value: str, note: str = "", **data):
        self.rows.append(dict(section=section, what=what, value=value, note=note, **data))
        print(f"  {section} | {what} | {value} | {note}", file=sys.stderr, flush=True)

    def model(self):
        """The Qwen2.5-0.5B-shaped policy (fp32 master weights, the trainer's attention kernel), built once."""
        if self._model is None:
            from transformers import Qwen2Config, Qwen2ForCausalLM
            torch.manual_seed(0)
            config = Qwen2Config(**self.sizes.model, attn_implementation=batching.best_attn_implementation())
            with torch.device(self.device):  # initialised in place: no host copy of 2 GB of weights
                self._model = Qwen2ForCausalLM(config)
            self._model.config.use_cache = False  # training forwards; the engine asks for its cache itself
            self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=1e-6, betas=(0.9, 0.99))
        return self._model

    def train_step(self, checkpointing: bool):
        """(step function, scored tokens): one rows × T micro-batch, loss → backward → clip → AdamW step."""
        s, model = self.sizes, self.model()
        P = s.T // 4
        batch = bench_steps.random_batch([(P, s.T - P)] * s.rows, model.config.vocab_size, self.device)
        adv = torch.randn(batch.response_ids.shape, device=self.device)  # [rows, T − P]
        scored = int(batch.response_mask.sum())
        if checkpointing:
            precision.enable_gradient_checkpointing(model)
        else:
            model.gradient_checkpointing_disable()
        model.train()  # Hugging Face checkpoints only in train mode (dropout is 0 in Qwen2)

        def step():
            with precision.autocast(self.device, torch.bfloat16):
                loss = bench_steps.micro_batch_loss(model, batch, adv, scored, s.rows)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
        return step, scored


# ----------------------------------------------------------------------------- the sections
def train_section(c: Check):
    """1: step time, tokens/s and MFU of the train step, checkpointing off (then only the fused head's
    logit recompute, 2·V·h per scored token, separates the hardware's FLOPs from the model's)."""
    s = c.sizes
    step, scored = c.train_step(checkpointing=False)
    t = statistics.median(seconds(step, s.reps, c.device))
    flops = step_flops(c.model(), s.rows, s.T, scored)
    name = torch.cuda.get_device_name(c.device) if c.device.type == "cuda" else "cpu"
    peak = peak_bf16(name) if c.device.type == "cuda" else None
    what = f"{s.model['num_hidden_layers']}-layer Qwen2.5-0.5B shape, {s.rows}×{s.T} tokens, bf16 autocast"
    c.row("1 train step", what, fmt_s(t), f"{s.rows * s.T / t:.0f} tok/s, median of {s.reps}", seconds=t,
          tokens_per_s=s.rows * s.T / t)
    mfu = flops / t / peak if peak else None
    c.row("1 train step", "MFU", f"{100 * mfu:.1f}%" if mfu else "n/a",
          f"{flops / 1e12:.2f} TFLOP/step (6·N·tokens + 12·L·d·T·tokens + 6·V·h·scored, N = "
          f"{block_matmul_params(c.model()) / 1e6:.1f}M), peak {f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown'}"
          f" ({name})", mfu=mfu, flops=flops, peak_flops=peak)


def memory_section(c: Check):
    """2: peak memory of the train step, gradient checkpointing off and on."""
    for ckpt in (False, True):
        step, _ = c.train_step(checkpointing=ckpt)
        step()  # warm-up: the optimizer state exists from here on, as in a run
        added = bench.peak_mib(step, c.device)
        total = torch.cuda.max_memory_allocated(c.device) / 2**20 if c.device.type == "cuda" else None
        t = statistics.median(seconds(step, 2, c.device))  # checkpointing on: + one forward of recompute
        c.row("2 memory", f"train step, checkpointing {'on' if ckpt else 'off'}",
              "n/a" if added is None else f"{added:.0f} MiB added",
              (f"{total:.0f} MiB allocated at the peak, " if total else "") + f"step {fmt_s(t)}",
              peak_added_mib=added, peak_total_mib=total, seconds=t)


def logprob_section(c: Check):
    """3: Triton vs torch vs naive log-prob + entropy, bf16 inputs, forward and backward."""
    s, dev = c.sizes, c.device
    g = torch.Generator().manual_seed(0)
    h = torch.randn(s.N, s.H, generator=g).to(dev, torch.bfloat16).requires_grad_()           # [N, H]
    w = (torch.randn(s.V, s.H, generator=g) * s.H ** -0.5).to(dev, torch.bfloat16).requires_grad_()  # [V, H]
    y = torch.randint(s.V, (s.N,), generator=g).to(dev)                                         # [N]
    impls = {"naive": lambda: entropy.naive_logprobs_entropy(h @ w.T, y),  # [N, V] logits, fp32 softmax
             "torch": lambda: entropy.fused_linear_logprobs_entropy(h, w, y, backend="torch")}
    if dev.type == "cuda" or entropy.TRITON_INTERPRETED:
        impls["triton"] = lambda: entropy.fused_linear_logprobs_entropy(h, w, y, backend="triton")
    else:
        c.row("3 logprob", "triton", "skipped: no CUDA")
    backward = lambda out: torch.autograd.grad(out[0].sum() + 0.1 * out[1].sum(), [h, w])  # noqa: E731
    values = {}
    for name, fwd in impls.items():
        out = fwd()
        values[name] = [out[0].detach(), out[1].detach(), *backward(out)]  # logprob, entropy, grad h, grad w
        fwd_t, bwd_t = [], []
        for _ in range(s.reps):
            sync(dev)
            t0 = time.perf_counter()
            out = fwd()
            sync(dev)
            t1 = time.perf_counter()
            backward(out)
            sync(dev)
            fwd_t.append(t1 - t0)
            bwd_t.append(time.perf_counter() - t1)
        peak = bench.peak_mib(lambda: backward(fwd()), dev)
        f, b = statistics.median(fwd_t), statistics.median(bwd_t)
        c.row("3 logprob", f"{name} N={s.N} H={s.H} V={s.V}", f"fwd {fmt_s(f)}, bwd {fmt_s(b)}",
              "peak n/a" if peak is None else f"peak {peak:.0f} MiB (fwd+bwd)", fwd_s=f, bwd_s=b, peak_mib=peak)
    # Tolerances. The fused paths share their bf16 logits chunk by chunk, so only fp32 row arithmetic
    # separates them; naive's one big matmul may round a logit 1 bf16 ulp differently, which moves a
    # logprob by up to that ulp: 2 ulps of the largest logit. Gradients leave in bf16 (8 bits), and
    # the fused head's grad accumulates chunk by chunk in bf16: max |Δ| within 1/32 of max |grad|.
    wf = w.detach().float()
    top = max(float((h[i:i + 1024].detach().float() @ wf.T).abs().max()) for i in range(0, s.N, 1024))
    ulp = 2.0 ** (math.floor(math.log2(max(top, 1e-3))) - 7)
    pairs = [(a, b) for a, b in (("triton", "torch"), ("triton", "naive"), ("torch", "naive")) if a in values]
    for a, b in pairs:
        tol = 1e-3 if b == "torch" else 2 * ulp
        d = [float((x.float() - y.float()).abs().max()) for x, y in zip(values[a], values[b])]
        rel = [d[k] / max(float(values[b][k].float().abs().max()), 1e-30) for k in (2, 3)]
        ok = d[0] <= tol and d[1] <= tol and max(rel) <= 1 / 32
        c.row("3 logprob", f"{a} vs {b}", "PASS" if ok else "FAIL",
              f"max|Δ| logprob {d[0]:.1e}, entropy {d[1]:.1e} (tol {tol:.1e}); grad h {rel[0]:.1e}, "
              f"grad w {rel[1]:.1e} of max|grad| (tol {1 / 32:.1e})", ok=ok, max_abs=d, grad_rel=rel, tol=tol)
        if not ok:
            c.failed.append(f"3 logprob: {a} vs {b} disagree")


def generate_section(c: Check):
    """4: HF engine generation throughput (no stop token: every row runs the full length)."""
    s, model = c.sizes, c.model()
    engine = HFEngine(model, pad_id=0, compute_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, model.config.vocab_size, (s.prompts, s.prompt_len), generator=g).tolist()
    sp = SamplingConfig(max_new_tokens=s.new_tokens, stop_token_ids=(), seed=0)
    t = statistics.median(seconds(lambda: engine.generate(prompts, 1, sp), 1, c.device))
    c.row("4 generate", f"HF engine, {s.prompts} prompts × {s.new_tokens} new tokens (prompt {s.prompt_len})",
          f"{s.prompts * s.new_tokens / t:.0f} tok/s", f"{fmt_s(t)} per call, bf16 autocast, KV cache",
          tokens_per_s=s.prompts * s.new_tokens / t)


PROMPT_TEMPLATE = "{prompt} Please reason step by step, and put your final answer within \\boxed{}."  # README's


def rehearsal_argv(paths: dict, out_dir: str, engine: str, max_new_tokens: int = 1024) -> list[str]:
    """README's GPU command line (--algo grpo ... --reward math --max-new-tokens 1024 --dtype bfloat16;
    tests/test_gpu_check.py compares) on make_real_shape's model and GSM8K-format data, 2 steps of 4 × 4."""
    return ["--algo", "grpo", "--model", paths["model"], "--train-data", paths["train"], "--test-data",
            f"gsm8k={paths['test']}", "--input-key", "question,problem", "--label-key", "answer", "--prompt-template",
            PROMPT_TEMPLATE, "--reward", "math", "--engine", engine,
            "--max-new-tokens", str(max_new_tokens), "--dtype", "bfloat16", "--steps", "2",
            "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-limit", "4", "--out-dir", out_dir,
            "--quiet"]


def run_rehearsal(c: Check, section: str, engine: str):
    import train
    paths = make_real_shape(pathlib.Path(c.workdir, "real_shape").as_posix(), layers=c.sizes.rehearsal_layers)
    argv = rehearsal_argv(paths, pathlib.Path(c.workdir, f"run_{engine}").as_posix(), engine)
    t = time.perf_counter()
    out = train.main(argv)
    took, last = time.perf_counter() - t, out["last"]
    ok = out["step"] == 2 and "perf/time/step" in last and all(math.isfinite(v) for v in last.values()
                                                          if isinstance(v, float))
    what = f"train.py README GPU flags, --engine {engine}, {c.sizes.rehearsal_layers}-layer real shape"
    c.row(section, what,
          "pass" if ok else "FAIL", f"{out['step']} steps, last step {fmt_s(last.get('perf/time/step', float('nan')))},"
          f" whole run {fmt_s(took)}", ok=ok, step_s=last.get("perf/time/step"), argv=argv)
    if not ok:
        c.failed.append(f"{section}: the run did not finish 2 finite steps")


def rehearsal_section(c: Check):
    """5: the real-shape rehearsal with the HF engine."""
    if c.device.type != "cuda":
        return c.row("5 rehearsal", "train.py README GPU flags", "skipped: no CUDA")
    run_rehearsal(c, "5 rehearsal", "hf")


def vllm_section(c: Check):
    """6: vLLM, if it is installed (this check is meant to pass without it)."""
    if importlib.util.find_spec("vllm") is None:
        return c.row("6 vLLM", "import vllm", "vLLM not installed")
    if c.device.type != "cuda":
        return c.row("6 vLLM", "rehearsal --engine vllm", "skipped: no CUDA")
    try:
        import vllm
    except ImportError as e:  # installed but broken (e.g. built for another torch): a finding, not a crash
        return c.row("6 vLLM", "import vllm", "vLLM not installed", f"import failed: {e}")
    c.row("6 vLLM", "import vllm", vllm.__version__)
    run_rehearsal(c, "6 vLLM", "vllm")


SECTIONS = {"1 train step": train_section, "2 memory": memory_section, "3 logprob": logprob_section,
            "4 generate": generate_section, "5 rehearsal": rehearsal_section, "6 vLLM": vllm_section}


# ----------------------------------------------------------------------------- running and reporting
@contextlib.contextmanager
def time_limit(limit: int):
    """Raise TimeoutError in the running section after `limit` seconds (SIGALRM: main thread, Unix)."""
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU runs it; the figures mean nothing)")
    p.add_argument("--json", default="", help="also write machine, sizes, rows and failures to this JSON file")
    p.add_argument("--budget", type=int, default=420, help="seconds for the whole run; later sections are skipped")
    p.add_argument("--section-limit", type=int, default=240, help="seconds one section may run")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision.setup_device(device)  # TF32 for the fp32 matmuls, as train.py sets it
    info = bench.machine(device)
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), file=sys.stderr, flush=True)
    start, sizes = time.perf_counter(), SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory(prefix="nanorl-gpu-check-") as workdir:
        c = Check(sizes, device, workdir)
        for label, section in SECTIONS.items():
            left = int(args.budget - (time.perf_counter() - start))
            print(f"[{time.perf_counter() - start:5.0f} s] {label} ...", file=sys.stderr, flush=True)
            if left <= 0:
                c.row(label, "", "skipped: out of time (--budget)")
                continue
            try:
                with time_limit(min(args.section_limit, left)):
                    section(c)
            # Every section reports its own failure and the next one runs: one broken piece (an OOM, a
            # kernel that fails to compile, a missing package) must not hide the figures of the others.
            except Exception as e:  # noqa: BLE001
                c.row(label, "FAILED", f"{type(e).__name__}: {str(e)[:300]}")
                c.failed.append(f"{label}: {type(e).__name__}: {e}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    total = round(time.perf_counter() - start, 1)
    print(table(c.rows) + f"\nfailed: {c.failed or 'none'}\nseconds: {total}", flush=True)
    if args.json:
        out = dict(machine=info, smoke=args.smoke, sizes=dataclasses.asdict(sizes), rows=c.rows,
                   failed=c.failed, seconds=total, flops="6·N·rows·T + 12·L·d·T·rows·T + 6·V·h·scored (MFU)")
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
