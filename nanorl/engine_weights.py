"""What the trainer hands a rollout engine that holds weights of its own (vLLM) at each weight sync.

Part of link 8 (weight sync) of the chain, engine-independent: the engine contract (nanorl/rollout.py
`RolloutEngine.update_weights`) asks `to_load` what to load, and gets one of two things:
- the trainer's full tensors under saved-checkpoint names, ONE at a time (`iter_checkpoint_tensors`):
  FSDP shards gathered tensor by tensor, and with LoRA the MERGED weights W + (α/r)·B·A under the
  base model's names (nanorl/lora.py iter_merged), never an adapter tensor (--lora-sync merged);
- or, with --lora-sync adapter, the adapters alone as an `Adapter`: `AdapterSync` saves them in PEFT's
  format in a fresh directory under a new id each time (vLLM 0.32 caches an adapter by id: a reused id
  would keep serving the old one), and the engine serves them on top of the base it loaded once.
So LoRA decides what the engine loads; the engine (nanorl/vllm_engine.py) only loads it. Start at
`to_load`. Measured, merged against adapter: docs/bench_results.md.

    python -m pytest tests/test_lora.py tests/test_weight_stream.py -q
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Adapter:
    """LoRA adapters an engine serves on top of its base weights: PEFT's files in `path`; `id` is new
    for every version (engines cache adapters by id) and `name` is unique with it."""
    name: str
    id: int
    path: str


class AdapterSync:
    """--lora-sync adapter, the trainer's side: each `save` writes the adapters of a LoRA model to a
    directory of its own under a new id and removes the previous ones; `close` removes them all.
    `rank`: the adapters' LoRA rank (an engine sizes its LoRA slots from it)."""

    def __init__(self, rank: int):
        self.rank, self.dir = rank, tempfile.mkdtemp(prefix="nanorl-lora-")
        self.latest: Adapter | None = None

    def save(self, model: torch.nn.Module) -> Adapter:
        from nanorl import lora

        n = 1 + (self.latest.id if self.latest is not None else 0)
        path = os.path.join(self.dir, f"adapter_{n}")
        lora.save_adapters(model, path)
        for old in os.listdir(self.dir):
            if old != os.path.basename(path):
                shutil.rmtree(os.path.join(self.dir, old), ignore_errors=True)
        self.latest = Adapter(f"nanorl-{n}", n, path)
        return self.latest

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def iter_checkpoint_tensors(model: torch.nn.Module,
                            dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's full tensors under saved-checkpoint names (what vLLM loads), ONE at a time: FSDP
    shards are gathered tensor by tensor (nanorl/distributed.py iter_full_tensors), so streaming into
    vLLM never holds a full state dict. transformers 5 fuses MoE experts in memory (gate_up_proj
    [E, 2I, H]); save_pretrained's reversal undoes that, here tensor by tensor (every reversal maps
    one in-memory tensor to its checkpoint tensors). LoRA: the merged weights under the base model's
    names, never an adapter tensor (nanorl/lora.py iter_merged)."""
    # DDP wrapper off
    from nanorl import lora
    from nanorl.distributed import iter_full_tensors, unwrap

    model = unwrap(model)
    tensors = lora.iter_merged if lora.is_lora(model) else iter_full_tensors
    try:
        from transformers.core_model_loading import revert_weight_conversion
    # transformers 4: in-memory names are the checkpoint names
    except ImportError:
        yield from tensors(model, dtype)
        return
    # dtype: the engine's; each shard is cast before its gather (nanorl/distributed.py)
    for name, tensor in tensors(model, dtype):
        yield from revert_weight_conversion(model, {name: tensor}).items()


def to_load(model: torch.nn.Module, dtype: torch.dtype | None,
            adapters: AdapterSync | None) -> Adapter | Iterable[tuple[str, torch.Tensor]]:
    """What an engine loads for `model`'s current weights: the adapters, saved (an engine built with an
    AdapterSync), else the lazy stream of checkpoint-named tensors in `dtype` (full, or LoRA merged)."""
    if adapters is not None:
        return adapters.save(model)
    return iter_checkpoint_tensors(model, dtype)
