"""The memory plan: what one GPU of a run will hold, estimated at start from the model's size and the
flags, so a run that cannot fit stops in its first seconds with the levers named, instead of running
out of memory at step 1 or when vLLM wakes up (7B GRPO with default flags on one H200: issue 45, M4).

Start at `estimate`, which builds the terms one by one (bytes per GPU), then `Plan.line` (printed on
CUDA runs) and `Plan.refusal` (the one line a run that does not fit raises). Three groups of terms:
resident all run (fp32 master weights, AdamW's two moments, the KL's reference copy, a critic, the async
worker's copies on this GPU, vLLM when it never sleeps), the training phase (gradients, autocast's
compute-dtype weight copies, one micro-batch's activations) and the sampling phase (vLLM's share while
awake, or the HF engine's KV cache). Peak = resident + the larger phase. --fsdp divides the masters,
gradients, moments and reference by the ranks; --lora-rank leaves gradients and moments to the adapters
and needs no reference copy. The state terms are exact; activations are a count for a Llama/Qwen2 block,
which gpu_check.py's memory stage measures on a 7B shape. torch and the standard library only.
Test: python -m pytest tests/test_memory_plan.py -q
"""
from __future__ import annotations

import dataclasses
import math

GiB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# the fused LM head holds about 4 chunks of logits-sized temporaries at a time (nanorl/entropy.py's
# _LINEAR_BUDGET_BYTES, 256 MiB, per chunk)
FUSED_HEAD_BYTES = 4 * (256 << 20)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the plan reads of a model (nanorl/build.py `model_shape` fills it from a loaded one)."""
    params: int        # every parameter, tied ones once
    trainable: int     # those the optimizer steps (LoRA: the adapters)
    layers: int
    hidden: int
    intermediate: int  # the MLP width a token passes through (MoE: experts per token × expert width)
    vocab: int
    kv_width: int      # key/value heads × head size (the KV cache per layer and token, each of K and V)


@dataclasses.dataclass
class Plan:
    """Bytes per GPU by term, in three groups; `peak` = resident + the larger phase."""
    resident: dict[str, float]
    train: dict[str, float]
    sample: dict[str, float]
    device_bytes: int | None = None  # the GPU's memory, None off CUDA
    levers: list[str] = dataclasses.field(default_factory=list)

    @property
    def peak(self) -> float:
        return sum(self.resident.values()) + max(sum(self.train.values()), sum(self.sample.values()))

    def fits(self) -> bool:
        return self.device_bytes is None or self.peak <= self.device_bytes

    def line(self) -> str:
        """One line: each group's terms in GiB, the peak, and the device's memory."""
        def terms(d: dict) -> str:
            return " + ".join(f"{k} {v / GiB:.1f}" for k, v in d.items() if v) or "0"
        total = "" if self.device_bytes is None else f" of the GPU's {self.device_bytes / GiB:.1f}"
        return (f"memory plan (GiB per GPU): resident {terms(self.resident)}; training + "
                f"{terms(self.train)}; sampling + {terms(self.sample)}; peak {self.peak / GiB:.1f}{total}")

    def refusal(self) -> str:
        return (f"the run needs ~{self.peak / GiB:.1f} GiB per GPU, more than the GPU's "
                f"{self.device_bytes / GiB:.1f} GiB ({self.line()}). Levers: {'; '.join(self.levers)}")


def micro_batch_tokens(cfg, world: int) -> int:
    """Tokens of one training forward: the --max-tokens-per-micro-batch budget, else the micro-batch's
    rows at the longest prompt + response (prompts are not read yet: the bound, not the mean)."""
    if cfg.memory.max_tokens_per_micro_batch:
        return cfg.memory.max_tokens_per_micro_batch
    rows = cfg.memory.micro_batch_size or math.ceil(cfg.prompts_per_step * cfg.samples_per_prompt / world
                                             / cfg.optim.mini_batches)
    return rows * (cfg.prompts.max_prompt_len + cfg.max_new_tokens)


def activation_bytes(shape: Shape, cfg, tokens: int) -> tuple[float, float]:
    """(held, recomputed): one micro-batch's activations held for backward, and with checkpointing the
    one block recomputed at a time in backward (0 without). A Llama/Qwen2 block under bf16 autocast
    with fp32 masters keeps per token ~36·H bytes (fp32 residual stream and norms, bf16 casts of each
    projection's input, q/k/v, attention output) + 8·W (W: the MLP width; gate, up, their activation
    and product); without autocast (fp32) ~32·H + 16·W. With checkpointing each block keeps only its
    fp32 input (4·H). The LM head: fused chunks, or (naive) [tokens, V] bf16 logits, fp32 logprobs and
    their gradient."""
    H, W = shape.hidden, shape.intermediate
    block = tokens * (36 * H + 8 * W if DTYPE_BYTES[cfg.memory.dtype] < 4 else 32 * H + 16 * W)
    head = FUSED_HEAD_BYTES if cfg.memory.logprob_impl == "fused" else 10 * tokens * shape.vocab
    if cfg.memory.gradient_checkpointing:
        return tokens * 4 * H * shape.layers + head, block + tokens * 8 * H  # + its input's gradients
    return block * shape.layers + head, 0


def engine_share(shape: Shape, cfg, device_bytes: int | None) -> float:
    """vLLM's memory while awake: --kv-cache-gb plus its weights when fixed, else its share of the GPU
    (--gpu-memory-utilization × the card: vLLM 0.32 budgets weights, KV cache and its activations in it)."""
    if cfg.vllm.kv_cache_gb > 0:
        return cfg.vllm.kv_cache_gb * GiB + DTYPE_BYTES[cfg.memory.dtype] * shape.params
    return cfg.vllm.gpu_memory_utilization * (device_bytes or 0)


def estimate(shape: Shape, cfg, *, vllm: bool, world: int = 1, device_bytes: int | None = None,
             worker_here: bool = False) -> Plan:
    """The plan of one GPU. cfg: the run's Config (read only); vllm: the engine is vLLM (resolved
    from --engine auto); world: ranks; device_bytes: the GPU's memory (None off CUDA); worker_here:
    --async-steps with the rollout worker on this same GPU."""
    b, P, N = DTYPE_BYTES[cfg.memory.dtype], shape.params, shape.trainable
    shards = world if cfg.memory.fsdp else 1
    lora = cfg.lora.rank > 0
    K = cfg.pipeline.async_steps
    # vLLM on this GPU: the synchronous engine, or the async worker's when it runs here
    share = engine_share(shape, cfg, device_bytes) if vllm and (not K or worker_here) else 0.0
    # it frees its share between rollouts only where it sleeps in this process (the synchronous engine
    # with --sleep-level > 0); the async worker's never sleeps
    held = bool(K) or cfg.vllm.sleep_level == 0
    rows = math.ceil(cfg.prompts_per_step * cfg.samples_per_prompt / world)
    # the HF engine's KV cache: every row of the batch at its longest, K and V per layer
    longest = cfg.prompts.max_prompt_len + cfg.max_new_tokens
    kv = 0 if vllm else rows * longest * shape.layers * 2 * shape.kv_width * b
    resident = {
        "fp32 masters": 4 * P / shards,
        "Adam": 8 * N / shards,
        # LoRA's reference is the policy with its adapters off: no copy
        f"reference ({cfg.memory.dtype})": b * P / shards if cfg.uses_reference and not lora else 0,
        # PPO's critic: a trained copy of the body (its masters and moments; the head's few aside)
        "critic": (4 * P + 8 * N) / shards if cfg.vf_coef > 0 else 0,
        # --fsdp with the HF engine: it samples from a full compute-dtype copy on every rank
        "HF engine copy": b * P if cfg.memory.fsdp and not vllm else 0,
        # the async worker on this GPU, sampling while the trainer trains: its model copy (with vLLM only
        # for the sync check or, with LoRA, as the reference: rollout_worker.Worker), its reference (LoRA:
        # that copy, adapters off), and with vLLM the one slot versions cross in (weight_broadcast: ipc on
        # one GPU; the K+2 it may hold wait in host memory; LoRA: the adapters), else the HF engine's KV cache
        "async worker": ((bool(cfg.vllm.sync_check_every or not vllm or (lora and cfg.uses_reference))
                          + (cfg.uses_reference and not lora)) * b * P + vllm * b * (N if lora else P)
                         + kv if K and worker_here else 0),
        "vLLM (awake all run)": share if held else 0,
    }
    tokens = micro_batch_tokens(cfg, world)
    held_acts, recomputed = activation_bytes(shape, cfg, tokens)
    # autocast caches the compute-dtype copy of every trainable weight for a whole forward, while the
    # earlier micro-batches' gradients are held; frozen ones (LoRA's base) are cast per use and kept for
    # backward only without checkpointing. FSDP gathers its own compute-dtype copies per layer.
    mem = cfg.memory
    copies = b * N + (0 if mem.gradient_checkpointing else b * (P - N)) if b < 4 and not mem.fsdp else 0
    train = {
        "gradients": 4 * N * (1 + (cfg.vf_coef > 0)) / shards,
        f"activations ({tokens} tokens)": held_acts,
        # the forward ends holding the copies; backward has freed them when it recomputes a block
        "autocast copies" if copies >= recomputed else "recomputed block": max(copies, recomputed),
    }
    sample = {"vLLM": 0 if held else share, "HF KV cache": 0 if K else kv}
    plan = Plan(resident, train, sample, device_bytes)
    plan.levers = levers(plan, cfg, world)
    return plan


def levers(plan: Plan, cfg, world: int) -> list[str]:
    """What would shrink this plan, each with what it saves (GiB)."""
    g = lambda x: f"{x / GiB:.1f} GiB"  # noqa: E731
    ref = next(v for k, v in plan.resident.items() if k.startswith("reference"))
    out = []
    if ref:
        out.append(f"--kl-coef 0 (no reference copy: −{g(ref)})")
    share = plan.resident["vLLM (awake all run)"] or plan.sample["vLLM"]
    if share:
        out.append(f"a lower --gpu-memory-utilization (now {cfg.vllm.gpu_memory_utilization}: vLLM's share "
                   f"{g(share)})")
    act = next(v for k, v in plan.train.items() if k.startswith("activations"))
    out.append(f"a smaller --max-tokens-per-micro-batch (activations: {g(act)}"
               + ("" if cfg.memory.gradient_checkpointing else "; or --gradient-checkpointing") + ")")
    if not cfg.lora.rank:
        full = plan.resident["Adam"] + plan.train["gradients"]
        out.append(f"--lora-rank 16 (gradients and AdamW moments of the adapters only: ~−{g(full)})")
    sharded = plan.resident["fp32 masters"] + plan.resident["Adam"] + plan.train["gradients"]
    out.append(f"--fsdp over more GPUs (divides masters, gradients and moments: {g(sharded)} here"
               + (f" over {world} ranks" if cfg.memory.fsdp else "") + ")")
    return out
