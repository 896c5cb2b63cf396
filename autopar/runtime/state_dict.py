"""Full (unsharded) and sharded state dicts of parameters stored as local shards.

    full = full_state_dict(local, specs, mesh)             # gather: every rank gets full tensors
    local = shard_state_dict(full, specs, mesh)            # slice: this rank's shards
    batch = shard_pytree(global_batch, input_specs, mesh)  # this rank's slice of every input
    load_full_state_dict(local, full, specs, mesh)         # slice and copy into existing shards
    save_sharded(local, specs, mesh, path, osd, extra)     # the next checkpoint under path (`runtime.checkpoints`)
    osd = load_sharded(local, specs, mesh, path, osd, extra)  # the newest; reshards when the specs/mesh differ
    full_osd = gather_optimizer_state(osd, local, specs, mesh)   # an optimizer's state, full tensors
    osd = shard_optimizer_state(full_osd, local, specs, mesh)    # this rank's blocks of it

`specs[name]` is the tensor's storage `Spec` (one placement per mesh axis; Partial
is not a storage layout). Several axes sharding the same dim nest in mesh-axis order,
DTensor's convention: S(0)S(0) on a (2, 2) mesh puts rows [k*n/4, (k+1)*n/4) with
k = 2*coord0 + coord1 on each rank. Sharded checkpoints wrap each shard as a DTensor
on the mesh's DeviceMesh (`DTensor.from_local`), so DCP writes and reshards them: we
reuse torch's checkpoint format rather than inventing one.

Optimizer state (`osd`) is torch's FQN-keyed optimizer state dict, as
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` returns it
({"state": {fqn: {name: value}}, "param_groups": [{"params": [fqn, ...], ...}]}).
An optimizer keeps per-element state (Adam's moments, SGD's momentum) shaped like
the parameter: on a rank, like the parameter's local shard, split as its storage
spec splits it. A 0-d tensor (Adam's step) is the same on every rank. Other state (a
factored second moment) is refused by name: its split cannot be told from its shape.
A checkpoint holds {"model": ..., "optim": ...}, the layout of torch's
`get_state_dict`, so one device's model and optimizer load it with torch alone.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.optional import require
from autopar.runtime import checkpoints
from autopar.runtime.checkpoint_files import SafeLoadPlanner, SafeReader, read_metadata
from autopar.runtime.collectives import all_gather, local_slice
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.optimizers import BLOCK_KEY
from autopar.solver.spec import Partial, Shard, Spec

logger = logging.getLogger(__name__)


class StateDictError(AutoparError):
    """A state dict does not match the parameters' names, shapes or specs."""


def _check_spec(name: str, spec: Spec, mesh: ProcessMesh) -> None:
    if len(spec.placements) != mesh.ndim:
        raise StateDictError(f"{name}: spec {spec} has {len(spec.placements)} placements for a {mesh.ndim}-axis mesh {mesh.shape}")
    if any(isinstance(p, Partial) for p in spec.placements):
        raise StateDictError(f"{name}: storage spec {spec} has a Partial placement; parameters are stored Replicate or Shard")


def global_shape(local: torch.Tensor, spec: Spec, mesh: ProcessMesh) -> tuple[int, ...]:
    shape = list(local.shape)
    for p, n in zip(spec.placements, mesh.shape):
        if isinstance(p, Shard):
            shape[p.dim] *= n
    return tuple(shape)


@torch.no_grad()
def gather_full(local: torch.Tensor, spec: Spec, mesh: ProcessMesh) -> torch.Tensor:
    """The full tensor from this rank's shard (a collective: every rank of the mesh must call it)."""
    out = local.detach()
    # Undo the nesting innermost first: the last mesh axis split last.
    for axis in reversed(range(mesh.ndim)):
        p = spec.placements[axis]
        if isinstance(p, Shard) and mesh.shape[axis] > 1:
            out = all_gather(out, p.dim, mesh.group_name(axis))
    return out.clone() if out.data_ptr() == local.data_ptr() else out  # never a view of the live shard


@torch.no_grad()
def local_shard(full: torch.Tensor, spec: Spec, mesh: ProcessMesh) -> torch.Tensor:
    """This rank's shard of `full` (no communication)."""
    out = full.detach()
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            out = local_slice(out, p.dim, mesh.group_name(axis))
    return out.clone() if out.data_ptr() == full.data_ptr() else out  # never a view of `full`


