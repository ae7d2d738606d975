"""The async rollout worker's weight channel on the host: K+1 slots of the policy in shared memory.

With --async-steps K and the HF engine, the trainer publishes each new version into a slot of shared
CPU memory and the worker process (nanorl/rollout_worker.py) copies it into its own model copy when a
batch needs it (with --engine vllm the versions travel over a process group instead:
nanorl/weight_broadcast.py, which uses the same `slot_layout`). Start at `SharedWeights`: `publish`
(trainer), `wait_for` / `slot` / `release` (worker). Key choices: one shared storage per slot, every
tensor a view at its offset (a storage per tensor ran past `ulimit -n`); the slots hold the compute
dtype (bf16 runs ship half the bytes, fp32 runs stay bit for bit the trainer's); version v lives in
slot v % (K+1), and the staleness bound guarantees no slot is rewritten while read; a /dev/shm too small
for the slots is refused up front (`check_shared_memory`), not met as SIGBUS mid-copy; under --fsdp each
tensor is gathered from the ranks' shards as it is written (distributed.full_tensors).

Test: python -m pytest tests/test_pipeline.py -q
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import torch

from nanorl import weight_broadcast
from nanorl.config_checks import ConfigError
from nanorl.distributed import full_tensors


def slot_layout(model: torch.nn.Module, dtype: torch.dtype) -> tuple[list[tuple], int]:
    """Where each tensor a version carries (weight_broadcast.version_state: the state dict, with LoRA
    the adapters alone) lives in a slot's flat buffer: entries (names, dtype, shape, byte offset) and
    the slot's size in bytes. Floating-point parameters are stored in the compute dtype
    the worker's engine holds them in (a frozen copy, `frozen_copy`), buffers and integer tensors in
    their own; tied parameters (one tensor, several names) take one place. Offsets are 64-byte aligned,
    so every entry can be viewed as its dtype."""
    params = {id(p) for p in model.parameters()}
    entries, where, size = [], {}, 0
    for name, t in weight_broadcast.version_state(model, keep_vars=True).items():
        if id(t) in where:
            entries[where[id(t)]][0].append(name)
            continue
        dt = dtype if id(t) in params and t.is_floating_point() else t.dtype
        where[id(t)] = len(entries)
        entries.append(([name], dt, tuple(t.shape), size))
        size += -(-t.numel() * dt.itemsize // 64) * 64
    return [(tuple(n), dt, shape, off) for n, dt, shape, off in entries], max(size, 64)


def check_shared_memory(nbytes: int, what: str, path: str = "/dev/shm") -> None:
    """Shared CPU tensors live in /dev/shm on Linux (torch's file-descriptor strategy maps files there),
    which a container sizes at 64 MiB unless told: the first write past it dies of SIGBUS or "No space
    left on device" deep in a copy. Refuse before allocating, with the sizes and the fix."""
    if not os.path.isdir(path):  # macOS: shared memory is not a file system
        return
    free = shutil.disk_usage(path).free
    if nbytes > free:
        raise ConfigError(f"{what} need {nbytes / 2**30:.2f} GiB of shared memory and {path} has "
                          f"{free / 2**30:.2f} GiB free: enlarge it (docker run --shm-size=..., or mount -o "
                          f"remount,size=... {path}), or lower --async-steps")


class SharedWeights:
    """K+1 slots of the policy's tensors in shared memory; version v lives in slot v % (K+1).

    A slot is overwritten by version v + K + 1, which needs step v + K to have trained, hence batch
    v + K to exist, which the worker samples from version ≥ v: no slot is rewritten while read.

    One shared storage per slot, every tensor a view into it at its offset (`slot_layout`): torch
    shares each CPU storage through a file descriptor held open by every process that maps it, so a
    storage per tensor (291 for Qwen2.5-0.5B, × K+1 slots) ran past the common `ulimit -n` of 1024.
    The slots hold the compute dtype (bf16 runs ship and store half the bytes of the fp32 masters;
    fp32 runs stay fp32, bit for bit the trainer's weights)."""

    def __init__(self, model: torch.nn.Module, K: int, ctx, dtype: torch.dtype = torch.float32):
        self.layout, size = slot_layout(model, dtype)
        check_shared_memory((K + 1) * size, f"--async-steps {K}: the worker's {K + 1} weight slots")
        self.flat = [torch.empty(size, dtype=torch.uint8).share_memory_() for _ in range(K + 1)]
        self.latest, self.cond = ctx.RawValue("q", -1), ctx.Condition()
        self._views, self._staging = {}, None

    def __getstate__(self) -> dict:
        # what the spawn start method pickles: the K+1 flat storages (one descriptor each), never
        # the views, which would each be reduced as a storage of their own
        return {**self.__dict__, "_views": {}, "_staging": None}

    def _view(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return weight_broadcast.views_of(flat, self.layout)

    def slot(self, version: int) -> dict[str, torch.Tensor]:
        """Every state-dict name → its tensor in version's slot (tied names: the same view)."""
        i = version % len(self.flat)
        if i not in self._views:
            self._views[i] = self._view(self.flat[i])
        return self._views[i]

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Write version `version` of `model` into its slot (with LoRA its adapters: version_state). Under
        FSDP every trainer rank calls this or drains distributed.full_tensors itself (the gathers are
        collectives); this one writes."""
        state, i = weight_broadcast.version_state(model), version % len(self.flat)
        if any(state[names[0]].is_cuda for names, *_ in self.layout):
            self._publish_from_cuda(full_tensors(state, self.layout), i)
        else:
            # on the host the copy into shared memory is the only copy (casting to the slot's dtype)
            views = self.slot(version)
            for n, _, t in full_tensors(state, self.layout):
                views[n].copy_(t)
        with self.cond:  # the lock orders the copy before the version the worker reads
            self.latest.value = version
            self.cond.notify_all()

    def _publish_from_cuda(self, tensors: Iterator, i: int) -> None:
        """Device → pinned staging buffer, every tensor cast to the slot's dtype on the device first
        (half the bytes over the bus in bf16) and copied with non_blocking=True, one synchronisation
        for all; then one host copy into the shared slot. A device → pageable (shared) copy would
        block on each tensor. The staging buffer (one slot's size, page-locked) is made once."""
        if self._staging is None:
            self._staging = torch.empty(self.flat[i].numel(), dtype=torch.uint8, pin_memory=True)
            self._staging_views = self._view(self._staging)
        devices = set()
        for n, _, t in tensors:
            dst = self._staging_views[n]
            devices.add(t.device)
            # the cast's temporary is freed after the copy is queued: the caching allocator reuses
            # it only for work queued later on the same stream, after the copy has read it
            dst.copy_(t.to(dst.dtype), non_blocking=True)
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        self.flat[i].copy_(self._staging)

    def wait_for(self, version: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.latest.value >= version, timeout)

    def release(self, version: int) -> None:
        """Nothing to free: a slot is overwritten in turn (the class docstring)."""

    def newest(self) -> int:
        with self.cond:
            return self.latest.value
