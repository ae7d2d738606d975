"""Export a run's checkpoint as a plain Hugging Face model directory (transformers / vLLM load it).

    python -m nanorl.export RUN_DIR OUT        # RUN_DIR: a run's out_dir (its newest valid checkpoint)
    python -m nanorl.export STEP_DIR OUT       #          or one checkpoint directory (step_NNNNNN)

A LoRA checkpoint (layout "lora", nanorl/lora.py) holds only the adapters: the base model the run
started from (its saved --model) is loaded, the adapters applied with PEFT's own
`PeftModel.from_pretrained`, merged (`merge_and_unload`: W + (α/r)·B·A) and saved with
`save_pretrained`, so OUT has the base model's names and no adapter tensor. A full checkpoint already
is a Hugging Face directory: its model is loaded and saved again the same way. The tokenizer's files
are copied. A run that started from a GGUF file exports alike: its checkpoints hold plain weights, and
a LoRA run's base is that file, dequantized again (nanorl/gguf_model.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import torch

from nanorl.checkpoint import CheckpointError, list_checkpoints, verify
from nanorl.gguf_model import load_causal_lm

TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab.", "merges.txt", "added_tokens", "chat_template")


def find_checkpoint(path: str) -> str:
    """`path` itself when it is a complete checkpoint, else the newest complete one under
    path/checkpoints; CheckpointError when there is none."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        verify(path)
        return path
    for _, step_dir in list_checkpoints(os.path.join(path, "checkpoints")):
        try:
            verify(step_dir)
            return step_dir
        except CheckpointError:
            continue
    raise CheckpointError(f"{path}: neither a checkpoint nor a run directory with a valid checkpoint")


def export(path: str, out: str) -> str:
    """Write the merged Hugging Face model of the checkpoint `path` (or a run's newest) to `out`;
    returns the checkpoint it read."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = find_checkpoint(path)
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        state = json.load(f)
    layout = state.get("layout", "full")
    if layout == "sharded":
        raise CheckpointError(f"{ckpt}: a sharded (--fsdp) checkpoint; export supports full and LoRA ones")
    if layout == "lora":
        # the run's --model: a HF model or a GGUF file (nanorl/gguf_model.py)
        base = load_causal_lm(state["config"]["model"], dtype=torch.float32)
        model = PeftModel.from_pretrained(base, ckpt).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.save_pretrained(out)
    # the tokenizer's files as saved (a reload + save can change a tokenizer: ../shared/FACTS.md)
    for name in os.listdir(ckpt):
        if name.startswith(TOKENIZER_FILES):
            shutil.copy(os.path.join(ckpt, name), os.path.join(out, name))
    return ckpt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a run's checkpoint as a merged Hugging Face model")
    parser.add_argument("path", help="a run's out_dir (newest valid checkpoint) or one step_NNNNNN directory")
    parser.add_argument("out", help="the Hugging Face model directory to write")
    args = parser.parse_args(argv)
    ckpt = export(args.path, args.out)
    print(f"exported {ckpt} -> {args.out}")


if __name__ == "__main__":
    main()
