"""Weight versions from the trainer to the async rollout worker over a two-rank process group: link 8
of the chain when the worker runs vLLM (--async-steps K --engine vllm, nanorl/pipeline.py).

The trainer (rank 0, `Sender`) sends every state-dict tensor of a version, in a fixed order, cast to
the engine's dtype on its own device; the worker (rank 1, `Receiver`) takes each version in a
background thread, so its engine keeps sampling while a version crosses. The transport follows the two
ends' physical devices (`transport_for`, decided on the trainer's side and sent in `ChannelSpec`):
"nccl" between two GPUs (device to device), "ipc" on one GPU (NCCL refuses two ranks on one device:
the trainer writes each version into ONE slot on that GPU, shared once through a CUDA IPC handle; only
version numbers cross, over gloo), "gloo" when an end is not CUDA (host tensors, as on CPU). One
collective per tensor over one group: no file descriptor per tensor. The group is its own (a TCPStore
and a ProcessGroup object), not torch.distributed's default group, which a multi-rank trainer and vLLM use.

Start at `transport_for`, `Sender.publish` and `Receiver._run`. Key choices: up to K+2 versions held
(the loaded one and the K+1 that can be published before it moves on, under the staleness rule
rollout_worker.sampled_from), so the trainer's publish never waits for the worker to finish a batch;
they wait in the worker's host memory (pinned on a GPU machine), never on a GPU: a GPU holds one
landing buffer per transport (nccl's receive buffer on the worker's, ipc's slot on the shared one),
whatever K (a 7B model in bf16 at K=1 held 3 more 14 GiB copies on the worker's GPU before).
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
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from nanorl import lora
from nanorl.distributed import full_tensors

HOST = "127.0.0.1"  # one node: the worker is a child process of the trainer
TIMEOUT = datetime.timedelta(minutes=30)  # a collective waits this long for the other end
TRANSPORTS = ("gloo", "nccl", "ipc")


def free_port() -> int:
    """A TCP port free now on this host, for the group's store (the trainer hosts it)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- which transport


def physical_id(device) -> str | None:
    """The physical GPU behind a CUDA device: its UUID, the same in every process whatever
    CUDA_VISIBLE_DEVICES renumbers (the worker's cuda:0 may be the trainer's cuda:1); None off CUDA."""
    d = torch.device(device)
    if d.type != "cuda":
        return None
    index = torch.cuda.current_device() if d.index is None else d.index
    return str(torch.cuda.get_device_properties(index).uuid)


def transport_for(trainer: str | None, worker: str | None) -> str:
    """The transport between two ends, by their physical devices (`physical_id`; None: not a GPU):
    gloo when either end is not a GPU, ipc when both are the same GPU (NCCL refuses two ranks on one
    device: "Duplicate GPU detected"), nccl between two GPUs."""
    if trainer is None or worker is None:
        return "gloo"
    return "ipc" if trainer == worker else "nccl"


def backend_for(trainer_device: torch.device, worker_device: torch.device) -> str:
    """The transport between the trainer's device and the worker's, both named in the trainer's
    numbering (pipeline.Pipeline calls this in the trainer's process)."""
    return transport_for(physical_id(trainer_device), physical_id(worker_device))


def check_devices(trainer_device, rollout_device: str, broadcast: bool) -> str | None:
    """At set-up, before anything loads: a ValueError naming --rollout-device when the async worker's
    device cannot work here (a GPU that does not exist; with `broadcast`, i.e. --engine vllm, two GPUs
    without NCCL), else the transport `backend_for` will choose (None without `broadcast`)."""
    worker = torch.device(rollout_device or trainer_device)
    if worker.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (worker.index or 0) >= count:
            raise ValueError(f"--rollout-device {rollout_device or trainer_device}: this machine has "
                             f"{count} CUDA device(s)")
    if not broadcast:
        return None
    transport = backend_for(torch.device(trainer_device), worker)
    if transport == "nccl" and not dist.is_nccl_available():
        raise ValueError(f"--rollout-device {rollout_device}: a second GPU takes its weights over NCCL, "
                         "which this torch lacks; leave --rollout-device empty (the trainer's GPU, CUDA IPC)")
    return transport


def local_device(spec: ChannelSpec) -> torch.device:
    """The worker's device in the worker's own numbering: the visible GPU with the spec's UUID
    (CUDA_VISIBLE_DEVICES may have renumbered it), the host for gloo."""
    if spec.backend == "gloo":
        return torch.device("cpu")
    if spec.physical is None:  # the host stand-in of ipc (tests): the slots are host shared memory
        return torch.device(spec.device)
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == spec.physical:
            return torch.device("cuda", i)
    raise RuntimeError(f"async worker: GPU {spec.physical} ({spec.device} in the trainer's numbering) is not "
                       "visible here (CUDA_VISIBLE_DEVICES)")