def full_state_dict(local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec], mesh: ProcessMesh) -> dict[str, torch.Tensor]:
    """Gather every entry of `local` to its full tensor; entries without a spec are replicated already."""
    out = {}
    for name, t in local.items():
        spec = specs.get(name)
        if spec is None:
            out[name] = t.detach().clone()
            continue
        _check_spec(name, spec, mesh)
        out[name] = gather_full(t, spec, mesh)
    return out


def shard_state_dict(full: Mapping[str, torch.Tensor], specs: Mapping[str, Spec], mesh: ProcessMesh) -> dict[str, torch.Tensor]:
    """Slice every entry of `full` into this rank's shard per its spec."""
    out = {}
    for name, t in full.items():
        spec = specs.get(name)
        if spec is None:
            out[name] = t.detach().clone()
            continue
        _check_spec(name, spec, mesh)
        try:
            spec.local_shape(t.shape, mesh.shape)
        except ValueError as e:
            raise StateDictError(f"{name}: full shape {tuple(t.shape)} cannot be sharded as {spec} on mesh {mesh.shape}: {e}") from e
        out[name] = local_shard(t, spec, mesh)
    return out


def shard_pytree(tree: Any, specs: Sequence[Spec], mesh: ProcessMesh) -> Any:
    """This rank's slice of every tensor leaf of `tree` (e.g. a global batch), the i-th tensor leaf cut per `specs[i]`."""
    flat, treespec = pytree.tree_flatten(tree)
    n_tensors = sum(isinstance(t, torch.Tensor) for t in flat)
    if n_tensors != len(specs):
        raise StateDictError(f"{n_tensors} tensors in the batch but {len(specs)} input specs; feed the inputs the model was parallelized with")
    it = iter(specs)
    return pytree.tree_unflatten([local_shard(t, next(it), mesh) if isinstance(t, torch.Tensor) else t for t in flat], treespec)


@torch.no_grad()
def load_full_state_dict(
    local: Mapping[str, torch.Tensor],
    full: Mapping[str, torch.Tensor],
    specs: Mapping[str, Spec],
    mesh: ProcessMesh,
    strict: bool = True,
) -> None:
    """Copy this rank's slice of each full tensor into the existing local shard (in place, so optimizers keep their references)."""
    missing = sorted(set(local) - set(full))
    unexpected = sorted(set(full) - set(local))
    if strict and (missing or unexpected):
        raise StateDictError(f"state dict mismatch: missing {missing}, unexpected {unexpected}; pass strict=False to load the intersection")
    shards = shard_state_dict({k: v for k, v in full.items() if k in local}, specs, mesh)
    for name, shard in shards.items():
        dst = local[name]
        if dst.shape != shard.shape:
            spec = specs.get(name, Spec.replicate(mesh.ndim))
            raise StateDictError(f"{name}: full tensor {tuple(full[name].shape)} sharded as {spec} gives {tuple(shard.shape)}, but the local shard is {tuple(dst.shape)}")
        dst.copy_(shard)


def _as_dtensor(name: str, t: torch.Tensor, spec: Spec, mesh: ProcessMesh) -> DTensor:
    _check_spec(name, spec, mesh)
    placements = [DShard(p.dim) if isinstance(p, Shard) else DReplicate() for p in spec.placements]
    shape = global_shape(t, spec, mesh)
    stride = torch.empty(shape, device="meta").stride()
    # A view of the local tensor: DCP's load writes straight into our shards.
    return DTensor.from_local(t.detach(), mesh.device_mesh, placements, run_check=False, shape=shape, stride=stride)


def _as_dtensors(local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec], mesh: ProcessMesh) -> dict[str, DTensor]:
    return {name: _as_dtensor(name, t, specs.get(name, Spec.replicate(mesh.ndim)), mesh) for name, t in local.items()}


