"""Multi-rank training: one process per device, gradients summed by accelerate's DDP (or FSDP2).

    accelerate launch --multi_gpu --num_processes 2 train.py --algo grpo --threads 1  # 2 CPU processes
    torchrun --nproc_per_node 2 train.py --algo grpo                                  # torch's launcher

Each rank owns a rollout engine and a disjoint shard of every step's prompts (nanorl/data.py); a GRPO
group never crosses ranks. A single process needs no launcher and no accelerate config: every call here
is then a no-op. Start at `make_accelerator`, then `Trained` (the one forward accelerate wraps), `wrap`
/ `shard` (DDP or FSDP2), `loss_scale` and `sync_gradients_after`; how a rank's process joins, fails
together with the others and ends (`init`, `fail_together`, `end_process`) is nanorl/rank_lifecycle.py.
Key choices: the global batch's gradient is the SUM of the ranks' gradients; every rank runs the same
number of forwards and backwards (lockstep); a rank that raises takes the others down. GPU and
multi-node launch lines, why `Trained` wraps the scoring function, FSDP and lockstep:
docs/from-slime-verl.md, "nanorl/distributed.py".

Test: python -m pytest tests/test_multirank.py -q   (2 CPU processes over gloo; two nodes:
tests/test_multinode.py)
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nanorl.precision import autocast, fsdp_policy

# a rank's process: join, fail together, end (nanorl/rank_lifecycle.py), called as distributed.<name>;
# check_accelerate_env: make_accelerator's refusal
from nanorl.rank_lifecycle import (  # noqa: F401
    check_accelerate_env,
    end_process,
    fail_together,
    init,
    shutdown,
)


def local_world_size(world: int) -> int:
    """Processes on this node (torchrun and accelerate set LOCAL_WORLD_SIZE); `world` when unset."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def check_shared_dir(path: str, rank: int, world: int) -> None:
    """Several nodes: `path` (the run's out_dir) must be ONE directory that every node sees (NFS,
    Lustre, ...): rank 0 alone writes the built-in task, the logs and every checkpoint's files, and
    every rank reads them back (the task, hashing its share of a checkpoint, resume; DCP shards).
    Rank 0 writes a token, every rank reads it; a node that cannot gets the same error on every rank
    instead of a missing-file error (or, worse, a checkpoint half on one node's disk). One node, or
    one process: nothing to check."""
    if world == 1 or local_world_size(world) == world:
        return
    import socket
    import uuid

    token = uuid.uuid4().hex if rank == 0 else None
    name = os.path.join(path, ".nanorl-shared-dir-check")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        with open(name, "w") as f:
            f.write(token)
    box = [token]
    # after rank 0's write: the token is on disk
    dist.broadcast_object_list(box, src=0)
    try:
        with open(name) as f:
            seen = f.read() == box[0]
    except OSError:
        seen = False
    verdicts = [None] * world
    dist.all_gather_object(verdicts, (rank, socket.gethostname(), seen))
    if rank == 0:
        os.remove(name)
    blind = [f"rank {r} on {host}" for r, host, ok in verdicts if not ok]
    if blind:
        raise RuntimeError(f"--out-dir {path} is not shared by every node ({', '.join(blind)} cannot read "
                           "what rank 0 wrote there): with several nodes it must be a shared filesystem, "
                           "since rank 0 writes the logs and checkpoints once for the whole run and every "
                           "rank reads them back")


