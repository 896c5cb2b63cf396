"""Communication volume of a plan: bytes per device per training step, by collective kind.

    volume = comm_bytes_by_kind(traced, plan)   # (("all_reduce", 1.2e9), ("all_gather", 3.4e8), ...)

Bytes are the size each collective is called on, the number the ring formulas of
`autopar.solver.cost` take (and NCCL's tests report as "size"): the local tensor
for all-reduce and all-to-all, the gathered result for all-gather, the unreduced
input for reduce-scatter. Five sources, as the runtime runs them:

- Resharding between producer and consumer (`reshard.reshard_steps`): forward, and
  the gradient back (Partial read as Replicate) when the tensor needs a gradient.
- Gradients made Partial inside an op: an input that is Replicate on a mesh axis
  where the op is split gets a Partial gradient. An activation's is all-reduced in
  the graph, once per such axis (Megatron's "f"); a parameter's is synced by the
  runtime over all those axes at once: an all-reduce, or a reduce-scatter when the
  parameter is ZeRO-sharded (a view of a parameter, e.g. its transpose, counts as it).
- ZeRO parameter gathers: storage -> use spec before forward and again before backward.
- Collectives inside a node's lowering (`localize.in_node_collectives`: the per-row
  exchanges of a log-softmax over a split vocabulary).
- Local steps (slice, R -> P) and any step over a mesh axis of one rank move nothing and are not counted.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from autopar.gc_pause import gc_paused
from autopar.profiler.graph import analyze
from autopar.solver.cost import split_axes
from autopar.solver.mesh import Mesh
from autopar.solver.plan import Plan
from autopar.solver.reshard import apply_step, reshard_steps, step_bytes
from autopar.solver.spec import Partial, Replicate, Spec
from autopar.solver.strategies import strategy_inputs
from autopar.solver.strategies.localize import in_node_collectives
from autopar.tracer import TracedGraph, output_vals
from autopar.tracer.nodes import differentiable

__all__ = ["KINDS", "comm_bytes_by_kind"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _shape(val: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in val.shape)


def _grad_spec(spec: Spec) -> Spec:
    """The gradient of a Partial value is a whole (replicated) one."""
    return Spec(tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements))


def _add_reshard(total: dict[str, float], src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int, mesh: Mesh,
                 times: int = 1) -> None:
    spec = src
    for step in reshard_steps(src, dst, shape, mesh, itemsize):
        local = step_bytes(step, spec, shape, itemsize, mesh)
        if mesh.shape[step.mesh_axis] == 1:
            pass  # a spec change over an axis of one rank is a local relabelling: nothing leaves the device
        elif step.kind == "all_gather":
            total["all_gather"] += times * local * mesh.shape[step.mesh_axis]
        elif step.kind in total:
            total[step.kind] += times * local
        spec = apply_step(spec, step)


@gc_paused
def comm_bytes_by_kind(traced: TracedGraph, plan: Plan, summed_per_computed: Mapping[str, float] | None = None
                       ) -> tuple[tuple[str, float], ...]:
    """Per-device bytes per training step for each collective kind the plan uses (kinds with 0 bytes left out).
    summed_per_computed: param node -> its gradient's bytes as summed over ranks per byte as computed (mixed
    precision sums a bf16 copy's gradient in float32: 2); 1 where absent."""
    summed_per_computed = summed_per_computed or {}
    mesh = plan.mesh
    facts = analyze(traced)
    needs_grad = facts.requires_grad
    chosen = {d.node: d.strategy for d in plan.nodes}
    zero_params = {p.node for p in plan.params if p.zero}
    total = dict.fromkeys(KINDS, 0.0)
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.name not in chosen:
            continue
        strategy = chosen[node.name]
        for c in in_node_collectives(node, strategy, mesh.shape):
            total[c.kind] += c.nbytes if mesh.shape[c.mesh_axis] > 1 else 0.0
        split = [a for a in split_axes(strategy, len(mesh.shape)) if mesh.shape[a] > 1]
        for a, (producer, k) in enumerate(strategy_inputs(node)):
            val = output_vals(producer)[k]
            if not isinstance(val, torch.Tensor):
                continue
            src, dst = chosen[producer.name].output_specs[k], strategy.input_specs[a]
            shape, itemsize = _shape(val), val.element_size()
            with_grad = needs_grad.get(producer.name, False) and differentiable(val)
            _add_reshard(total, src, dst, shape, itemsize, mesh)
            if with_grad:
                _add_reshard(total, _grad_spec(dst), _grad_spec(src), shape, itemsize, mesh)
            if not (with_grad and needs_grad.get(node.name, False)):
                continue  # no backward through this input: no Partial gradient to reduce
            partial = [ax for ax in split if isinstance(dst.placements[ax], Replicate)]
            if not partial:
                continue
            local = math.prod(shape) * itemsize / dst.shard_factor(mesh.shape)
            owner = _param_owner(traced, facts.base, (producer.name, k))
            if owner is None:
                total["all_reduce"] += local * len(partial)
            else:
                total["reduce_scatter" if owner in zero_params else "all_reduce"] += local * summed_per_computed.get(owner, 1.0)
    for p in plan.params:
        if p.zero:  # gathered before forward use and again before backward (FSDP's re-gather)
            val = traced.node(p.node).meta["val"]
            _add_reshard(total, p.storage, p.use, _shape(val), val.element_size(), mesh, times=2)
    return tuple((kind, nbytes) for kind, nbytes in total.items() if nbytes > 0)


def _param_owner(traced: TracedGraph, base: dict, ref: tuple[str, int]) -> str | None:
    """The parameter placeholder whose storage `ref` is (itself or a view of it), else None."""
    owner = base.get(ref, ref)[0]
    return owner if owner in traced.param_fqns else None

