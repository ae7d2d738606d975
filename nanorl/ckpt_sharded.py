"""Sharded checkpoints under FSDP: every rank writes, and reads back, only its own shards.

Beside the chain: every save_every steps, after the optimizer step (link 7). Gathering full tensors to
save, and loading them back in full on every rank, costs each rank the host memory of the whole model and
its Adam state (a 7B model in fp32: 28 GB of weights and 56 GB of moments, times 8 ranks at resume). Here
torch.distributed.checkpoint (DCP) writes each rank's shards as they are and, at load, plans which slices
each rank's shards need, so the extra host memory of a resume is about one tensor's shard (measured:
tests/test_lockstep.py); the same plan reshards N ranks onto M. Start at `save` and `load`;
nanorl/checkpoint.py owns the RNG, loader and scheduler state, nanorl/ckpt_atomic.py the step
directory, its atomic rename and the manifest. Key choices: the policy's weights end as whole Hugging
Face safetensors (loadable by transformers and vLLM as before); the optimizer state and the critic
stay in DCP's format under `dcp/`, keyed by parameter name; tied weights are saved once. What goes
where: `save`'s docstring.
"""
from __future__ import annotations

import os
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from nanorl import distributed


def _weights(state: dict) -> dict:
    """A model state dict (DTensor shards under FSDP), one name per tensor: tied aliases (lm_head =
    embeddings) dropped, as safetensors refuses shared storage; the same tensors, not copies."""
    out, seen = {}, set()
    for k, v in state.items():
        ptr = (v.to_local() if hasattr(v, "to_local") else v).data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            out[k] = v
    return out


def _no_dist() -> bool:
    # one process: read everything locally
    return not (dist.is_available() and dist.is_initialized())


def save(run, tmp: str) -> dict:
    """Every rank calls it: write this rank's shards into the directory `tmp` (already there).
    Returns what was saved, for trainer_state.json: {"critic": bool, "optimizer": bool}.

    What goes where, inside the step directory:
    - The policy's weights as Hugging Face safetensors (`model-00001-of-00001.safetensors` + index), through
      DCP's HuggingFaceStorageWriter: every rank writes its shards to `sharded/`, then the coordinator (rank
      0) stitches them into whole tensors, one tensor at a time (torch's consolidate_safetensors_files), and
      `sharded/` is deleted — the directory stays loadable by transformers and vLLM as before. At load,
      HuggingFaceStorageReader reads each rank's slices.
    - `dcp/`: the optimizer state and PPO's critic, in DCP's own format (`.metadata` + one file per rank),
      keyed by parameter name (get_optimizer_state_dict), so they do not depend on the layout either.
    Tied weights (lm_head = embeddings) are saved once, under the first name, as save_pretrained does. The
    same plan reshards at load: a checkpoint written by N ranks resumes on M (one process without FSDP
    included), since the saved tensors are indexed by global offsets.
    """
    trained = distributed.unwrap(run.trained)
    dcp.save(_weights(get_model_state_dict(run.model)), storage_writer=dcp.HuggingFaceStorageWriter(
        tmp, save_distributed=True, enable_consolidation=True), no_dist=_no_dist())
    # consolidated by now (dcp.save returns after the coordinator's finish)
    if run.rank == 0:
        shutil.rmtree(os.path.join(tmp, "sharded"))
    rest = {}
    if run.critic is not None:
        rest["critic"] = get_model_state_dict(run.critic)
    # empty before the first step: torch's helper would take a zero step to fill it
    if run.optimizer.state:
        rest["optimizer"] = get_optimizer_state_dict(trained, run.optimizer)
    if rest:
        dcp.save(rest, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, "dcp")), no_dist=_no_dist())
    return {"critic": "critic" in rest, "optimizer": "optimizer" in rest}


def load(run, path: str, saved: dict) -> None:
    """Every rank calls it: load the shards this rank holds from the checkpoint at `path` (written by
    `save` on any number of ranks). ValueError when the checkpoint does not fit this run."""
    state = get_model_state_dict(run.model)
    reader = dcp.HuggingFaceStorageReader(path)
    unexpected = sorted(set(reader.read_metadata().state_dict_metadata) - set(state))
    if unexpected:
        raise ValueError(f"weights {unexpected[:5]} do not belong to this model")
    # in place; missing names raise
    dcp.load(_weights(state), storage_reader=reader, no_dist=_no_dist())
    # what torch's helpers need after an in-place load (DTensors)
    set_model_state_dict(run.model, state)
    if saved["critic"] != (run.critic is not None):
        raise ValueError(f"the checkpoint {'has' if saved['critic'] else 'has no'} critic, this run "
                         f"{'has none' if run.critic is None else 'has one'} (--vf-coef)")
    trained = distributed.unwrap(run.trained)
    rest = {}
    if run.critic is not None:
        rest["critic"] = get_model_state_dict(run.critic)
    # the target layout: this rank's shards of the moments, by parameter name
    if saved["optimizer"]:
        rest["optimizer"] = get_optimizer_state_dict(trained, run.optimizer)
    if not rest:
        return
    dcp.load(rest, storage_reader=dcp.FileSystemReader(os.path.join(path, "dcp")), no_dist=_no_dist())
    if run.critic is not None:
        set_model_state_dict(run.critic, rest["critic"])
    if saved["optimizer"]:
        set_optimizer_state_dict(trained, run.optimizer, rest["optimizer"])
