"""Precision and memory: fp32 master weights, bf16/fp16 compute, activation checkpointing.

Serves links 3, 5-7 of the chain (logprob recompute, loss, backward, optimizer step) and the rollout's
forwards. RL updates are tiny (at lr 1e-6 Adam moves a weight by ~1e-6, while a bf16 weight near 0.02
moves in steps of ~1.2e-4), so the weights and Adam's state stay fp32 — the *master* copy — and only the
compute runs in `--dtype` (bfloat16 or float16) under autocast (one rank / DDP) or FSDP2's
MixedPrecisionPolicy; fp16 adds a dynamic loss scale; fp32 runs use TF32 on CUDA. The RL math stays fp32
whatever the compute dtype; the reference model is stored in the compute dtype. Start at `compute_dtype`,
`setup_device` and `autocast`; then `keep_lm_head_fp32` (--fp32-lm-head) and
`enable_gradient_checkpointing` (--gradient-checkpointing). Why, with the recipe per mode:
docs/from-slime-verl.md, "nanorl/precision.py".

Test: python -m pytest tests/test_real_scale.py tests/test_attn_dtype.py -q
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(name: str) -> torch.dtype:
    """--dtype's name → torch dtype (float32, bfloat16, float16)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def setup_device(device: torch.device) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA (a no-op elsewhere)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def autocast(device: torch.device, dtype: torch.dtype):
    """The compute-dtype context for every forward of a trained (fp32-master) module: autocast for
    bf16/fp16, nothing for fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(dtype: torch.dtype, device: torch.device):
    """fp16 only: a dynamic loss scaler (bf16 and fp32 have fp32's exponent range; None)."""
    return torch.amp.GradScaler(device.type) if dtype == torch.float16 else None


def agree_found_inf(scaler, optimizer) -> bool:
    """After `scaler.unscale_(optimizer)`: whether ANY rank found an inf/NaN gradient, written back
    into the scaler's per-device flags (all-reduce MAX), so that `scaler.step` skips and
    `scaler.update` backs off on every rank together. GradScaler checks only the gradients it holds:
    under FSDP a rank holds its shards, so ranks disagree on an overflow in one shard and their loss
    scales drift apart. (torch's FSDP1 ShardedGradScaler all-reduces the same flags; FSDP2 has no
    scaler of its own.) The flags live in GradScaler's per-optimizer state, torch 2.x layout."""
    found = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
    if not found:
        raise RuntimeError("agree_found_inf: call scaler.unscale_(optimizer) first")
    flag = torch.stack([f.float() for f in found]).amax()[None]  # [1] on the gradients' device
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    for f in found:
        f.copy_(flag[0])
    return bool(flag[0] > 0)


def fsdp_policy(dtype: torch.dtype):
    """FSDP2's mixed precision: compute in `dtype`, reduce gradients in fp32 (None for fp32)."""
    if dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


class FP32Linear(torch.nn.Linear):
    """An LM head that always computes in fp32 (autocast off, input and weight upcast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)


def keep_lm_head_fp32(model: torch.nn.Module) -> None:
    """Make the model's output embedding compute in fp32 (`--fp32-lm-head`).

    The logprob of a token is a difference of two large numbers (logit − logsumexp over 152k logits);
    computing the head in bf16 rounds each logit to ~3 significant digits, which is much of the
    engine/trainer logprob gap. MiniMax-M1 (arXiv:2506.13585) and ScaleRL (arXiv:2510.13786) keep the LM
    head in fp32 for that reason. Here the head's class is swapped for an fp32 subclass: parameter names
    and state dicts stay as they were (saving, vLLM sync, deepcopy all unaffected), and the fused
    log-prob path sees it and runs in fp32 too."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear and not isinstance(head, FP32Linear):
        raise ValueError(f"--fp32-lm-head needs an nn.Linear LM head, got {type(head).__name__}")
    # same parameters and names; deepcopy and state_dict unchanged
    head.__class__ = FP32Linear


def head_is_fp32(head: torch.nn.Module) -> bool:
    return isinstance(head, FP32Linear)


def enable_gradient_checkpointing(model: torch.nn.Module, routing_replay: bool = False) -> None:
    """Non-reentrant activation checkpointing of every transformer block (Hugging Face's own
    `gradient_checkpointing_enable`); with MoE routing replay, the recompute replays the same ids.

    A transformer layer keeps ~20-30 activations of size [tokens, hidden] for backward; with
    checkpointing only each layer's input is kept and the layer is recomputed in backward (Chen et al.
    2016, arXiv:1604.06174): one extra forward for memory that no longer grows with depth. Hugging Face
    checkpoints only `if self.gradient_checkpointing and self.training`, so the policy trains in train()
    mode — Qwen2/Llama/Qwen3 configs have dropout 0 (attention_dropout = 0.0, no hidden dropout), so
    train() changes nothing numerically — and engines that share the module (nanorl/rollout.py) switch
    it to eval() while they generate. Non-reentrant checkpointing (use_reentrant=False) works with
    inputs that need no grad and with kwargs. MoE routing replay survives the recompute through
    moe_replay.checkpoint_context."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
    kwargs = {"use_reentrant": False}
    if routing_replay:
        from nanorl.moe_replay import checkpoint_context
        kwargs["context_fn"] = checkpoint_context
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def free_cached_memory(device: torch.device) -> None:
    """Return PyTorch's cached CUDA blocks where memory changes hands (engine ↔ trainer): the other
    side allocates fresh memory, and cached-but-free blocks would count against it."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
