"""Gradient-norm clipping over sharded parameters: the single-device `clip_grad_norm_`, exactly.

    total = clip_grad_norm_(named_grads, storage_specs, mesh, max_norm=1.0)

`torch.nn.utils.clip_grad_norm_` on a rank's local shards would compute a
different norm on every rank (each sees only its blocks) and scale the
gradients inconsistently. The norm of the full gradients is assembled from the
local ones: per mesh axis, a parameter stored `Shard` there holds a distinct
block on each rank of the axis (its squares add up over the axis), while one
stored `Replicate` holds the same values on every rank (counted once). So the
local sums of squares are grouped by the set of axes that shard the
parameter, each group is all-reduced over the group spanning those axes, and
the groups are added: every rank gets the same total. The infinity norm takes
maxima instead. Gradients are then scaled in place by
min(1, max_norm / (total + 1e-6)), torch's formula.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from autopar.runtime import comm
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.spec import Shard, Spec

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


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
        part = torch.zeros(1, dtype=torch.float64, device=by_axes[axes][0].device)
        for g in grads_here:  # this rank's share of the group: a max, or a sum of |g|^p
            part = torch.maximum(part, g.abs().max()) if is_inf else part + g.abs().pow(norm_type).sum()
        if axes:
            part = comm.all_reduce(part, mesh.flat_group_name(axes), "max" if is_inf else "sum")
        part = part.cpu().reshape(())
        total = torch.maximum(total, part) if is_inf else total + part
    return (total if is_inf else total.pow(1.0 / norm_type)).float()


def clip_grad_norm_(grads: Mapping[str, torch.Tensor], storage: Mapping[str, Spec], mesh: ProcessMesh,
                    max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale `grads` in place so their full norm is at most `max_norm`; return the norm before clipping."""
    total = total_grad_norm(grads, storage, mesh, norm_type)
    scale = min(1.0, max_norm / (float(total) + _EPS))
    if scale < 1.0:
        for g in grads.values():
            g.mul_(scale)
    return total
