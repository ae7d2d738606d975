"""Weight versions from the trainer to the async rollout worker over a two-rank process group: link 8
of the chain when the worker runs vLLM (--async-steps K --engine vllm, nanorl/pipeline.py).

The trainer (rank 0, `Sender`) broadcasts every state-dict tensor of a version, in a fixed order, cast
to the engine's dtype on its own device; the worker (rank 1, `Receiver`) takes them in a background
thread into a staging slot, so its engine keeps sampling while a version crosses. NCCL when both ends
are CUDA devices (device to device: no host copy, no fp32 copy), gloo otherwise (host tensors, as on
CPU). One collective per tensor over one group: no file descriptor per tensor (the shared-memory path
of the HF worker needs one per slot). The group is its own (a TCPStore and a ProcessGroup object), not
torch.distributed's default group, which a multi-rank trainer and vLLM each use for themselves.

Start at `Sender.publish` and `Receiver._run`. Key choice: up to K+2 versions held by the worker (the
loaded one and the K+1 that can be published before it moves on, under the staleness rule
rollout_worker.sampled_from), so the trainer's publish never waits for the worker to finish a batch.
Test: python -m pytest tests/test_weight_broadcast.py -q
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import socket
import threading
import traceback

import torch
import torch.distributed as dist

HOST = "127.0.0.1"  # one node: the worker is a child process of the trainer
TIMEOUT = datetime.timedelta(minutes=30)  # a collective waits this long for the other end


def free_port() -> int:
    """A TCP port free now on this host, for the group's store (the trainer hosts it)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class ChannelSpec:
    """What the worker needs to open its end (picklable: sent to the spawned or forked worker)."""
    port: int
    backend: str                # "nccl" when trainer and worker devices are both CUDA, else "gloo"
    layout: list[tuple]         # (names, dtype, shape, byte offset) per tensor, in broadcast order
    size: int                   # one version's bytes (rollout_worker.slot_layout gives both)
    slots: int                  # versions the worker may hold at once: K + 2
    device: str                 # where the worker's staging slots live (its rollout device for NCCL)


def backend_for(trainer_device: torch.device, worker_device: torch.device) -> str:
    return "nccl" if trainer_device.type == worker_device.type == "cuda" else "gloo"


def open_group(rank: int, port: int, backend: str):
    """This end of the two-rank group; blocks until the other end has opened its own."""
    store = dist.TCPStore(HOST, port, 2, rank == 0, timeout=TIMEOUT, wait_for_workers=False)
    if backend == "nccl":  # written against torch's documented API; not run here (no GPU)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    return dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)


def _broadcast(group, tensor: torch.Tensor) -> None:
    """Rank 0's `tensor` into every rank's `tensor` (same shape and dtype), in place."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class Sender:
    """The trainer's end. `connect()` once the worker has started, then `publish` every version."""

    def __init__(self, spec: ChannelSpec, device: torch.device):
        # gloo moves host tensors: a CUDA trainer talking to a CPU worker casts on its device, then copies
        self.spec, self.device = spec, device if spec.backend == "nccl" else torch.device("cpu")
        self.group, self.latest = None, -1

    def connect(self) -> None:
        self.group = open_group(0, self.spec.port, self.spec.backend)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Broadcast version `version` of `model`: a header (the version), then each tensor in layout
        order, cast to its layout dtype (the engine's) on the trainer's device before it crosses."""
        state = model.state_dict()
        _broadcast(self.group, torch.tensor([version], dtype=torch.long, device=self.device))
        for names, dt, _, _ in self.spec.layout:
            # tied names share one tensor: sent once, under its first name
            _broadcast(self.group, state[names[0]].detach().to(dt).to(self.device).contiguous())
        self.latest = version

    def newest(self) -> int:
        return self.latest

    def close(self) -> None:
        self.group = None  # the last reference: the group is destroyed now, in this process


class Receiver:
    """The worker's end: what rollout_worker.Worker reads as it reads SharedWeights (`wait_for`, `slot`,
    `newest`), plus `release(version)` once a version is loaded. A thread receives each version into a
    free staging slot (one flat buffer, every tensor a view) and marks it held."""

    def __init__(self, spec: ChannelSpec):
        self.spec, self.device = spec, torch.device(spec.device if spec.backend == "nccl" else "cpu")
        self.layout = spec.layout  # as SharedWeights.layout: the worker checks its model against it
        self.group = open_group(1, spec.port, spec.backend)
        self.held: dict[int, dict[str, torch.Tensor]] = {}  # version -> its tensors, by state-dict name
        self.free: list[dict[str, torch.Tensor]] = []
        self.made, self.latest, self.error = 0, -1, None
        self.cond = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name="nanorl-weight-receiver").start()

    def _new_slot(self) -> dict[str, torch.Tensor]:
        """One version's tensors, views into one flat buffer at the layout's (64-byte aligned) offsets."""
        flat = torch.empty(self.spec.size, dtype=torch.uint8, device=self.device)
        views = {}
        for names, dt, shape, off in self.layout:
            view = flat[off:off + math.prod(shape) * dt.itemsize].view(dt).view(shape)
            views.update(dict.fromkeys(names, view))
        return views

    def _take_slot(self) -> dict[str, torch.Tensor]:
        with self.cond:
            # K+2 held is the most the staleness rule needs (module docstring); wait if ever more
            self.cond.wait_for(lambda: self.free or self.made < self.spec.slots)
            if self.free:
                return self.free.pop()
            self.made += 1
        return self._new_slot()

    def _run(self) -> None:
        try:
            while True:
                header = torch.empty(1, dtype=torch.long, device=self.device)
                _broadcast(self.group, header)
                views = self._take_slot()
                for names, *_ in self.layout:
                    _broadcast(self.group, views[names[0]])
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                with self.cond:
                    version = int(header.item())
                    self.held[version], self.latest = views, version
                    self.cond.notify_all()
        except Exception:  # the trainer went away, or the transfer broke: wait_for reports it
            with self.cond:
                self.error = traceback.format_exc()
                self.cond.notify_all()

    def wait_for(self, version: int, timeout: float) -> bool:
        with self.cond:
            ok = self.cond.wait_for(lambda: self.latest >= version or self.error, timeout)
            if self.error and self.latest < version:
                raise RuntimeError(f"async worker: receiving weight version {version} failed:\n{self.error}")
            return bool(ok)

    def slot(self, version: int) -> dict[str, torch.Tensor]:
        with self.cond:
            if version not in self.held:
                raise RuntimeError(f"async worker: weight version {version} is not held (held: "
                                   f"{sorted(self.held)})")
            return self.held[version]

    def release(self, version: int) -> None:
        """Version `version` is loaded: every older one held goes back to the free slots (it stays:
        the next batch may be sampled from it again)."""
        with self.cond:
            for v in [v for v in self.held if v < version]:
                self.free.append(self.held.pop(v))
            self.cond.notify_all()

    def newest(self) -> int:
        with self.cond:
            return self.latest
