"""Full (unsharded) and sharded state dicts of parameters stored as local shards.

    full = full_state_dict(local, specs, mesh)             # gather: every rank gets full tensors
    local = shard_state_dict(full, specs, mesh)            # slice: this rank's shards
    batch = shard_pytree(global_batch, input_specs, mesh)  # this rank's slice of every input
    load_full_state_dict(local, full, specs, mesh)         # slice and copy into existing shards
    save_sharded(local, specs, mesh, path)                 # torch.distributed.checkpoint, one file per rank
    load_sharded(local, specs, mesh, path)                 # reshards when the specs/mesh differ from the save

`specs[name]` is the tensor's storage `Spec` (one placement per mesh axis; Partial
is not a storage layout). Several axes sharding the same dim nest in mesh-axis order,
DTensor's convention: S(0)S(0) on a (2, 2) mesh puts rows [k*n/4, (k+1)*n/4) with
k = 2*coord0 + coord1 on each rank. Sharded checkpoints wrap each shard as a DTensor
on the mesh's DeviceMesh (`DTensor.from_local`), so DCP writes and reshards them: we
reuse torch's checkpoint format rather than inventing one.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.runtime.collectives import all_gather, local_slice
from autopar.runtime.mesh import ProcessMesh
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
    return out.clone() if out is local else out


@torch.no_grad()
def local_shard(full: torch.Tensor, spec: Spec, mesh: ProcessMesh) -> torch.Tensor:
    """This rank's shard of `full` (no communication)."""
    out = full.detach()
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            out = local_slice(out, p.dim, mesh.group_name(axis))
    return out.clone() if out is full else out


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


def _as_dtensors(local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec], mesh: ProcessMesh) -> dict[str, DTensor]:
    out = {}
    for name, t in local.items():
        spec = specs.get(name, Spec.replicate(mesh.ndim))
        _check_spec(name, spec, mesh)
        placements = [DShard(p.dim) if isinstance(p, Shard) else DReplicate() for p in spec.placements]
        shape = global_shape(t, spec, mesh)
        stride = torch.empty(shape, device="meta").stride()
        # A view of the local tensor: DCP's load writes straight into our shards.
        out[name] = DTensor.from_local(t.detach(), mesh.device_mesh, placements, run_check=False, shape=shape, stride=stride)
    return out


def save_sharded(local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec], mesh: ProcessMesh, path: str | os.PathLike) -> None:
    """Write a sharded checkpoint (each rank writes its shards; replicated tensors are deduplicated by DCP)."""
    dcp.save(_as_dtensors(local, specs, mesh), checkpoint_id=os.fspath(path))
    if mesh.coordinate == (0,) * mesh.ndim:
        logger.info("runtime: saved %d tensors to %s", len(local), path)


@torch.no_grad()
def load_sharded(local: Mapping[str, torch.Tensor], specs: Mapping[str, Spec], mesh: ProcessMesh, path: str | os.PathLike) -> None:
    """Fill the local shards in place from a checkpoint written by `save_sharded` under any specs or mesh."""
    state = _as_dtensors(local, specs, mesh)
    dcp.load(state, checkpoint_id=os.fspath(path))
    for name, t in local.items():
        loaded = state[name].to_local()
        if loaded.data_ptr() != t.data_ptr():  # DCP replaced the tensor instead of filling it
            t.copy_(loaded)