@dataclasses.dataclass
class ChannelSpec:
    """What the worker needs to open its end (picklable: sent to the spawned or forked worker)."""
    port: int
    backend: str                # the transport (`transport_for`): "gloo", "nccl" or "ipc"
    layout: list[tuple]         # (names, dtype, shape, byte offset) per tensor, in broadcast order
    size: int                   # one version's bytes (shared_weights.slot_layout gives both)
    slots: int                  # versions the worker may hold at once, in its host memory: K + 2
    device: str                 # the worker's device, in the trainer's numbering
    # The worker's GPU (physical_id, filled in here, in the trainer's process): the worker finds its
    # device by it, whatever CUDA_VISIBLE_DEVICES its process was started with. None off CUDA.
    physical: str | None = None
    # ipc: the opener of the trainer's one slot, which the Sender fills in before the worker starts:
    # CUDA IPC arguments (reduce_tensor's), or on the host a shared-memory tensor (the tests' stand-in)
    shared: object = None

    def __post_init__(self):
        if self.backend not in TRANSPORTS:
            raise ValueError(f"weight channel: transport {self.backend!r}, not one of {TRANSPORTS}")
        if self.physical is None:
            self.physical = physical_id(self.device)


def open_group(rank: int, port: int, backend: str):
    """This end of the two-rank group; blocks until the other end has opened its own. ipc's group
    carries only version numbers, on the host: gloo."""
    store = dist.TCPStore(HOST, port, 2, rank == 0, timeout=TIMEOUT, wait_for_workers=False)
    if backend == "nccl":  # written against torch's documented API; not run here (no GPU)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    return dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)


