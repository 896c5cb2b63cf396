"""Cost model: roofline compute time per strategy and alpha-beta ring collectives.

Compute (per training step, forward + backward) of a node under a strategy:
  local FLOPs = global FLOPs / prod(size of every mesh axis on which the
                strategy is not all-Replicate)  (the work is split there;
                on an all-Replicate axis every rank redoes it)
  time = max(FLOPs / mesh.flops_per_s, bytes / mesh.mem_bandwidth_bytes_per_s)
  with bytes = the node's local output bytes (forward) and twice that
  (backward reads the output gradient and writes the input gradient).
Communication inside a strategy: an input that is Replicate on an axis where
the op is split gets a Partial gradient, which needs an all-reduce over that
axis in backward (Megatron's "f" operator).
Ring formulas, with n ranks on the axis, alpha its latency, beta its bandwidth:
  all_reduce      2(n-1)/n * bytes / beta + 2(n-1) alpha   (bytes = local size)
  all_gather      (n-1)/n * bytes / beta + (n-1) alpha     (bytes = gathered size)
  reduce_scatter  (n-1)/n * bytes / beta + (n-1) alpha     (bytes = unreduced full size)
  all_to_all      (n-1)/n * bytes / beta + (n-1) alpha     (bytes = local size)
"""
from __future__ import annotations

import math
from typing import Sequence

from autopar.profiler.types import NodeCost
from autopar.solver.mesh import Mesh, MeshAxis
from autopar.solver.spec import Replicate, Strategy

__all__ = ["collective_time_s", "split_factor", "strategy_cost", "compute_time_s"]


def collective_time_s(kind: str, nbytes: float, axis: MeshAxis) -> float:
    n = axis.size
    if n == 1 or nbytes == 0:
        return 0.0
    frac = (n - 1) / n
    if kind == "all_reduce":
        return 2 * frac * nbytes / axis.beta_bytes_per_s + 2 * (n - 1) * axis.alpha_s
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return frac * nbytes / axis.beta_bytes_per_s + (n - 1) * axis.alpha_s
    raise ValueError(f"unknown collective {kind!r}; expected all_reduce, all_gather, reduce_scatter or all_to_all")


def split_axes(strategy: Strategy, mesh_ndim: int) -> tuple[int, ...]:
    """Mesh axes on which the strategy's work is divided (some spec is not Replicate there)."""
    specs = strategy.input_specs + strategy.output_specs
    return tuple(a for a in range(mesh_ndim) if any(not isinstance(s.placements[a], Replicate) for s in specs))


def split_factor(strategy: Strategy, mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in split_axes(strategy, len(mesh.shape)))


def compute_time_s(flops: float, nbytes: float, mesh: Mesh) -> float:
    return max(flops / mesh.flops_per_s, nbytes / mesh.mem_bandwidth_bytes_per_s)


def strategy_cost(
    node_cost: NodeCost,
    strategy: Strategy,
    out_shapes: Sequence[tuple[int, ...] | None],
    mesh: Mesh,
    in_bytes: Sequence[float] | None = None,
) -> tuple[float, float]:
    """(compute_s, comm_s) of one training step of the node under `strategy`.

    out_shapes: global shape per output (for the local output bytes).
    in_bytes: global bytes per input spec (for the backward all-reduce of
    Replicate inputs of a split op); without it that term is left out.
    """
    factor = split_factor(strategy, mesh)
    out_local_bytes = 0.0
    for i, nbytes in enumerate(node_cost.output_bytes):
        spec = strategy.output_specs[i] if i < len(strategy.output_specs) else None
        out_local_bytes += nbytes / (spec.shard_factor(mesh.shape) if spec is not None else 1)
    compute = compute_time_s(node_cost.fwd_flops / factor, out_local_bytes, mesh)
    compute += compute_time_s(node_cost.bwd_flops / factor, 2 * out_local_bytes, mesh) if node_cost.bwd_flops else 0.0
    comm = 0.0
    if in_bytes is not None and node_cost.bwd_flops:
        axes = split_axes(strategy, len(mesh.shape))
        for spec, nbytes in zip(strategy.input_specs, in_bytes):
            local = nbytes / spec.shard_factor(mesh.shape)
            for a in axes:
                if isinstance(spec.placements[a], Replicate):
                    comm += collective_time_s("all_reduce", local, mesh.axes[a])
    return compute, comm