# ------------------------------------------------------------------ optimizer state
def _state_spec(fqn: str, name: str, value: Any, local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec],
                mesh: ProcessMesh, full: bool) -> Spec | None:
    """How state `name` of parameter `fqn` is split over the mesh; None when every rank holds it whole
    (a 0-d tensor, a number). full: `value` is the full tensor, else this rank's."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    if fqn not in local:
        raise StateDictError(f"optimizer state for {fqn!r}, which is not a parameter of this module; load the state "
                             f"of an optimizer over this model's parameters")
    spec = specs.get(fqn, Spec.replicate(mesh.ndim))
    param = local[fqn]
    want = global_shape(param, spec, mesh) if full else tuple(param.shape)
    if tuple(value.shape) != want:
        raise StateDictError(
            f"optimizer state {name!r} of {fqn} has shape {tuple(value.shape)}, neither the parameter's {want} nor a "
            f"scalar: autopar splits only per-element optimizer state (Adam's moments, SGD's momentum) with the "
            f"parameter; use such an optimizer, or a plan that replicates {fqn}")
    return spec


def _map_state(osd: Mapping[str, Any], fn) -> dict[str, Any]:
    """`osd` with each state value replaced by fn(fqn, name, value), without the marks of which rank's block an
    entry is (`optimizers.BLOCK_KEY`: these functions gather or split the blocks); the param groups shared."""
    state = {fqn: {name: fn(fqn, name, v) for name, v in entries.items() if name != BLOCK_KEY}
             for fqn, entries in osd["state"].items()}
    return {"state": state, "param_groups": osd["param_groups"]}


def gather_optimizer_state(osd: Mapping[str, Any], local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec],
                           mesh: ProcessMesh) -> dict[str, Any]:
    """One device's optimizer state from this rank's (a collective: every rank calls it with the same names)."""
    def gather(fqn, name, v):
        spec = _state_spec(fqn, name, v, local, specs, mesh, full=False)
        if spec is not None:
            return gather_full(v, spec, mesh)
        return v.detach().clone() if isinstance(v, torch.Tensor) else v
    return _map_state(osd, gather)


def shard_optimizer_state(full_osd: Mapping[str, Any], local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec],
                          mesh: ProcessMesh) -> dict[str, Any]:
    """This rank's blocks of one device's optimizer state (no communication)."""
    def shard(fqn, name, v):
        spec = _state_spec(fqn, name, v, local, specs, mesh, full=True)
        return v if spec is None else local_shard(v.to(local[fqn].device), spec, mesh)
    return _map_state(full_osd, shard)


# ------------------------------------------------------------------ checkpoints
def _checkpoint(local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec], mesh: ProcessMesh,
                osd: Mapping[str, Any] | None, extra: dict[str, Any] | None) -> dict[str, Any]:
    """What DCP saves or loads: the shards as DTensors (views of ours), the optimizer's split ones too, and
    `extra` as it is (the same on every rank)."""
    state: dict[str, Any] = {"model": _as_dtensors(local, specs, mesh)}
    if extra is not None:
        state["extra"] = extra
    if osd is not None:
        def wrap(fqn, name, v):
            spec = _state_spec(fqn, name, v, local, specs, mesh, full=False)
            return v if spec is None else _as_dtensor(f"{fqn}.{name}", v, spec, mesh)
        state["optim"] = _map_state(osd, wrap)
    return state


def save_sharded(local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec], mesh: ProcessMesh, path: str | os.PathLike,
                 osd: Mapping[str, Any] | None = None, extra: dict[str, Any] | None = None,
                 background: bool = False, keep_last: int = 2) -> Future | None:
    """Write the shards and, if given, this rank's optimizer state `osd` and other state `extra` that every rank
    holds alike (a step count, a scheduler's state dict) as the next checkpoint under the directory `path`,
    published whole or not at all, the newest `keep_last` kept (`runtime.checkpoints`). Each rank writes its
    shards; replicated tensors are deduplicated by DCP.
    background: return once the state is copied aside (DCP's `async_save`), writing it in a thread: the
    returned future completes when the checkpoint is published. Its collectives run on a group of their own,
    so training's collectives meanwhile cannot interleave with them. A save or load first waits for the
    background save before it, so two writes never overlap."""
    future = checkpoints.save(path, _checkpoint(local, specs, mesh, osd, extra), background, keep_last)
    if future is None and mesh.coordinate == (0,) * mesh.ndim:
        logger.info("runtime: saved %d tensors%s under %s", len(local), " and the optimizer state" if osd else "", path)
    return future


def checkpoint_to_load(path: str | os.PathLike) -> str:
    """The checkpoint directory a load of `path` reads (the newest under it, `checkpoints.resolve`), once any
    background save, which may be publishing a newer one, is done."""
    checkpoints.wait_for_background_save()
    return checkpoints.resolve(path)


@torch.no_grad()
def load_sharded(local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec], mesh: ProcessMesh, path: str | os.PathLike,
                 osd: Mapping[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Fill the local shards in place from the checkpoint `checkpoint_to_load(path)` finds, written by
    `save_sharded` under any specs or mesh (its files checked against their checksums first), or from a Hugging
    Face model directory (safetensors, as `save_pretrained` writes them: weights only).
    osd: this rank's optimizer state, whose names and shapes say what to read (made by the optimizer
    over these shards); returns it filled from the checkpoint, to load into the optimizer.
    extra: the keys of the saved `extra` to read, each value replaced in place by the saved one."""
    path = checkpoint_to_load(path)
    if _is_hf_directory(path):
        require("safetensors", f"loading the Hugging Face model directory {path!r}")  # what DCP's reader reads it with
        if osd is not None or extra is not None:
            raise StateDictError(f"{path!r} is a Hugging Face model directory: it holds weights only, no optimizer "
                                 "state or extra state; load those from a checkpoint written by save_checkpoint")
        state = {"model": _hf_targets(local, specs, mesh, path)}
        _load(state["model"], path, HuggingFaceStorageReader(path), osd)
    else:
        checkpoints.verify(path)
        state = _checkpoint(local, specs, mesh, osd, extra)
        _load(state, path, SafeReader(path), osd)
    for name, t in local.items():
        if name not in state["model"]:
            continue  # a tied name the file does not hold: the same tensor as a name it does
        loaded = state["model"][name].to_local()
        if loaded.data_ptr() != t.data_ptr():  # DCP replaced the tensor instead of filling it
            t.copy_(loaded)
    if osd is None:
        return None
    return _map_state(state["optim"], lambda fqn, name, v: v.to_local() if isinstance(v, DTensor) else v)


def _load(state: dict[str, Any], path: str, reader: dcp.StorageReader, osd: Mapping[str, Any] | None) -> None:
    try:
        # the safe planner: DCP's reads non-tensor values with torch.load(weights_only=False) (`checkpoint_files`)
        dcp.load(state, checkpoint_id=path, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as e:
        missing = "" if osd is None or _has_optimizer_state(path) else " (it holds no optimizer state: it was saved without one)"
        raise StateDictError(f"checkpoint {path!r} does not match this module{missing}: {_cause(e)}") from e


def _is_hf_directory(path: str) -> bool:
    """A directory of safetensors files without DCP's metadata: a Hugging Face model's weights."""
    return os.path.isdir(path) and not os.path.exists(os.path.join(path, ".metadata")) and \
        any(f.endswith(".safetensors") for f in os.listdir(path))


def _hf_targets(local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec], mesh: ProcessMesh, path: str) -> dict[str, DTensor]:
    """The shards to fill from a Hugging Face directory, by the names its files hold. A tied tensor is read
    under whichever of its names is there (`save_pretrained` writes one); a tensor under none is an error."""
    saved = HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    names_of: dict[int, list[str]] = {}
    for name, t in local.items():
        names_of.setdefault(id(t), []).append(name)
    missing = [names[0] for names in names_of.values() if not any(n in saved for n in names)]
    if missing:
        raise StateDictError(f"Hugging Face directory {path!r} does not hold {sorted(missing)[:5]} ({len(missing)} "
                             "tensors): it is not a checkpoint of this model")
    return _as_dtensors({n: t for n, t in local.items() if n in saved}, specs, mesh)


def saved_extra(directory: str) -> frozenset[str]:
    """The names of the `extra` state the checkpoint `directory` (`checkpoint_to_load`'s) holds (none in a
    Hugging Face directory)."""
    if _is_hf_directory(directory) or not os.path.exists(os.path.join(directory, ".metadata")):
        return frozenset()
    keys = read_metadata(directory).state_dict_metadata
    return frozenset(k.split(".", 1)[1] for k in keys if k.startswith("extra."))


def _has_optimizer_state(directory: str) -> bool:
    return any(k.startswith("optim.") for k in read_metadata(directory).state_dict_metadata)


def _cause(e: BaseException) -> str:
    """What DCP says went wrong: the first rank's error (its exception carries each rank's, with tracebacks)."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))[0]
    return str(e).strip() or type(e).__name__
