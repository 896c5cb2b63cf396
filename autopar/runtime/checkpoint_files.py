"""The files of one checkpoint directory: a manifest of checksums, checked before anything is read, and DCP's
files read without running code from them.

    entries = hash_files(directory, names)       # each rank hashes its share, rank 0 writes them
    write_manifest(directory, entries)
    problems = verify_files(directory, names)    # each rank checks its share before a load
    reader, planner = SafeReader(directory), SafeLoadPlanner()   # for dcp.load

A checkpoint is torch.distributed.checkpoint's directory: `.metadata` (a pickle of DCP's
`Metadata`) and `__<rank>_<n>.distcp` files, each a run of items (a tensor's chunk, or a
non-tensor value such as a step count) at the offsets `.metadata` records. The manifest,
`autopar-manifest.json` beside them, holds each file's size and SHA-256 and, for each item,
its name and the SHA-256 of its bytes: a flipped byte is found before a load reads it and
named by file and tensor ("__1_0.distcp, bytes 4096-8191 of model.fc1.weight").

DCP reads `.metadata` with `pickle.load` and each non-tensor value with `torch.load(...,
weights_only=False)`: a crafted file runs code in the loading process. Here `.metadata` is
checked against the manifest when there is one, and unpickled in any case by an unpickler
that admits DCP's own classes and torch's sizes, dtypes and layouts only
(`_MetadataUnpickler`); values are read with `weights_only=True`, torch's unpickler for
tensors and plain data. A directory torch wrote alone (`dcp.save` of one device's state)
has no manifest and is read the same safe way.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from autopar.errors import CheckpointError

MANIFEST = "autopar-manifest.json"
METADATA = ".metadata"
_FORMAT = 1  # the manifest's layout
_CHUNK_BYTES = 8 * 2**20  # read at a time while hashing

# what `.metadata` may name: DCP's classes, torch's sizes and layouts, paths (its `StorageMeta` holds one)
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that builds only the classes DCP's `Metadata` is made of (and torch's dtypes)."""

    def __init__(self, file: io.BufferedIOBase, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise CheckpointError(f"{self.path} names {module}.{name}, which is not part of a checkpoint's metadata: "
                                  "refused unread (unpickling it could run code). Load checkpoints only from where "
                                  "you saved them")
        return super().find_class(module, name)


def read_metadata(directory: str) -> Metadata:
    """DCP's `Metadata` of `directory`, checked against the manifest if there is one, unpickled safely."""
    path = os.path.join(directory, METADATA)
    manifest = read_manifest(directory)
    with open(path, "rb") as f:
        data = f.read()
    if manifest is not None:
        want = manifest["files"].get(METADATA, {}).get("sha256")
        if hashlib.sha256(data).hexdigest() != want:
            raise CheckpointError(f"{path} does not match its checksum in {MANIFEST}: the checkpoint's metadata is "
                                  "corrupt or was replaced; load an earlier checkpoint")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 -- a truncated or garbled pickle fails in many ways
        raise CheckpointError(f"{path} cannot be read as a checkpoint's metadata ({type(err).__name__}: {err}); "
                              "the checkpoint is incomplete or corrupt: load an earlier one") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a checkpoint's metadata")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `read_metadata` above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(os.fspath(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner reading non-tensor values with torch's weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"the checkpoint's value {fqn!r} is not plain data (tensors, numbers, strings, lists "
                                  f"and dicts of them), refused unread: {str(err).splitlines()[0]}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


# ------------------------------------------------------------------ the manifest
def read_manifest(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if manifest.get("format") != _FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, UnicodeDecodeError, AttributeError) as err:
        raise CheckpointError(f"{path} is not a manifest autopar can read ({err}); the checkpoint is corrupt") from None
    return manifest


def _items_by_file(metadata: Metadata) -> dict[str, list[tuple[str, int, int]]]:
    """file -> its items (name, offset, length) by offset, from the metadata's storage records."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    for index, info in metadata.storage_data.items():
        name = index.fqn if index.offset is None else f"{index.fqn} at {tuple(index.offset)}"
        out.setdefault(info.relative_path, []).append((name, info.offset, info.length))
    return {f: sorted(items, key=lambda i: i[1]) for f, items in out.items()}


def _ranges(items: list[tuple[str, int, int]], size: int) -> list[tuple[str, int, int]]:
    """The items of a file and the bytes between and after them (DCP writes none; a file could gain some)."""
    out, at = [], 0
    for name, offset, length in items:
        if offset > at:
            out.append(("(bytes outside any tensor)", at, offset - at))
        out.append((name, offset, length))
        at = max(at, offset + length)
    if size > at:
        out.append(("(bytes outside any tensor)", at, size - at))
    return out


def _sha256(f: io.BufferedReader, offset: int, length: int) -> str:
    h = hashlib.sha256()
    f.seek(offset)
    left = length
    while left > 0:
        chunk = f.read(min(left, _CHUNK_BYTES))
        if not chunk:
            break  # a short file: the hash differs from the recorded one
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()


def hash_files(directory: str, names: list[str], metadata: Metadata) -> dict[str, Any]:
    """The manifest's entry of each file in `names`: its size, SHA-256, and each item's."""
    items = _items_by_file(metadata)
    out = {}
    for name in names:
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            entry: dict[str, Any] = {"bytes": size, "sha256": _sha256(f, 0, size)}
            if name in items:
                entry["items"] = [[item, offset, length, _sha256(f, offset, length)]
                                  for item, offset, length in _ranges(items[name], size)]
        out[name] = entry
    return out


def write_manifest(directory: str, files: dict[str, Any]) -> None:
    """Write the manifest and make it durable (the caller then publishes the directory)."""
    path = os.path.join(directory, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump({"format": _FORMAT, "files": files}, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make the directory's entries (files created, renamed, removed in it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_files(directory: str, names: list[str], manifest: dict[str, Any]) -> list[str]:
    """What differs from the manifest in the files `names` (each problem names the file and the tensor)."""
    problems = []
    for name in names:
        want = manifest["files"][name]
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            problems.append(f"{name} is missing")
            continue
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size == want["bytes"] and _sha256(f, 0, size) == want["sha256"]:
                continue
            bad = [f"{item} (bytes {offset}-{offset + length - 1})" for item, offset, length, sha in want.get("items", [])
                   if _sha256(f, offset, length) != sha]
        sized = "" if size == want["bytes"] else f", {size} bytes where {want['bytes']} were written"
        problems.append(f"{name} does not match its checksum{sized}: {', '.join(bad) or 'its bytes'} changed")
    return problems
