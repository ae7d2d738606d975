"""How a rank's process joins the run, fails together with the others, and ends.

Multi-rank runs (nanorl/distributed.py) are one process per device, started by a launcher (`accelerate
launch`, `torchrun`). Start at `init` (join the process group the launcher's env describes, refusing
an `accelerate config` that asks for what nanorl does not do: `check_accelerate_env`), then
`fail_together` (the context train.py runs a rank in) and `end_process` (its last line). Key choices:
one rank's error ends every rank with that rank's error instead of a hang (the message goes through
the rendezvous store, a watcher thread polls it, and NCCL is told to record a failed collective rather
than abort the process: `backend_error`); a process that joined a group ends with os._exit, never the
interpreter's teardown (where gloo ranks died with SIGABRT). One process: every call is a no-op.

Test: python -m pytest tests/test_lockstep.py -q
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist


def init() -> tuple[int, int, torch.device]:
    """(rank, world, device) of this process; joins the process group the launcher set up (its env:
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT). One process: (0, 1, cuda:0 or cpu).

    Several nodes: `rank` is the GLOBAL rank, the device the LOCAL one (cuda:LOCAL_RANK, set by
    accelerate's PartialState; vLLM's external_launcher picks the same): one engine per local GPU."""
    from accelerate import PartialState

    # before PartialState: with DeepSpeed asked for, it would initialise through deepspeed
    check_accelerate_env()
    note_mixed_precision()
    # Read when the NCCL group is made. By default (3) NCCL's watchdog ends a rank whose collective
    # failed or timed out with abort() from its own C++ thread: no Python error, so fail_together
    # could not tell the other ranks, which waited out their own timeouts. 2 only aborts the
    # communicators and records the error (`backend_error`), which fail_together's watcher posts.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    state = PartialState(cpu=not torch.cuda.is_available())
    if dist.is_initialized():
        # the last resort; a normal end calls shutdown itself (train.main)
        atexit.register(shutdown)
        _JOINED.set()
    return state.process_index, state.num_processes, torch.device(state.device)


# set by fail_together: after an abort, shutdown has nothing to do
_ABORTED = threading.Event()
# set by init once this process joined a process group: end_process ends it with os._exit, even
# after train.main destroyed the group (is_initialized() is False by then)
_JOINED = threading.Event()


def shutdown() -> None:
    """Destroy the process group at a normal end, while the interpreter is still whole. A process that
    exits with a gloo group alive can die at exit with "terminate called without an active exception"
    (SIGABRT, exit status -6: gloo's worker threads still hold tensors when the interpreter is torn
    down; pytorch/pytorch#190489) — seen on CI as a failed 2-rank run whose work had all passed. Not
    after fail_together aborted the group (destroying it then could wait on peers that are gone, as
    torchtitan found for NCCL). Idempotent: train.main calls it, init registers it at exit."""
    if dist.is_available() and dist.is_initialized() and not _ABORTED.is_set():
        dist.destroy_process_group()


def end_process(code: int = 0) -> None:
    """The last line of a multi-rank script (train.py, the test harnesses): once its work is done,
    flushed and the group destroyed, the process ends with os._exit — without the interpreter's
    teardown, where a rank still died with "terminate called without an active exception" (SIGABRT,
    exit status -6) on CI under load, even after destroy_process_group: C++ objects of the gloo group
    and its store destroyed during finalization (pytorch/pytorch#190489). Decided by whether the
    process ever joined a group, not by whether one is left: train.main destroys it before this
    runs, and a check of is_initialized() let those ranks exit through the teardown after all (a
    2-rank --async-steps run aborted so about once in ten under load; faulthandler: no Python frame,
    i.e. in finalization). One process (no group): returns, and Python ends as usual."""
    if not _JOINED.is_set():
        return
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What `accelerate config` / `accelerate launch` hand the processes (accelerate 1.15 reads them in
# Accelerator/PartialState). nanorl does its own precision (--dtype), sharding (--fsdp) and
# compilation: each of these would silently replace or fight nanorl's, so they are refused.
REFUSED_ACCELERATE = {
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed (nanorl shards with FSDP2: --fsdp)",
    "ACCELERATE_USE_FSDP": "accelerate's FSDP plugin (nanorl shards with its own FSDP2: --fsdp)",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "accelerate's parallelism config (TP / CP)",
}


def check_accelerate_env() -> None:
    """Refuse, with the setting's name, what a user's `accelerate config` asks for and nanorl does not
    support: DeepSpeed, accelerate's FSDP, Megatron-LM, tensor/context parallelism, any dynamo
    backend. `init` runs it before joining, make_accelerator (nanorl/distributed.py) again before
    building one. Mixed precision set there is overridden, not refused: `note_mixed_precision`."""
    on = {k: v for k, v in REFUSED_ACCELERATE.items()
          if os.environ.get(k, "false").lower() in ("true", "1", "yes")}
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
    if backend.lower() not in ("no", ""):
        on["ACCELERATE_DYNAMO_BACKEND"] = f"torch.compile through accelerate (dynamo backend {backend})"
    if on:
        asked = "; ".join(f"{k} ({v})" for k, v in on.items())
        raise ValueError("your accelerate config / environment asks for what nanorl does not support: "
                         f"{asked}. "
                         "Run `accelerate config` again without it (or unset the variable); nanorl sets "
                         "precision with --dtype and sharding with --fsdp")


def note_mixed_precision() -> None:
    """A note on stderr (rank 0) when an accelerate config sets mixed precision: nanorl's --dtype
    decides it (make_accelerator pins mixed_precision="no")."""
    mp = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if mp != "no" and int(os.environ.get("RANK", "0")) == 0:
        print(f"nanorl: note: accelerate's mixed_precision={mp} is ignored; nanorl's --dtype sets the "
              "compute dtype (fp32 master weights, nanorl/precision.py)", file=sys.stderr, flush=True)


# keys in the process group's store
FAILED, SEEN = "nanorl/failed", "nanorl/failed_seen"


@contextmanager
def fail_together(rank: int, world: int, poll_s: float = 1.0, linger_s: float = 30.0):
    """One rank's error ends every rank, with that rank's error, instead of a hang.

    Without it, a rank that raises leaves the others blocked in their next collective: NCCL waits out
    its timeout (10 minutes by default), then kills the job with a message that names neither the
    rank nor the error; a rank kept alive by a non-daemon thread can hang them forever. Here the
    failing rank (1) posts "rank R failed: Type: message" to the process group's key-value store (the
    rendezvous store every rank already holds; the first failure wins), (2) aborts its process group
    (NCCL: its communicators, so that its own exit cannot hang on them), (3) waits up to linger_s for
    every peer to read the message (rank 0 may host the store), then re-raises. The others learn it
    within poll_s from a watcher thread polling the store: a rank blocked inside a collective cannot
    raise — a peer's abort did not wake it, neither on NCCL nor here on gloo (measured: it waited
    until the failing process exited) — so the watcher prints the message and ends the process (exit
    status 1); a rank whose own collective failed first raises with the peer's error as the cause.
    A failed NCCL collective raises nothing in Python (its watchdog thread finds it): the watcher also
    polls `backend_error` and posts it as this rank's failure, then ends the process the same way.
    Not covered: a rank killed outright (SIGKILL, the OOM killer) posts nothing — the launcher or the
    collective timeout ends the others."""
    if world == 1 or not dist.is_initialized():
        yield
        return
    store = dist.distributed_c10d._get_default_store()
    done = threading.Event()
    threading.Thread(target=_watch_peers, args=(store, rank, done, poll_s, linger_s, world), daemon=True,
                     name="nanorl-fail-together").start()
    try:
        yield
    except BaseException as e:
        done.set()
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        mine = f"rank {rank} failed: {type(e).__name__}: {str(e)[:2000]}"
        try:
            # set only if no rank failed before
            first = store.compare_set(FAILED, "", mine).decode()
            # a peer failed first: ours is a consequence (e.g. "connection closed")
            if first != mine:
                store.add(SEEN, 1)
                raise RuntimeError(f"rank {rank} stopped because {first}") from e
        # the store is gone (its host exited): nobody left to tell
        except dist.DistError:
            raise e from None
        print(f"nanorl: {mine}; aborting the process group so that every rank stops", file=sys.stderr,
              flush=True)
        # private in 2.13
        abort = getattr(dist.distributed_c10d, "_abort_process_group", dist.destroy_process_group)
        _ABORTED.set()
        abort()
        end = time.monotonic() + linger_s
        try:
            while time.monotonic() < end and int(store.add(SEEN, 0)) < world - 1:
                time.sleep(0.1)
        except dist.DistError:
            # the store went away with its host: stop waiting, the message was posted
            pass
        raise
    finally:
        done.set()


def backend_error() -> str | None:
    """What NCCL's watchdog recorded on this rank's default group (a collective that failed or timed
    out here; a peer's error, REMOTE_ERROR, is the peer's to post), else None. gloo raises its errors in
    the collective's caller instead: None. Written against torch 2.13's ProcessGroupNCCL (get_error,
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2, set by `init`); not run here (no GPU)."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return None
    from torch._C._distributed_c10d import ErrorType
    error = dist.group.WORLD._get_backend(torch.device("cuda")).get_error()
    if error in (ErrorType.TIMEOUT, ErrorType.COMM_ERROR):
        return f"NCCL collective {'timed out' if error == ErrorType.TIMEOUT else 'failed'} ({error.name})"
    return None