def _broadcast(group, tensor: torch.Tensor, root: int = 0) -> None:
    """Rank `root`'s `tensor` into every rank's `tensor` (same shape and dtype), in place."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()


def views_of(flat: torch.Tensor, layout: list[tuple]) -> dict[str, torch.Tensor]:
    """One version's tensors, views into one flat buffer at the layout's (64-byte aligned) offsets
    (shared_weights.slot_layout's; its SharedWeights views its slots the same way)."""
    views = {}
    for names, dt, shape, off in layout:
        view = flat[off:off + math.prod(shape) * dt.itemsize].view(dt).view(shape)
        views.update(dict.fromkeys(names, view))
    return views


def version_state(model: torch.nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """What one published version carries, by state-dict name: every tensor of the policy, or with
    LoRA its adapters alone (~1% of the bytes; nanorl/lora.py adapter_state): the base never trains,
    so the worker loads it once and holds it (nanorl/rollout_worker.py). Both channels (this one and
    shared_weights.SharedWeights) lay out and send exactly these tensors (shared_weights.slot_layout)."""
    if lora.is_lora(model):
        return lora.adapter_state(model, keep_vars)
    return model.state_dict(keep_vars=keep_vars)


def _share(flat: torch.Tensor):
    """An opener of `flat` for another process: CUDA IPC arguments (they do not keep the memory alive:
    the Sender holds `flat`), or the host tensor moved to shared memory."""
    return list(reduce_tensor(flat)[1]) if flat.is_cuda else flat.share_memory_()


def _open(shared, device: torch.device) -> torch.Tensor:
    if isinstance(shared, torch.Tensor):
        return shared
    args = list(shared)
    # reduce_tensor's index 6 is the exporter's device index: this process's index of the same GPU
    # (as vLLM 0.32's IPC weight transfer does), since CUDA_VISIBLE_DEVICES may number it otherwise
    args[6] = device.index
    return rebuild_cuda_tensor(*args)


class Sender:
    """The trainer's end. `connect()` once the worker has started, then `publish` every version.
    ipc: make it before the spec goes to the worker (it puts the slot's opener in the spec)."""

    def __init__(self, spec: ChannelSpec, device: torch.device):
        # gloo moves host tensors: a CUDA trainer talking to a CPU worker casts on its device, then copies
        self.spec, self.device = spec, device if spec.backend != "gloo" else torch.device("cpu")
        self.group, self.latest, self.flat, self.views = None, -1, None, {}
        self.unacked = False  # ipc: the worker has not yet said it copied the last version out
        if spec.backend == "ipc":  # every version is written into this one slot (`_write_slot`)
            self.flat = torch.empty(spec.size, dtype=torch.uint8, device=self.device)
            spec.shared = _share(self.flat)
            self.views = views_of(self.flat, spec.layout)

    def connect(self) -> None:
        self.group = open_group(0, self.spec.port, self.spec.backend)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Send version `version` of `model`, each tensor cast to its layout dtype (the engine's) on the
        trainer's device: after a header (the version) over nccl / gloo, or (ipc) into the shared slot,
        the header last, once the copies are done. Under FSDP every trainer rank calls this or drains
        distributed.full_tensors itself (each tensor is gathered from the ranks' shards); this one sends."""
        state = version_state(model)
        header = torch.tensor([version], dtype=torch.long,
                              device=self.device if self.spec.backend == "nccl" else "cpu")
        if self.spec.backend == "ipc":
            self._write_slot(state)
            _broadcast(self.group, header)
            self.unacked = True
        else:
            _broadcast(self.group, header)
            # tied names share one tensor: sent once, under its first name
            for _, dt, t in full_tensors(state, self.spec.layout):
                _broadcast(self.group, t.to(dt).to(self.device).contiguous())
        self.latest = version

    def _write_slot(self, state: dict) -> None:
        """The shared slot is free once the worker has copied the previous version out of it: it says so
        (its version, broadcast from rank 1) right after its copy, so this waits a host copy at most."""
        if self.unacked:
            _broadcast(self.group, torch.empty(1, dtype=torch.long), root=1)
            self.unacked = False
        for n, _, t in full_tensors(state, self.spec.layout):
            self.views[n].copy_(t)  # cast in the copy: no temporary
        if self.device.type == "cuda":  # the worker reads it once the header arrives: written by then
            torch.cuda.synchronize(self.device)

    def newest(self) -> int:
        return self.latest

    def close(self) -> None:
        self.group = None  # the last reference: the group is destroyed now, in this process
        self.flat, self.views = None, {}  # ipc: the worker has ended (pipeline.close joins it first)


class Receiver:
    """The worker's end: what rollout_worker.Worker reads as it reads SharedWeights (`wait_for`, `slot`,
    `newest`), plus `release(version)` once a version is loaded. A thread takes each version into a
    host slot (one flat buffer, every tensor a view), through the transport's one landing buffer on a
    GPU (nccl receives there, ipc's is the trainer's slot), and marks it held."""

    def __init__(self, spec: ChannelSpec):
        self.spec, self.device = spec, local_device(spec)
        self.layout = spec.layout  # as SharedWeights.layout: the worker checks its model against it
        # where a version lands before its host slot: nccl's receive buffer, ipc's shared slot, else none
        self.landing = None
        if spec.backend == "ipc":
            if spec.shared is None:
                raise RuntimeError("weight channel: the ipc slot is not shared (make the Sender before "
                                   "the worker)")
            self.landing = _open(spec.shared, self.device)
        elif spec.backend == "nccl":
            self.landing = torch.empty(spec.size, dtype=torch.uint8, device=self.device)
            self.landed = views_of(self.landing, self.layout)  # nccl receives each tensor into its view
        self.group = open_group(1, spec.port, spec.backend)
        # version -> (its host slot, its tensors by state-dict name)
        self.held: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.free: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        self.made, self.latest, self.error = 0, -1, None
        self.cond = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name="nanorl-weight-receiver").start()

    def _new_slot(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # page-locked on a GPU machine: the copies to and from the GPU run at full speed, asynchronously
        flat = torch.empty(self.spec.size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return flat, views_of(flat, self.layout)

    def _take_slot(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
                header = torch.empty(1, dtype=torch.long, device=self.device if self.spec.backend == "nccl"
                                     else "cpu")
                _broadcast(self.group, header)
                version = int(header.item())
                flat, views = self._take_slot()
                if self.spec.backend == "gloo":
                    for names, *_ in self.layout:
                        _broadcast(self.group, views[names[0]])
                else:
                    if self.spec.backend == "nccl":
                        for names, *_ in self.layout:
                            _broadcast(self.group, self.landed[names[0]])
                    # one copy of the whole version to the host; then the landing buffer is free again
                    flat.copy_(self.landing, non_blocking=True)
                    if self.landing.is_cuda:
                        torch.cuda.synchronize(self.device)
                with self.cond:
                    self.held[version], self.latest = (flat, views), version
                    self.cond.notify_all()
                # ipc: the trainer may write its slot again (Sender._write_slot); this waits until it
                # publishes the next version, the version above is readable meanwhile
                if self.spec.backend == "ipc":
                    _broadcast(self.group, header, root=1)
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
        """Version `version`'s tensors, in host memory (the worker copies them to its device as it loads)."""
        with self.cond:
            if version not in self.held:
                raise RuntimeError(f"async worker: weight version {version} is not held (held: "
                                   f"{sorted(self.held)})")
            return self.held[version][1]

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
