"""Cost model: roofline compute plus per-op overhead per strategy, and alpha-beta ring collectives.

Compute (per training step, forward + backward) of a node under a strategy:
  local FLOPs = global FLOPs / prod(size of every mesh axis on which the
                strategy is not all-Replicate)  (the work is split there;
                on an all-Replicate axis every rank redoes it)
  time = max(FLOPs / rate, bytes / mesh.mem_bandwidth_bytes_per_s)
         + launches * mesh.op_overhead_s
  with rate the device's matmul rate for the dtype the node's math runs in
  (`Mesh.flops_per_s_for`: bf16 operands at the bf16 rate, float32 ones at
  fp32's, or TF32's where the mesh's precision says so),
  with bytes = the node's local output bytes (forward) and twice that in
  backward (it reads the output gradient and writes the input gradient),
  charged for every node that has a backward (requires_grad), not only for
  those with backward FLOPs: an elementwise op's backward moves bytes too.
  Launches: one forward op per node and one backward op per node with a
  backward; Python-level nodes (`operator.getitem` on a tuple) launch nothing.
The optimizer's step, per parameter (priced on its parameter node, for the local
shard it updates): launches * mesh.op_overhead_s + written bytes /
mesh.mem_bandwidth_bytes_per_s, with the launches and written bytes of
torch.optim's single-tensor step (`profiler.profile.OptimizerCost`: AdamW
launches 10 ops a parameter). Its launches are per tensor, not per byte: a
model of many small parameters (BERT-tiny's 41) spends a millisecond a step
there on a CPU, which the rest of the model does not see.
Recompute of a node: its forward time again plus mesh.recompute_op_overhead_s
per forward launch (the checkpoint runner's host cost per op: `runtime.checkpoint`).
Communication inside a strategy: an input that is Replicate on an axis where
the op is split gets a Partial gradient, which needs an all-reduce over that
axis in backward (Megatron's "f" operator). When the input is a parameter the
runtime does that all-reduce in buckets (`autopar.runtime.grad_sync`), over one
group spanning all those axes, so it pays the bandwidth term in full and only
its share of the latency term (its local bytes' part of a full bucket, at most one:
`bucket_latency_share`);
every group that syncs any gradient also pays one bucket's latency once
(`sync_latency_s`: its last, partly filled bucket), charged by the ILP on the
groups the plan uses (`grad_sync_groups`). So a group holds
B / bucket + 1 >= ceil(B / bucket) latencies, and splitting the gradients over
two groups costs two buckets, as the runtime sends them.
Ring formulas, with n ranks on the axis, (alpha, beta) the axis' numbers for
that collective kind (`MeshAxis.link`; a one-element all-reduce takes the
axis' `scalar_alpha_s` where measured):
  all_reduce      2(n-1)/n * bytes / beta + 2(n-1) alpha   (bytes = local size)
  all_gather      (n-1)/n * bytes / beta + (n-1) alpha     (bytes = gathered size)
  reduce_scatter  (n-1)/n * bytes / beta + (n-1) alpha     (bytes = unreduced full size)
  all_to_all      (n-1)/n * bytes / beta + (n-1) alpha     (bytes = local size)
"""
from __future__ import annotations

import math
from typing import Sequence

from autopar.profiler.types import NodeCost, ParamCost
from autopar.solver.mesh import COLLECTIVE_KINDS, LinkCost, Mesh, MeshAxis
from autopar.solver.spec import Replicate, Strategy

__all__ = ["bucket_latency_share", "bucketed_all_reduce_s", "bucketed_sync_s", "collective_time_s", "compute_time_s", "flat_axis", "forward_time_s",
           "grad_sync_groups", "input_partial_axes", "launches", "optimizer_step_s", "recompute_time_s", "split_factor", "strategy_cost", "sync_latency_s"]


def _ring(kind: str, n: int) -> tuple[float, int]:
    """(bandwidth fraction, latency steps) of the ring algorithm for `kind` on n ranks."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(COLLECTIVE_KINDS)}")
    frac = (n - 1) / n
    return (2 * frac, 2 * (n - 1)) if kind == "all_reduce" else (frac, n - 1)


# An all-reduce of at most this many bytes is of one element (a loss sum, a token count): its latency is
# `MeshAxis.scalar_alpha_s` per step where measured.
SCALAR_BYTES = 8


def collective_time_s(kind: str, nbytes: float, axis: MeshAxis, latency_share: float = 1.0) -> float:
    """Ring time of one collective; `latency_share` < 1 when it rides in a bucket with others."""
    frac, steps = _ring(kind, axis.size)
    if axis.size == 1 or nbytes == 0:
        return 0.0
    alpha, beta = axis.link(kind)
    if kind == "all_reduce" and nbytes <= SCALAR_BYTES and axis.scalar_alpha_s is not None:
        alpha = axis.scalar_alpha_s
    return frac * nbytes / beta + latency_share * steps * alpha


# Gradient-sync bucket size, DDP's default: large enough to amortise latency, small enough to overlap.
# The runtime's GradSync uses this value (imports point downstream), so the price and the run agree.
GRAD_BUCKET_BYTES = 25 * 2**20


def bucket_latency_share(nbytes: float, bucket_bytes: float) -> float:
    """Part of one bucketed all-reduce's latency a gradient of `nbytes` (this rank's, as the runtime
    packs it) pays: its part of a full bucket, and at most one latency, since a gradient larger than
    a bucket is sent alone (`runtime.grad_sync`).

    The runtime packs a group's B gradient bytes into about B / bucket buckets; the shares
    add up to that and the group's last bucket is paid once (`sync_latency_s`)."""
    return min(max(nbytes, 0.0) / bucket_bytes, 1.0)


