"""What travels along each edge of the graph: resharding steps and gradient all-reduces.

The gradient contract (per mesh axis, the same as `autopar.runtime.collectives`):
the grad of a `Shard(d)` tensor is this rank's chunk of the complete gradient;
the grad of a `Replicate` or `Partial` tensor is the complete gradient.

Every node runs its ATen op on local tensors, so plain autograd gives the local
backward. That backward already honours the contract, except in one case: a
node whose strategy is *sharded* over axis k (some input or output spec is not
Replicate on k) computes, for each input that is Replicate on k, only this
rank's term of that input's gradient. Such an input gets a `grad_all_reduce`
over k (identity forward, all-reduce backward: Megatron's "f"). When the value
reached the input through an all-gather over k, the all-gather becomes
`all_gather_rs` instead (its backward reduce-scatters the terms: one
collective instead of two). For parameters, the all-reduce moves out of the
graph into the runtime's bucketed gradient sync (`ParamSync`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import fx

from autopar.solver.mesh import Mesh
from autopar.solver.reshard import reshard_steps
from autopar.solver.reshard_types import CollectiveStep
from autopar.solver.spec import Partial, Replicate, Spec
from autopar.tracer.nodes import is_differentiable


@dataclass(frozen=True)
class Step:
    """One collective to emit; `reduce_scatter_grad` marks an all-gather whose backward reduce-scatters."""

    step: CollectiveStep
    reduce_scatter_grad: bool = False


@dataclass(frozen=True)
class Edge:
    """The value consumed as tensor argument `index` of `consumer`: its reshard and its gradient all-reduces."""

    producer: str  # node name of the producing value (a getitem for tuple outputs)
    consumer: str
    index: int
    src: Spec
    dst: Spec
    steps: tuple[Step, ...]
    grad_reduce_axes: tuple[int, ...]  # mesh axes whose partial grads must be all-reduced at this use


def sharded_axes(specs: Sequence[Spec | None]) -> frozenset[int]:
    """Mesh axes over which a strategy splits the work: any of its specs is not Replicate there."""
    out: set[int] = set()
    for spec in specs:
        if spec is None:
            continue
        out.update(k for k, p in enumerate(spec.placements) if not isinstance(p, Replicate))
    return frozenset(out)


def plan_steps(src: Spec, dst: Spec, shape: tuple[int, ...], mesh: Mesh, grad_axes: set[int]) -> tuple[tuple[Step, ...], set[int]]:
    """Resharding steps src -> dst, fusing the gradient all-reduce of axis k into an all-gather over k.

    Returns (steps, the axes still needing a grad all-reduce). The fusion is exact:
    after the all-gather over k the value stays Replicate on k, and the later steps
    act on other axes, so they commute with summing the grad terms over k.
    """
    if src == dst:
        return (), set(grad_axes)
    # the solver's search never creates a Partial; R -> P is a local step (one rank keeps the value)
    to_partial = [k for k, (a, b) in enumerate(zip(src.placements, dst.placements)) if isinstance(b, Partial) and not isinstance(a, Partial)]
    via = Spec(tuple(Replicate() if k in to_partial else p for k, p in enumerate(dst.placements)))
    left = set(grad_axes)
    out = []
    for step in reshard_steps(src, via, shape, mesh) + tuple(CollectiveStep("replicate_to_partial", k) for k in to_partial):
        fuse = step.kind == "all_gather" and step.mesh_axis in left
        if fuse:
            left.discard(step.mesh_axis)
        out.append(Step(step, reduce_scatter_grad=fuse))
    return tuple(out), left


def edge_for(producer: fx.Node, consumer: fx.Node, index: int, src: Spec, dst: Spec, consumer_axes: frozenset[int], mesh: Mesh,
             carries_grad: bool = True) -> Edge:
    """`carries_grad`: whether the value can have a gradient at all (a float computed from a parameter or input)."""
    need = {k for k in consumer_axes if isinstance(dst.placements[k], Replicate)} if carries_grad and is_differentiable(producer) else set()
    shape = tuple(producer.meta["val"].shape)
    steps, left = plan_steps(src, dst, shape, mesh, need)
    return Edge(producer.name, consumer.name, index, src, dst, steps, tuple(sorted(left)))
