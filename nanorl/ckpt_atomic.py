"""Atomic checkpoint directories: a step directory appears whole or not at all, and is verified on read.

nanorl/checkpoint.py decides what a step saves and restores; this module decides how those files land
on disk and how a reader knows they are whole. Start at `write_step_dir(root, step, rank, world, write,
keep)`: rank 0 makes a hidden `.tmp-step_NNNNNN-<pid>` directory, every rank runs `write(tmp)`, every
rank hashes a share of the files (size and sha256, after an fsync), rank 0 writes manifest.json last
(its presence means "complete"), fsyncs and renames the directory into place in one step, then
deletes all but the newest `keep` complete checkpoints. `verify` is the reader's side (a missing or
damaged file fails the manifest), `list_checkpoints` the step directories, newest first.
Key choices: every verdict is agreed by all ranks (`all_gather`, `from_rank0`; one process skips the
collectives), so all ranks raise the same CheckpointError or none; a failed save removes its hidden
directory and leaves the previous checkpoint as it was; leftovers of a killed save are never read
and are cleared by the next save.

    python -m pytest tests/test_reliability.py -q
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Callable

import torch
from torch.distributed.checkpoint import CheckpointException

FORMAT = "nanorl-checkpoint-1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; the message says which and why."""


# ----------------------------------------------------------------------------- verdicts every rank shares

def all_gather(world: int, value) -> list:
    """Every rank's value, in rank order (an all-gather; one process: [value])."""
    if world == 1:
        return [value]
    out = [None] * world
    torch.distributed.all_gather_object(out, value)
    return out


def from_rank0(world: int, value):
    """Rank 0's value on every rank (a broadcast; one process: the value)."""
    if world == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def first_error(world: int, err: str | None) -> str | None:
    """The first rank's error, or None: the same verdict on every rank."""
    return next((e for e in all_gather(world, err) if e), None)


# ----------------------------------------------------------------------------- durable files

def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def torch_save(obj, path: str) -> None:
    """torch.save, with a failed write raised as the OSError it is: torch's zip writer reports a full
    disk as RuntimeError "[enforce fail at inline_container.cc:...] unexpected pos ...", which the save
    would otherwise treat as a bug (a traceback instead of its one line)."""
    try:
        torch.save(obj, path)
    except RuntimeError as e:
        if "inline_container" not in str(e):
            raise
        raise OSError(f"torch.save could not write {os.path.basename(path)} (is the disk full?): {e}") from e


# ----------------------------------------------------------------------------- writing a step directory

def write_step_dir(root: str, step: int, rank: int, world: int, write: Callable[[str], None],
                   keep: int) -> str:
    """root/step_NNNNNN, written by `write(tmp)` (every rank calls it with the same hidden directory;
    an OSError or DCP CheckpointException it raises is a failed save) and published atomically; every
    rank calls this and returns the path, or raises the same CheckpointError. Then only the newest
    `keep` complete checkpoints stay."""
    final = os.path.join(root, f"step_{step:06d}")
    tmp, err = from_rank0(world, _make_tmp(root, step) if rank == 0 else None)
    # several nodes: a rank that cannot see rank 0's directory would hash nothing, silently; the
    # verdict is agreed before the collective write below
    if world > 1:
        if err is None and not os.path.isdir(tmp):
            err = f"{tmp} (made by rank 0) is not visible on rank {rank}: --out-dir must be shared"
        err = first_error(world, err)
    trash = tmp.replace(f"{os.sep}.tmp-", f"{os.sep}.trash-")
    try:
        if err is None:
            try:
                write(tmp)
            except (OSError, CheckpointException) as e:
                err = f"{type(e).__name__}: {e}"
        err = first_error(world, err)
        entries = {}
        # sizes and sha256 (after an fsync): each rank a share of the files
        if err is None:
            files = sorted(os.path.relpath(os.path.join(d, n), tmp) for d, _, ns in os.walk(tmp) for n in ns)
            try:
                entries = {f: _entry(tmp, f) for f in files[rank::world]}
            except OSError as e:
                err = f"{type(e).__name__}: {e}"
        shares = all_gather(world, (entries, err))
        err = next((e for _, e in shares if e), None)
        if rank == 0 and err is None:
            try:
                # the manifest is written last: it means "complete"
                write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT, "step": step, "files": {
                    f: m for share, _ in shares for f, m in sorted(share.items())}})
                fsync(tmp)
                # the same step saved again (save_every, then the end of the run)
                if os.path.exists(final):
                    os.rename(final, trash)
                os.rename(tmp, final)
                fsync(root)
            except OSError as e:
                err = f"{type(e).__name__}: {e}"
        err = from_rank0(world, err)
    # anything else (a bug, Ctrl-C): leave no half-written directory behind
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if err is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = [p for _, p in list_checkpoints(root)]
        raise CheckpointError(f"could not write checkpoint {final}: {err}. Nothing was replaced: the "
                              f"previous checkpoint ({prev[0] if prev else 'none'}) is intact. Free disk "
                              "space, then resume with --resume latest.")
    if rank == 0:
        shutil.rmtree(trash, ignore_errors=True)
        complete = [s for s, p in list_checkpoints(root) if os.path.isfile(os.path.join(p, MANIFEST))]
        # keep the newest `keep` complete ones, delete everything older
        if len(complete) >= keep:
            for s, p in list_checkpoints(root):
                if s < complete[keep - 1]:
                    shutil.rmtree(p, ignore_errors=True)
    return final


def _make_tmp(root: str, step: int) -> tuple[str, str | None]:
    """Rank 0: clear what killed saves left behind, create this save's hidden directory: (path, error)."""
    tmp = os.path.join(root, f".tmp-step_{step:06d}-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        # leftovers of a save that was killed: never valid, never read
        for name in os.listdir(root):
            if name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
        return tmp, None
    except OSError as e:
        return tmp, f"{type(e).__name__}: {e}"


def _entry(root: str, name: str) -> dict:
    path = os.path.join(root, name)
    fsync(path)
    return {"bytes": os.path.getsize(path), "sha256": sha256(path)}


# ----------------------------------------------------------------------------- reading

def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step_N directory under root, newest first (validity not checked)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := STEP_DIR.match(n))]
    return sorted(found, reverse=True)


def verify(path: str, part: tuple[int, int] = (0, 1)) -> dict:
    """The manifest of a complete, intact checkpoint; else CheckpointError saying what is wrong.
    part=(rank, world): hash only every world-th file from the rank-th (ranks split the reading)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except FileNotFoundError:
        why = "not a checkpoint, or its save was interrupted"
        raise CheckpointError(f"{path}: no {MANIFEST} ({why})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupt {MANIFEST} ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for i, (name, meta) in enumerate(sorted(files.items())):
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            raise CheckpointError(f"{path}: {name} is missing")
        if os.path.getsize(p) != meta["bytes"] or (i % part[1] == part[0] and sha256(p) != meta["sha256"]):
            raise CheckpointError(f"{path}: {name} is corrupt (size or sha256 differs from the manifest)")
    return manifest
