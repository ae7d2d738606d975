"""gpu_check.py's shared parts: the run's sizes, the `Check` every stage is handed, FLOPs and peaks.

Start at `Sizes` (FULL on the device, SMOKE for --cpu / --smoke: the same stages at tiny sizes) and
`Check` (one run: its device, working directory, printed rows, and what stages share, made once: stage
1's model and optimizer, random-init models of the real tokenizer's format with GSM8K-format data).
Also: `step_flops` (the MFU's numerator: the blocks' matmuls, attention and the LM head on the scored
tokens, forward and backward) and `peak_bf16` (its denominator, from the device's name), timing
(`seconds`, `peak_mib`), the machine line, and `in_child` (a stage function in a fresh process, for
stages whose failure can poison CUDA or whose memory must be measured alone). Key choice: models are
real shapes with random weights built in memory, so the check needs no network and no downloads.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time

import torch

# random_batch, micro_batch_loss (never `bench`: bench imports gpu_check)
import bench_steps
from nanorl import batching, entropy, precision
from nanorl.task import (
    ENDOFTEXT,
    IM_END,
    QWEN25_05B,
    build_real_shape_tokenizer,
    gsm8k_rows,
    save_model_dir,
)

# the repository: train.py and the children run from here
ROOT = pathlib.Path(__file__).resolve().parent.parent


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


STAND_IN_REWARD = "def reward(prompt, response, label):\n    return float(len(response) % 3 == 0)\n"


def math_reward_or_skip() -> str | None:
    if importlib.util.find_spec("math_verify") is None:
        return ("math-verify not installed (--reward math): pip install --no-index --find-links wheels "
                "math-verify, see docs/bench_results.md")
    return None


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


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# Stages whose failure can poison the process (an illegal memory access ends every later CUDA call) or
# whose memory must be measured alone run in a child process: `in_child` calls a function of a
# gpu_checks module there and reads its JSON answer.
CHILD_TAG = "gpu_check child result: "
CHILD = ("import importlib, json, sys; from gpu_checks.common import CHILD_TAG; "
         "m, f = sys.argv[1].split(':'); fn = getattr(importlib.import_module(m), f); "
         "print(CHILD_TAG + json.dumps(fn(**json.loads(sys.argv[2])), default=str), flush=True)")


def in_child(c: Check, fn: str, kwargs: dict, **env: str) -> dict:
    """fn(**kwargs) in a fresh process (env added), within the stage's time left: its result, or
    {"error": ...} with the end of its output when it died. fn: "module:function"."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, fn, json.dumps(kwargs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=max(10, c.deadline - time.monotonic()))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG):])
    return dict(error=f"child exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