def _watch_peers(store, rank: int, done: threading.Event, poll_s: float, linger_s: float = 30.0,
                 world: int = 2) -> None:
    while not done.wait(poll_s):
        try:
            own = backend_error()
            if own is not None:  # as fail_together posts a raised error; nothing will raise here
                _post_own(store, rank, world, f"rank {rank} failed: {own}", linger_s)
            if not store.check([FAILED]):
                continue
            msg = store.get(FAILED).decode()
        # the store's host exited (a normal end on another rank): stop watching
        except dist.DistError:
            return
        if done.is_set() or msg.startswith(f"rank {rank} "):
            return
        print(f"nanorl: rank {rank} stops: {msg}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        store.add(SEEN, 1)
        # the failing rank exits first: a launcher then names it the root cause
        time.sleep(2 * poll_s)
        # the main thread may be stuck in a collective: no exception can reach it
        os._exit(1)


def _post_own(store, rank: int, world: int, mine: str, linger_s: float) -> None:
    """This rank's failure found by the watcher (`backend_error`): posted unless a peer failed first,
    read by the peers (up to linger_s), then the process ends, status 1."""
    first = store.compare_set(FAILED, "", mine).decode()
    if first != mine:
        print(f"nanorl: rank {rank} stops: {first}", file=sys.stderr, flush=True)
        store.add(SEEN, 1)
    else:
        print(f"nanorl: {mine}; ending this rank", file=sys.stderr, flush=True)
        end = time.monotonic() + linger_s
        while time.monotonic() < end and int(store.add(SEEN, 0)) < world - 1:
            time.sleep(0.1)
    sys.stdout.flush()
    _ABORTED.set()
    os._exit(1)
