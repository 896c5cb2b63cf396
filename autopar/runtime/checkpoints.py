"""Checkpoints kept side by side in one directory, each published whole or not at all.

    future = save(root, state, background=False, keep_last=2)   # a collective; a future when background
    directory = resolve(path)      # the newest complete checkpoint under `path` (or `path`, one checkpoint itself)
    verify(directory)              # a collective: each rank checks its share of the files against the manifest

    root/ckpt-000003/              complete: DCP's files and `autopar-manifest.json` (`checkpoint_files`)
    root/ckpt-000004/
    root/.ckpt-000005.partial/     being written; one a crash left is removed by the next save
    root/.ckpt-000002.old/         being removed (past `keep_last`)

A save writes a fresh directory aside and publishes it only once it is complete:
1. rank 0 picks the next number (one above every directory there, partial or not) and tells the others;
2. every rank writes its shards into the partial directory with torch.distributed.checkpoint (`dcp.save`,
   whose file writer fsyncs each file; `dcp.async_save` for a background save, the rest in a thread);
3. each rank hashes its share of the files, and rank 0 writes the manifest, fsyncs it and the directory,
   renames the directory to `ckpt-<number>` (one atomic rename) and fsyncs the root;
4. rank 0 moves the checkpoints past the newest `keep_last` aside and removes them.
Whatever rank dies at whatever moment, the complete checkpoints before stay as they were, and a
directory named `ckpt-*` is complete: a resumed run loads the newest one, never a mix of two saves.

A load checks every file against the manifest first (each rank a share of them, every rank raising what
any found, naming the file and the tensor), so a corrupt checkpoint loads nothing.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from autopar.errors import CheckpointError
from autopar.runtime import peers
from autopar.runtime.checkpoint_files import (
    MANIFEST,
    METADATA,
    fsync_directory,
    hash_files,
    read_manifest,
    read_metadata,
    verify_files,
    write_manifest,
)

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{6,})$")
_LEFTOVER = re.compile(r"^\.ckpt-(\d{6,})\.(partial|old)$")
_CHECKPOINT_GROUPS: dict[int, dist.ProcessGroup] = {}
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-checkpoint")  # finishes background saves
_writing: Future | None = None  # the last background save, until it is waited for


def _name(number: int) -> str:
    return f"ckpt-{number:06d}"


def checkpoints_in(root: str) -> list[str]:
    """The complete checkpoints under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(root) if (m := _NAME.match(n))]
    return [os.path.join(root, n) for _, n in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint `save` published under `root` (a directory torch's `dcp.load` reads with
    one device's state dict), or None."""
    found = checkpoints_in(os.fspath(root))
    return found[-1] if found else None


def resolve(path: str | os.PathLike) -> str:
    """The directory a load reads: `path` itself when it is one checkpoint (it holds DCP's `.metadata`, or a
    Hugging Face model's safetensors), else the newest complete checkpoint under it."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, METADATA)) or (
            os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path!r} holds no complete checkpoint (no {_name(1)}-style directory with DCP's "
                              f"{METADATA}); save one with pm.save_checkpoint({path!r}), or pass the directory of one")
    return latest


def checkpoint_group() -> dist.ProcessGroup:
    """A gloo group over the world for checkpoints (made once: making a group is a collective): host-side
    collectives even beside NCCL, and a background save's own, which training's cannot interleave with."""
    world = dist.get_world_size()
    if world not in _CHECKPOINT_GROUPS:
        _CHECKPOINT_GROUPS[world] = dist.new_group(backend="gloo")
    return _CHECKPOINT_GROUPS[world]


def wait_for_background_save() -> None:
    """Block until the last background save is published (raising what it raised)."""
    global _writing
    if _writing is not None:
        writing, _writing = _writing, None
        writing.result()


def save(root: str | os.PathLike, state: dict[str, Any], background: bool, keep_last: int) -> Future | None:
    """Write `state` (DCP's state dict: this rank's shards as DTensors) as the next checkpoint under `root` and
    publish it (module docstring). background: return once the state is copied aside; the returned future
    completes when the checkpoint is published."""
    global _writing
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last!r}: keep at least the newest checkpoint (1), e.g. keep_last=2")
    wait_for_background_save()
    root = os.fspath(root)
    group = checkpoint_group()
    number = _on_rank0(group, lambda: _next_number(root))
    partial = os.path.join(root, f".{_name(number)}.partial")
    if background:
        with _unpublished(root, number, group):
            staged = dcp.async_save(state, checkpoint_id=partial, process_group=group)
        _writing = _executor.submit(_publish_after, staged, root, number, group, keep_last)
        return _writing
    with _unpublished(root, number, group):
        dcp.save(state, checkpoint_id=partial, process_group=group)
        _publish(root, number, group, keep_last)
    return None


@contextmanager
def _unpublished(root: str, number: int, group: dist.ProcessGroup) -> Iterator[None]:
    """A save that fails (a peer died or raised mid-write, a disk full) raises `CheckpointError` saying that the
    checkpoint was not published and which one a resumed run would load."""
    try:
        yield
    except CheckpointError:
        raise
    except (RuntimeError, OSError, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        if isinstance(err, CheckpointException):
            first = next(iter(err.failures.values()))[0] if err.failures else err
            why = f"rank {next(iter(err.failures), '?')} raised {type(first).__name__}: {first}"
        elif isinstance(err, OSError):
            why = f"rank {dist.get_rank()}: {type(err).__name__}: {err}"
        else:
            why = str(peers.collective_failed(err, "a collective of the save", group))
        latest = latest_checkpoint(root)
        raise CheckpointError(f"checkpoint {_name(number)} under {root!r} was not published: "
                              f"{why}\nthe checkpoints published before are untouched; a resumed run loads "
                              f"{latest or 'none: there is no earlier one'}") from err


def _next_number(root: str) -> int:
    """(rank 0) The next checkpoint's number; leftovers of saves that crashed are removed first."""
    if os.path.exists(os.path.join(root, METADATA)):
        raise CheckpointError(f"{root!r} is one checkpoint (torch's layout, DCP's {METADATA} in it); save_checkpoint "
                              "keeps each checkpoint in a directory of its own under the path it is given: pass a "
                              "new path, e.g. one beside it")
    os.makedirs(root, exist_ok=True)
    numbers = [0]
    for name in os.listdir(root):
        if m := _NAME.match(name):
            numbers.append(int(m.group(1)))
        elif m := _LEFTOVER.match(name):
            numbers.append(int(m.group(1)))
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return max(numbers) + 1


def _publish_after(staged: Future, root: str, number: int, group: dist.ProcessGroup, keep_last: int) -> None:
    with _unpublished(root, number, group):
        staged.result()
        _publish(root, number, group, keep_last)


def _publish(root: str, number: int, group: dist.ProcessGroup, keep_last: int) -> None:
    """Steps 3 and 4 of the module docstring, once DCP wrote every rank's files (a collective over `group`)."""
    partial = os.path.join(root, f".{_name(number)}.partial")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names = sorted(n for n in os.listdir(partial) if n != MANIFEST and not n.endswith(".tmp"))
    try:
        share: dict[str, Any] | str = hash_files(partial, names[rank::world], read_metadata(partial))
    except (OSError, CheckpointError) as err:
        share = f"rank {rank}: {type(err).__name__}: {err}"
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, share, group=group)
    failed = [s for s in shares if isinstance(s, str)]
    if failed:
        raise CheckpointError(f"the checkpoint was not published, its files could not be hashed: {'; '.join(failed)}; "
                              "the checkpoints published before are untouched")

    def publish() -> str:
        write_manifest(partial, {name: entry for s in shares for name, entry in s.items()})
        final = os.path.join(root, _name(number))
        os.rename(partial, final)
        fsync_directory(root)
        for old in checkpoints_in(root)[:-keep_last]:
            aside = os.path.join(root, f".{os.path.basename(old)}.old")
            os.rename(old, aside)
            shutil.rmtree(aside, ignore_errors=True)
        return final

    final = _on_rank0(group, publish)
    if rank == 0:
        logger.info("runtime: checkpoint %s published (%d files)", final, len(names))


def _on_rank0(group: dist.ProcessGroup, step) -> Any:
    """`step()` on rank 0, its result or its error on every rank of `group` (a collective)."""
    outcome: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            outcome = [("ok", step())]
        except Exception as err:  # noqa: BLE001 -- every rank raises it below
            outcome = [("error", f"{type(err).__name__}: {err}")]
    dist.broadcast_object_list(outcome, group=group, group_src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise CheckpointError(f"the checkpoint was not published: rank 0 raised {value}; the checkpoints published "
                              "before are untouched")
    return value


def verify(directory: str) -> None:
    """Check the files of checkpoint `directory` against its manifest, each rank a share of them; raise on every
    rank what any found (a collective). A directory without a manifest (torch's own `dcp.save`) passes."""
    group = checkpoint_group()
    manifest = read_manifest(directory)
    if manifest is None:
        return
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names = sorted(manifest["files"])
    try:
        mine = verify_files(directory, names[rank::world], manifest)
    except (KeyError, TypeError, ValueError) as err:
        mine = [f"{MANIFEST} is malformed ({type(err).__name__}: {err})"]
    found: list[Any] = [None] * world
    dist.all_gather_object(found, mine, group=group)
    problems = sorted(p for share in found for p in share)
    if problems:
        others = [c for c in checkpoints_in(os.path.dirname(directory)) if c != directory]
        fallback = f"load an earlier one, e.g. {others[-1]!r}" if others else "no earlier checkpoint is kept there"
        raise CheckpointError(f"checkpoint {directory!r} is corrupt, nothing was loaded from it:\n  "
                              + "\n  ".join(problems) + f"\n{fallback}")