def make_accelerator(find_unused_parameters: bool = False):
    """The process's Accelerator: gloo on CPU, NCCL on GPU, rank and world from the launcher's env.

    find_unused_parameters: in an MoE model whose experts are separate modules (transformers 4,
    custom models) an expert that no token of a step reached gets no gradient, and DDP must be told
    or it fails the next step. transformers 5 fuses a layer's experts into one tensor: never unused.

    Everything nanorl relies on is passed explicitly, so an `accelerate config` file cannot change it:
    mixed_precision "no" (the model's dtype and autocast are --dtype's), dynamo_backend "no"
    (prepare_model would torch.compile the wrapper), the DDP arguments; what it would otherwise read
    from the config and nanorl does not support is refused (check_accelerate_env: `init` ran it too)."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    check_accelerate_env()
    ddp = DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no", dynamo_backend="no",
                       kwargs_handlers=[ddp])


def load_device(fsdp: bool, device: torch.device) -> torch.device:
    """Where train.py loads the fp32 model (and builds its copies) before wrapping it. --fsdp: on the
    CPU, so that no GPU ever holds the whole fp32 model and reference: `fully_shard` moves each
    unit's tensors to the device and keeps only this rank's shard (torch 2.13 _move_states_to_device,
    one unit at a time). Else the device: DDP replicates the whole model there anyway."""
    return torch.device("cpu") if fsdp else device


def rank0_reads(fsdp: bool) -> bool:
    """Whether only rank 0 reads the checkpoint into host memory: --fsdp over several ranks. The other
    ranks build the model with its parameters on the meta device (nanorl/policy.py `load_empty_model`),
    and so do the copies made of it (reference, critic, the HF engine's sampler); each receives rank
    0's values once sharded (`shard`, `receive_from_rank0`). A 7B model on 8 ranks then holds one fp32
    copy and one reference in host memory, not eight of each (~370 GB in all). The same answer on
    every rank."""
    return fsdp and dist.is_initialized() and dist.get_world_size() > 1


def receive_from_rank0(module: torch.nn.Module, device: torch.device,
                       full: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """Give every rank's `module` rank 0's values, on `device`; every rank calls it. Rank 0's module
    holds them (on `device`, or sharded there by FSDP), `full` its full state dict (default: the
    module's own; a sharded module's must be taken before sharding). On the other ranks the parameters
    are on the meta device: `to_empty` allocates them on `device` — with FSDP only this rank's shards
    — and torch's set_model_state_dict broadcasts rank 0's tensors one at a time, each rank keeping
    its own slice (broadcast_from_rank0). Buffers are not all in the state dict (rotary frequencies
    are non-persistent) and to_empty left them uninitialised: they are broadcast from rank 0 too.
    Tied parameters stay one tensor: to_empty gives each module of an unsharded model its own copy of
    a meta parameter, so the ties are made again (FSDP keeps them itself)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = dist.get_rank() == 0
    if rank0 and full is None:
        full = module.state_dict()
    if not rank0:
        first: dict[int, str] = {}
        # (a parameter name, the first name of its tensor) for each name after the first
        tied = [(name, first[id(p)]) for name, p in module.named_parameters(remove_duplicate=False)
                if first.setdefault(id(p), name) != name]
        module.to_empty(device=device)
        for name, other in tied:
            if module.get_parameter(name) is not module.get_parameter(other):
                owner, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(owner), leaf, module.get_parameter(other))
    set_model_state_dict(module, full if rank0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for buf in module.buffers():
            moved = buf.to(comm_device())
            dist.broadcast(moved, src=0)
            if moved is not buf:
                buf.copy_(moved)
    return module


class Trained(torch.nn.Module):
    """The modules the optimizer trains, behind the one forward that a data-parallel wrapper sees.

    forward(batch, support) → (logprobs [B, T], entropy [B, T], values [B, T] or None), where
    `score(model, batch, support)` is nanorl/update.py's scoring function (padded or packed, with
    MoE routing replay) and the critic is PPO's value model (nanorl/policy.py). Both run under
    autocast in `compute_dtype` (bf16/fp16 compute over fp32 master weights, nanorl/precision.py):
    inside the forward, so DDP and FSDP see it too."""

    def __init__(self, policy: torch.nn.Module, critic: torch.nn.Module | None, score,
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.policy, self.critic, self._score, self.compute_dtype = policy, critic, score, compute_dtype

    def forward(self, batch, support=None):
        with autocast(batch.input_ids.device, self.compute_dtype):
            logp, ent = self._score(self.policy, batch, support)
            values = self.critic(batch) if self.critic is not None else None
        return logp, ent, values


def wrap(accelerator, trained: Trained, fsdp: bool = False, from_rank0: bool = False) -> torch.nn.Module:
    """DDP around `trained` when there are several ranks (or FSDP sharding); `trained` itself for one.
    from_rank0: FSDP's shards get rank 0's values (`shard`)."""
    if fsdp:
        return shard(trained, accelerator.device, trained.compute_dtype, from_rank0=from_rank0)
    if accelerator.num_processes == 1:
        return trained
    return accelerator.prepare_model(trained)


def shard(module: torch.nn.Module, device: torch.device,
          compute_dtype: torch.dtype = torch.float32, from_rank0: bool = False) -> torch.nn.Module:
    """FSDP2: shard parameters, gradients and optimizer state over the ranks (ZeRO-3), in place.

    Each transformer block is its own unit (its weights are all-gathered just before its forward and
    freed after; its gradients reduce-scattered in backward), and `module` is the root unit holding
    what is left (embeddings, final norm, LM head, value head). Every forward must therefore enter
    through `module.forward` — as Trained's does — for the root's weights to be gathered. Like DDP,
    FSDP averages gradients over ranks, so `loss_scale` applies unchanged. With a bf16/fp16 compute
    dtype, MixedPrecisionPolicy casts each gathered shard for compute and reduces gradients in fp32
    into the fp32 shards (nanorl/precision.py).

    accelerate 1.15 turns FSDP on only for GPU-type backends; `fully_shard` (torch ≥ 2.6) runs on
    CPU over gloo too, so nanorl calls it directly and the same code is tested on CPU and runs on GPU.

    from_rank0 (`rank0_reads`): only rank 0's module holds values; the others' parameters are on the
    meta device, and after sharding each rank's shards are allocated and filled from rank 0's
    (`receive_from_rank0`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    block_names = set()
    # HF models name their transformer-block classes in _no_split_modules
    for m in module.modules():
        block_names |= set(getattr(m, "_no_split_modules", None) or [])
    blocks = [m for m in module.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError("--fsdp: found no transformer blocks (_no_split_modules) to shard")
    # None in fp32
    policy = fsdp_policy(compute_dtype)
    mp = {"mp_policy": policy} if policy is not None else {}
    # rank 0's full tensors, referenced (not copied) until every rank has its shards
    full = module.state_dict() if from_rank0 and dist.get_rank() == 0 else None
    for block in blocks:
        fully_shard(block, mesh=mesh, **mp)
    module = fully_shard(module, mesh=mesh, **mp)
    return receive_from_rank0(module, device, full) if from_rank0 else module


@contextmanager
def root_gathered(module: torch.nn.Module):
    """Run a forward of the HF model that bypasses `module.forward` (vLLM's sync probe): FSDP's root
    weights (embeddings, LM head) are all-gathered for the duration; the blocks gather themselves."""
    # not FSDP-sharded: nothing to gather
    if not hasattr(module, "unshard"):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    # DDP keeps the module in .module; FSDP2 shards in place
    return getattr(module, "module", module)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of `model` in full (FSDP shards all-gathered: every rank must call this). Tied
    weights (lm_head = embeddings) stay one tensor under both names, as in the module. The whole of
    iter_full_tensors at once: for checkpoints and rank checks (syncs stream instead)."""
    return dict(iter_full_tensors(model))


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full tensors into `model`, sharding them where FSDP sharded its parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(unwrap(model), state, options=StateDictOptions(full_state_dict=True))


def load_optimizer_state(trained: torch.nn.Module, optimizer, state: dict) -> None:
    """Load a full optimizer state: keyed by index (optimizer.state_dict()), or by parameter name
    (what FSDP checkpoints held before they were sharded)."""
    if not state:
        return
    groups = state["param_groups"]
    if not any(isinstance(i, str) for g in groups for i in g["params"]):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(unwrap(trained), optimizer, state,
                             options=StateDictOptions(full_state_dict=True))


def loss_scale(world: int) -> float:
    """DDP averages gradients over ranks; nanorl's denominators are already global (see above)."""
    return float(world)


def sync_gradients_after(model: torch.nn.Module, last: bool):
    """Accumulate micro-batch gradients locally; reduce them over ranks once, in the last backward of
    the optimizer step. DDP: `no_sync` around the others (one all-reduce per step). FSDP2 has no
    no_sync: `set_requires_gradient_sync(False)` keeps each micro-batch's gradient unsharded and local,
    and the last backward reduce-scatters the sum — one reduce-scatter per FSDP unit per step instead
    of one per micro-batch, in fp32 either way (MixedPrecisionPolicy's reduce dtype). Its cost: the
    full, unsharded gradient lives between the micro-batches of a step (a 7B model in fp32: 28 GB per
    rank); a step of one micro-batch pays nothing. Every rank runs as many micro-batches (lockstep)."""
    # FSDP2 (fully_shard): every unit, recursively
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
        return nullcontext()
    if last or not hasattr(model, "no_sync"):
        return nullcontext()
    return model.no_sync()


def all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    """In-place SUM (or `op`) over ranks; a no-op in a single process. NCCL reduces CUDA tensors
    only, gloo CPU ones: `t` travels to the backend's device and back when they differ."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = comm_device()
        moved = t.to(dev)
        dist.all_reduce(moved, op=op or dist.ReduceOp.SUM)
        if moved is not t:
            t.copy_(moved)
    return t


def all_gather(value) -> list:
    """Every rank's `value` (any picklable object), in rank order; [value] in a single process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def comm_device(group=None) -> torch.device:
    """Where a collective's tensor must live: CUDA for NCCL, CPU for gloo."""
    nccl = dist.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def reduce_metrics(metrics: dict, world: int) -> dict:
    """Mean of every metric over the ranks that logged it (max for *_max), so one logged line describes
    the whole step. Ranks may log different keys (a rank whose rows were all skipped logs no update
    metrics): the keys are agreed first, so the all-reduce lines up (by position) on every rank."""
    if world == 1:
        return metrics
    gathered = [None] * world
    dist.all_gather_object(gathered, sorted(metrics))
    keys = sorted(set().union(*gathered))
    # 1 where this rank logged the key
    have = torch.tensor([float(k in metrics) for k in keys], dtype=torch.float64)  # [K]
    vals = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64)  # [K]
    maxes = torch.tensor([float(metrics.get(k, -math.inf)) for k in keys], dtype=torch.float64)  # [K]
    all_reduce(vals)
    all_reduce(have)
    all_reduce(maxes, dist.ReduceOp.MAX)
    return {k: float(maxes[i] if k.endswith("_max") else vals[i] / have[i]) for i, k in enumerate(keys)}


def check_ranks_in_sync(model: torch.nn.Module, world: int) -> None:
    """Fail loudly if ranks drifted apart: compare a checksum of every tensor of `model` across ranks.
    Pass what each rank's engine samples from: under FSDP the trainer's shards are one copy by
    construction, but the engines' full copies are loaded by each rank and could differ. The tensors
    are streamed (iter_full_tensors: one full tensor at a time, FSDP shards gathered one by one), so
    the check costs about one tensor's memory, not the state dict's (a 7B model in fp32: 30 GB)."""
    with torch.no_grad():
        # an fp64 sum per tensor, one tensor alive at a time
        sums = [torch.sum(t, dtype=torch.float64) for _, t in iter_full_tensors(model)]
    local = torch.stack(sums).to(comm_device())  # [n]
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    if any(not torch.equal(gathered[0], g) for g in gathered[1:]):
        raise RuntimeError("ranks hold different weights after training: gradient sync is broken")


def full_tensors(state: dict[str, torch.Tensor],
                 layout: list[tuple]) -> Iterator[tuple[str, torch.dtype, torch.Tensor]]:
    """The async worker's weight versions (nanorl/pipeline.py): (first name, dtype, tensor) of each
    entry (names, dtype, shape, offset) of `layout` (shared_weights.slot_layout) in `state`, a model's
    state dict, in layout order, ONE at a time. A plain tensor is the module's own (its writer casts it
    as it copies); an FSDP shard (DTensor) is cast to the entry's dtype, then all-gathered: a
    collective, so every rank iterates, in this order, even those that keep nothing
    (pipeline.Follower); one gathered tensor is alive at a time, never a full copy of the model."""
    for names, dt, _, _ in layout:
        t = state[names[0]].detach()
        if isinstance(t, DTensor):
            # this rank's shard is cast before the gather: the compute dtype's bytes move
            t = t.to(dt).full_tensor()
        yield names[0], dt, t


def iter_full_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """Yield (name, full tensor) for every entry of `model`'s state dict, ONE tensor at a time: an FSDP
    shard is all-gathered just before it is yielded (a collective: every rank iterates, in the same
    order), so the extra memory of a consumer that drops each tensor before asking for the next (as
    vLLM's loader does) is ~2x the largest tensor — the all-gather's buffer plus the full tensor —
    whatever the depth (measured on 2 gloo ranks: 1039 MiB for Qwen2.5-0.5B's 519 MiB embedding at 2
    or 24 layers; the whole state dict first: 1903 MiB at 24; tests/test_weight_stream.py). DDP or one
    process: the module's own tensors, no copy. Tied weights (lm_head = embeddings) are gathered once
    and yielded under each of their names back to back (vLLM 0.32's reload needs both names).

    dtype: the consumer's dtype (the engine's, e.g. bf16): each floating-point shard is cast BEFORE
    its all-gather, so FSDP moves half the bytes of the fp32 masters and vLLM receives tensors it
    needs not convert (it warns once per tensor per sync otherwise); the result equals the cast of
    the full fp32 tensor (a cast is elementwise). Then a copy per tensor, one at a time. Integer
    tensors are yielded as they are."""
    # references to the Parameters, not copies
    state = unwrap(model).state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for k, v in state.items():
        names.setdefault(id(v), []).append(k)
    for aliases in names.values():
        v = state[aliases[0]].detach()
        if dtype is not None and v.is_floating_point() and v.dtype != dtype:
            # a DTensor stays sharded: only this rank's shard is cast
            v = v.to(dtype)
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        del v
        for name in aliases:
            yield name, full
        # before the next gather
        del full
