"""The norm of gradients over sharded parameters: what torch's `clip_grad_norm_` computes on one device.

    pm = ParallelModule(...)                                   # calls track(pm)
    torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)       # the full gradients' norm, then torch's clipping

`torch.nn.utils.clip_grad_norm_` on a rank's local shards would compute a
different norm on every rank (each sees only its blocks) and scale the
gradients inconsistently. The norm of the full gradients is assembled from the
local ones: per mesh axis, a parameter stored `Shard` there holds a distinct
block on each rank of the axis (its squares add up over the axis), while one
stored `Replicate` holds the same values on every rank (counted once). So the
local sums of squares are grouped by the set of axes that shard the
parameter, each group is all-reduced over the group spanning those axes, and
the groups are added: every rank gets the same total. The infinity norm takes
maxima instead. The clipping itself is torch's (`clip_grads_with_norm_`).

torch's own `clip_grad_norm_` is what training loops call (nanoGPT, Hugging Face
Accelerate, Lightning), and on shards it clipped each rank by its own norm: the
replicated parameters (a tensor-parallel plan's layer norms) then took different
steps on different ranks, silently. So `track(module)` makes torch's norm see the
shards: torch's `clip_grad_norm_` finds the norm through the module attribute
`torch.nn.utils.clip_grad._get_total_norm` at each call (however the caller
imported it), and `track` sets that (and the public `torch.nn.utils.get_total_norm`)
to `torch_total_norm`, which computes the norm of the gradients of tracked modules
as above and hands any other tensors to torch's own function unchanged.
"""
from __future__ import annotations

import itertools
import math
import weakref
from typing import Iterable, Iterator, Mapping, Protocol

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as torch_clip_grad

from autopar.runtime import comm
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.spec import Shard, Spec


def total_grad_norm(grads: Mapping[str, torch.Tensor], storage: Mapping[str, Spec], mesh: ProcessMesh,
                    norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all full gradients (as one vector), identical on every rank (a collective: call on all ranks)."""
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    is_inf = math.isinf(norm_type)
    by_axes: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for fqn, g in grads.items():
        axes = tuple(a for a, p in enumerate(storage[fqn].placements) if isinstance(p, Shard) and mesh.shape[a] > 1)
        by_axes.setdefault(axes, []).append(g.detach())
    # every rank walks the same groups in the same order: each is a collective
    total = torch.zeros((), dtype=torch.float64)
    for axes in sorted(by_axes):
        grads_here = [g.double() for g in by_axes[axes] if g.numel()]
        # on the mesh's device, which its collectives run on: host-tier gradients (`runtime.offload`) are on the host
        part = torch.zeros(1, dtype=torch.float64, device=mesh.device_mesh.device_type)
        for g in grads_here:  # this rank's share of the group: a max, or a sum of |g|^p
            share = (g.abs().max() if is_inf else g.abs().pow(norm_type).sum()).to(part.device)
            part = torch.maximum(part, share) if is_inf else part + share
        if axes:
            part = comm.all_reduce(part, mesh.flat_group_name(axes), "max" if is_inf else "sum")
        part = part.cpu().reshape(())
        total = torch.maximum(total, part) if is_inf else total + part
    return (total if is_inf else total.pow(1.0 / norm_type)).float()


class ShardedModule(Protocol):
    """A module whose parameters are local shards (`ParallelModule`), as `torch_total_norm` reads it."""

    mesh: ProcessMesh

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def param_storage(self) -> Mapping[str, Spec]: ...


_TORCH_TOTAL_NORM = torch_clip_grad._get_total_norm
# tracked modules by the order they were made: the same on every rank, so the norms' collectives are too
_TRACKED: weakref.WeakValueDictionary[int, ShardedModule] = weakref.WeakValueDictionary()
_ORDER = itertools.count()


def track(module: ShardedModule) -> None:
    """Make `torch.nn.utils.clip_grad_norm_` and `get_total_norm` compute the full norm of `module`'s
    gradients (a collective, as `module.clip_grad_norm_`); they are torch's own for every other tensor."""
    _TRACKED[next(_ORDER)] = module
    torch_clip_grad._get_total_norm = torch_total_norm
    torch.nn.utils.get_total_norm = torch_total_norm


@torch.no_grad()
def torch_total_norm(tensors: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2.0,
                     error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """`torch.nn.utils.get_total_norm`, where the gradients of tracked modules count as the full gradients
    they are shards of."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = float(norm_type)
    rest = {id(t): t for t in tensors}
    norms = []
    for _, module in sorted(_TRACKED.items()):
        fqn_of = {id(p.grad): fqn for fqn, p in module.named_parameters() if p.grad is not None}
        mine = {fqn_of[key]: rest.pop(key) for key in list(rest) if key in fqn_of}
        if mine:
            norms.append(total_grad_norm(mine, module.param_storage(), module.mesh, norm_type))
    if not norms:
        return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    if rest:  # tensors of no tracked module: whole on every rank
        norms.append(_TORCH_TOTAL_NORM(list(rest.values()), norm_type, False, foreach).float().cpu())
    stacked = torch.stack(norms)
    total = stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(total.isfinite()):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {float(total)}, so they cannot be "
                           "clipped; pass error_if_nonfinite=False to scale them by it anyway")
    return total.to(device=tensors[0].device, dtype=tensors[0].dtype)