def sync_latency_s(mesh: Mesh, axes: tuple[int, ...]) -> float:
    """Latency of one bucketed gradient all-reduce over the group spanning `axes` (`flat_axis`), per pass: a step of
    `mesh.microbatches` passes syncs once."""
    axis = flat_axis(mesh, axes)
    if axis.size == 1:
        return 0.0
    _, steps = _ring("all_reduce", axis.size)
    return steps * axis.link("all_reduce")[0] / mesh.microbatches


def split_axes(strategy: Strategy, mesh_ndim: int) -> tuple[int, ...]:
    """Mesh axes on which the strategy's work is divided (some spec is not Replicate there)."""
    specs = strategy.input_specs + strategy.output_specs
    return tuple(a for a in range(mesh_ndim) if any(not isinstance(s.placements[a], Replicate) for s in specs))


def split_factor(strategy: Strategy, mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in split_axes(strategy, len(mesh.shape)))


def compute_time_s(flops: float, nbytes: float, mesh: Mesh, dtype: str = "") -> float:
    """Roofline time of `flops` at the rate of `dtype`'s math (`Mesh.flops_per_s_for`) moving `nbytes`."""
    return max(flops / mesh.flops_per_s_for(dtype), nbytes / mesh.mem_bandwidth_bytes_per_s)


def optimizer_step_s(param: ParamCost, shard: float, mesh: Mesh) -> float:
    """The optimizer's step for `param`'s local part (1/`shard` of its bytes; its launches are per tensor), per pass:
    a step of `mesh.microbatches` passes steps once. A parameter forced onto the host tier (`offload.offloaded_profile`)
    is stepped there."""
    if not param.update_launches or param.host_optimizer_bytes:
        return 0.0
    step_s = param.update_launches * mesh.op_overhead_s + compute_time_s(0.0, param.update_write_bytes / shard, mesh)
    return step_s / mesh.microbatches


def launches(node_cost: NodeCost) -> tuple[int, int]:
    """(forward, backward) ops the node launches: what `mesh.op_overhead_s` is charged for."""
    if node_cost.op.startswith("<built-in"):  # operator.getitem and friends: Python, no dispatch
        return 0, 0
    return 1, int(_has_backward(node_cost))


def _has_backward(node_cost: NodeCost) -> bool:
    return node_cost.requires_grad or node_cost.bwd_flops > 0


def _local_out_bytes(node_cost: NodeCost, strategy: Strategy, mesh: Mesh) -> float:
    total = 0.0
    for i, nbytes in enumerate(node_cost.output_bytes):
        spec = strategy.output_specs[i] if i < len(strategy.output_specs) else None
        total += nbytes / (spec.shard_factor(mesh.shape) if spec is not None else 1)
    return total


def forward_time_s(node_cost: NodeCost, strategy: Strategy, mesh: Mesh) -> float:
    """Forward compute of the node under `strategy`: what recomputing it in backward costs again."""
    fwd_launches, _ = launches(node_cost)
    out_bytes = _local_out_bytes(node_cost, strategy, mesh)
    return (compute_time_s(node_cost.fwd_flops / split_factor(strategy, mesh), out_bytes, mesh, node_cost.dtype)
            + fwd_launches * mesh.op_overhead_s)


def recompute_time_s(node_cost: NodeCost, strategy: Strategy, mesh: Mesh) -> float:
    """What recomputing the node in backward costs: its forward again, plus checkpointing's own host cost
    per op (`Mesh.recompute_op_overhead_s`: saved-tensor hooks and the re-recorded autograd graph)."""
    fwd_launches, _ = launches(node_cost)
    return forward_time_s(node_cost, strategy, mesh) + fwd_launches * mesh.recompute_op_overhead_s


def flat_axis(mesh: Mesh, axes: Sequence[int]) -> MeshAxis:
    """One group spanning `axes` (what the bucketed grad sync reduces over: one collective, not one per axis).

    Its numbers as calibrate() measured that group (`Mesh.groups`), else its ring over the slowest
    link of those axes, kind by kind: the largest alpha and the smallest beta among them."""
    measured = mesh.group(tuple(sorted(axes))) if len(axes) > 1 else None
    if measured is not None:
        return measured
    links = []
    for kind in COLLECTIVE_KINDS:
        pairs = [mesh.axes[a].link(kind) for a in axes]
        links.append(LinkCost(kind, max(al for al, _ in pairs), min(be for _, be in pairs)))
    ar = links[0]
    scalars = [mesh.axes[a].scalar_alpha_s for a in axes]
    return MeshAxis("+".join(mesh.axes[a].name for a in axes), math.prod(mesh.shape[a] for a in axes),
                    ar.alpha_s, ar.beta_bytes_per_s, tuple(links), None if None in scalars else max(scalars))


