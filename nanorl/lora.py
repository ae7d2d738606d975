"""LoRA: train low-rank adapters (PEFT) instead of every weight (--lora-rank > 0).

A LoRA layer replaces a frozen weight W by W + (α/r)·B·A, with A [r, in] and B [out, r] trained
and B starting at 0, so step 0 is the base model exactly (Hu et al. 2021, arXiv:2106.09685). Every
linear layer of attention and MLP is adapted by default: attention-only LoRA underperforms ("LoRA
Without Regret", Schulman et al. 2025), which also finds LoRA's best lr ~10x full fine-tuning's.

Start at `apply`: it calls PEFT's get_peft_model on the Hugging Face model IN PLACE (its Linear layers
become peft LoRA layers) and keeps the PeftModel wrapper beside it, so the rest of nanorl still holds
the plain causal LM (`model.base_model`, `get_output_embeddings`, ...). What changes elsewhere:
- the update: only adapter parameters require grad, so the optimizer (nanorl/build.py) holds only them;
- the reference (a KL term): the same module with its adapters off (`Reference`), no frozen copy;
- the sync: the HF engine samples from the module itself, adapters on; vLLM gets the MERGED weights
  W + (α/r)·B·A under the base model's own names (`iter_merged`), streamed through the same verified
  reload as full fine-tuning, one tensor at a time; the base stays untouched (merging in place and
  back would round the base weights); --lora-sync adapter hands vLLM the adapters instead (its own
  LoRA). What the engine loads is decided in nanorl/engine_weights.py, not in the engine;
- --async-steps: a published version is the adapters alone (`adapter_state`); the rollout worker holds
  the base once, adapted the same way, and loads each version into its adapters (nanorl/rollout_worker.py);
- checkpoints hold the adapters in PEFT's format (`save_adapters`: PeftModel.from_pretrained loads
  them) instead of the full model; `python -m nanorl.export` writes a merged HF checkpoint.

    python -m pytest tests/test_lora.py -q
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import torch

ADAPTER_FILE = "adapter_model.safetensors"


def apply(model: torch.nn.Module, rank: int, alpha: float, dropout: float, targets: str) -> object:
    """Inject LoRA adapters into `model` in place (PEFT), freeze everything else; return the PeftModel
    wrapper, also kept on the model (`peft_of`). targets: "all-linear" (every Linear but the LM head)
    or comma-separated module names."""
    from peft import LoraConfig, get_peft_model

    names = targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=names,
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    # a plain attribute, not a submodule: the wrapper contains `model` (no cycle in modules())
    object.__setattr__(model, "_nanorl_peft", peft_model)
    return peft_model


def peft_of(model: torch.nn.Module):
    """The PeftModel wrapper of a model `apply` adapted (a DDP / Trained wrapper is looked through),
    else None."""
    model = getattr(model, "module", model)
    model = getattr(model, "policy", model)
    return model.__dict__.get("_nanorl_peft")


def is_lora(model: torch.nn.Module) -> bool:
    return peft_of(model) is not None


class Reference:
    """The reference policy of a LoRA run: `trained` (nanorl/distributed.py Trained over the adapted
    policy) called with the adapters off, i.e. the frozen base model — no copy of it. Called like the
    reference module it replaces: (batch, support) -> (logprobs, entropy, values)."""

    def __init__(self, peft_model, trained):
        self.peft_model, self.trained = peft_model, trained

    def __call__(self, batch, support=None):
        with self.peft_model.disable_adapter():
            return self.trained(batch, support)


def adapter_state(model: torch.nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The adapter tensors of an adapted model (every `lora_` entry of its state dict, under its own
    names): all that training changes, so all that a new weight version carries to the async rollout
    worker, which holds the frozen base once (nanorl/weight_broadcast.py version_state)."""
    return {n: t for n, t in model.state_dict(keep_vars=keep_vars).items() if ".lora_" in n}


def _merged_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def iter_merged(model: torch.nn.Module,
                dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the merged model under the base model's own state-dict names, ONE tensor
    at a time: an adapted layer's weight is W + ΔW (PEFT's get_delta_weight: (α/r)·B·A), computed in
    fp32 then cast to `dtype`; adapter tensors are never yielded (no `lora_` or `base_layer` name
    leaves here). Tied weights come under each of their names back to back (nanorl/distributed.py)."""
    from nanorl.distributed import iter_full_tensors

    model = getattr(model, "module", model)
    adapter = peft_of(model).active_adapter
    last = (None, None)
    for name, t in iter_full_tensors(model):
        if ".lora_" in name:
            continue
        if last[0] is t:  # a tied alias: the same tensor under its next name
            yield _merged_name(name), last[1]
            continue
        src = t
        if name.endswith(".base_layer.weight"):
            layer = model.get_submodule(name[: -len(".base_layer.weight")])
            t = t + layer.get_delta_weight(adapter).to(t.dtype)
        out = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        last = (src, out)
        yield _merged_name(name), out


def merged_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole merged state dict (export, tests): `iter_merged` collected."""
    return dict(iter_merged(model, dtype))


def save_adapters(model: torch.nn.Module, path: str) -> None:
    """The adapters in PEFT's format (adapter_config.json + adapter_model.safetensors) in `path`:
    `PeftModel.from_pretrained(base, path)` loads them."""
    peft_of(model).save_pretrained(path)


def load_adapters(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: str = "") -> None:
    """Load adapter tensors (adapter_model.safetensors' contents) into the adapted model, exactly;
    ValueError naming the keys when they do not match its adapters."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    peft_model = peft_of(model)
    expected = set(get_peft_model_state_dict(peft_model))
    # the saved names are PEFT's (adapter name stripped), as get_peft_model_state_dict gives them
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ValueError(f"{path}: adapters do not fit this run's (another --lora-rank or "
                         f"--lora-target-modules?): missing {missing[:3]}, unexpected {unexpected[:3]}")
    set_peft_model_state_dict(peft_model, weights)


def adapter_path(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, ADAPTER_FILE)