def strategy_cost(
    node_cost: NodeCost,
    strategy: Strategy,
    out_shapes: Sequence[tuple[int, ...] | None],
    mesh: Mesh,
    in_bytes: Sequence[float] | None = None,
    bucketed: Sequence[bool] | None = None,
) -> tuple[float, float]:
    """(compute_s, comm_s) of one training step of the node under `strategy`.

    out_shapes: global shape per output (kept for callers; local bytes come from the specs).
    in_bytes: global bytes per input spec (for the backward all-reduce of
    Replicate inputs of a split op); without it that term is left out.
    bucketed: per input, False for an activation (its gradient is all-reduced in
    the graph, one collective per axis), True for a parameter's gradient: the bucketed
    sync reduces it over all those axes at once (`flat_axis`), and its local bytes pay
    their part of a bucket's latency (`bucket_latency_share`). Default: all activations.
    """
    factor = split_factor(strategy, mesh)
    out_local_bytes = _local_out_bytes(node_cost, strategy, mesh)
    _, bwd_launches = launches(node_cost)
    compute = forward_time_s(node_cost, strategy, mesh)
    if _has_backward(node_cost):
        compute += (compute_time_s(node_cost.bwd_flops / factor, 2 * out_local_bytes, mesh, node_cost.dtype)
                    + bwd_launches * mesh.op_overhead_s)
    comm = 0.0
    for _, spec, nbytes, in_bucket, partial in _partial_grads(node_cost, strategy, mesh, in_bytes, bucketed):
        local = nbytes / spec.shard_factor(mesh.shape)
        if in_bucket:
            comm += bucketed_all_reduce_s(local, mesh, partial)
        else:
            comm += sum(collective_time_s("all_reduce", local, mesh.axes[a]) for a in partial)
    return compute, comm


def bucketed_all_reduce_s(local_bytes: float, mesh: Mesh, axes: tuple[int, ...]) -> float:
    """A parameter gradient's part of the bucketed sync over the group spanning `axes`: its bandwidth
    term in full, its share of a bucket's latency (`bucket_latency_share`); per pass: a step of
    `mesh.microbatches` passes syncs once."""
    whole_s = collective_time_s("all_reduce", local_bytes, flat_axis(mesh, axes), bucket_latency_share(local_bytes, GRAD_BUCKET_BYTES))
    return whole_s / mesh.microbatches


def bucketed_sync_s(node_cost: NodeCost, strategy: Strategy, mesh: Mesh, in_bytes: Sequence[float],
                    bucketed: Sequence[bool]) -> dict[int, float]:
    """Per input whose gradient goes to the bucketed sync: its part of `strategy_cost`'s comm (what a parameter
    shared by several nodes is charged by each, `problem.SharedSync`)."""
    return {index: bucketed_all_reduce_s(nbytes / spec.shard_factor(mesh.shape), mesh, partial)
            for index, spec, nbytes, in_bucket, partial in _partial_grads(node_cost, strategy, mesh, in_bytes, bucketed)
            if in_bucket}


def grad_sync_groups(node_cost: NodeCost, strategy: Strategy, mesh: Mesh, in_bytes: Sequence[float] | None,
                     bucketed: Sequence[bool] | None) -> frozenset[tuple[int, ...]]:
    """The axis groups over which the bucketed sync all-reduces the node's parameter gradients (see
    `strategy_cost`'s arguments): each group a plan uses pays `sync_latency_s` once."""
    return frozenset(partial for _, _, _, in_bucket, partial in _partial_grads(node_cost, strategy, mesh, in_bytes, bucketed)
                     if in_bucket)


def _partial_grads(node_cost: NodeCost, strategy: Strategy, mesh: Mesh, in_bytes: Sequence[float] | None,
                   bucketed: Sequence[bool] | None) -> list[tuple]:
    """(input index, input spec, global bytes, whether it is a bucketed parameter gradient, axes its gradient is
    partial on) of every input whose gradient needs an all-reduce: Replicate on an axis the node is split on."""
    if in_bytes is None or not _has_backward(node_cost):
        return []
    flags = bucketed if bucketed is not None else [False] * len(in_bytes)
    out = []
    for index, (spec, nbytes, in_bucket) in enumerate(zip(strategy.input_specs, in_bytes, flags)):
        partial = input_partial_axes(node_cost, strategy, len(mesh.shape), index)
        if partial:
            out.append((index, spec, nbytes, in_bucket, partial))
    return out


def input_partial_axes(node_cost: NodeCost, strategy: Strategy, mesh_ndim: int, index: int) -> tuple[int, ...]:
    """Mesh axes on which the gradient of input `index` is a per-rank term: the node is split there and
    the input is Replicate (each rank's backward sees its part of the work)."""
    if not _has_backward(node_cost):
        return ()
    spec = strategy.input_specs[index]
    return tuple(a for a in split_axes(strategy, mesh_ndim) if isinstance(spec.placements[a], Replicate))
