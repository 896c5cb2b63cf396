"""Lower a traced graph + plan to one rank's distributed fx.GraphModule.

    gm = lower(traced, plan, ProcessMesh((2,)), params=dict(model.named_parameters()))
    print(gm.code)    # local shapes, collectives as named calls with group names

The new graph runs every original ATen op on local tensors, in the original
order, applying the plan in one fixed order per node:
  1. its tensor inputs are resharded from the producer's spec to the spec the
     strategy wants (collective nodes from `autopar.runtime.collectives`, each
     with its conjugate backward), plus the gradient all-reduces `edges.py`
     derives (why they are needed is explained there);
  2. shape arguments are rewritten to local sizes (`shapes.py`) and device
     arguments to the runtime device (the trace ran on `meta`);
  3. random ops are wrapped so their masks follow the Megatron rule (`random.py`).
Mixed precision (`autopar.MixedPrecision`): a parameter the graph was traced in another
dtype than its tensor's (a bf16 graph of float32 masters) is read as its compute copy,
which the module passes in its place (`LoweringInfo.compute_copies`), or, stored as a ZeRO
shard, cast by its first all-gather on the way (gradients reduce-scattered in `reduce_dtype`).
Parameters and buffers are this rank's shards, stored on the GraphModule under
their original FQNs and passed in as its first arguments (named as the trace names
them: `p_<fqn>`, `b_<fqn>`; `LoweringInfo.state_inputs` lists their FQNs), not read
with `get_attr`: fx spells a get_attr as a chain of `nn.Module.__getattr__` calls
(`getattr(self.bert.encoder.layer, "0").attention.self.query.weight`: seven), which
cost BERT-tiny's forward 0.15 ms of 1.5 on one rank. ZeRO parameters hold the
storage shard and are gathered to their use spec in the graph (gradients
reduce-scattered on the way back).
The loss is all-reduced to Replicate (every rank returns the global loss, so no
gradient needs a 1/N), in the background: backward does not wait for the sum
(`runtime.deferred_loss`); other outputs come back in the input convention.
Finally each ZeRO parameter's gather moves next to each of its consumers, to be
re-gathered in backward rather than kept (`zero.py`), and runs of recomputed
nodes become checkpointed regions (`recompute.py`).
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autopar.codegen import random as random_ops
from autopar.codegen.edges import Edge, Step, edge_for, plan_steps, sharded_axes
from autopar.codegen.fused_loss import fuse_cross_entropy_sums
from autopar.codegen.kernel_layouts import lay_out_inputs
from autopar.codegen.python_calls import bind_python_calls
from autopar.codegen.recompute import outline_recompute_regions
from autopar.codegen.schedule import start_collectives_early
from autopar.codegen.shapes import LoweringError, local_block, localize_call
from autopar.codegen.zero import regather_zero_params
from autopar.runtime import collectives as C
from autopar.runtime.batch import check_divisible, fed_spec
from autopar.runtime.deferred_loss import deferred_all_reduce, deferred_mean, start_count
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.plan import Plan
from autopar.solver.regions import layer_key
from autopar.solver.spec import Partial, Replicate, Shard, Spec
from autopar.tracer import TracedGraph, tensor_args
from autopar.tracer.batch_dims import batch_size
from autopar.tracer.nodes import is_tensor_node as _is_tensor_node
from autopar.tracer.nodes import differentiable, grad_carrying, is_differentiable, is_dropout_clone, module_path

log = logging.getLogger(__name__)
aten = torch.ops.aten

InputLayout = Literal["shard", "replicate"]


@dataclass(frozen=True)
class LoweringInfo:
    """What the runtime wrapper needs besides the graph (kept on `gm.meta["autopar"]`)."""

    param_storage: Mapping[str, Spec]  # FQN -> storage spec of the local tensor
    grad_sync_axes: Mapping[str, tuple[int, ...]]  # FQN -> mesh axes its grad is all-reduced over after backward
    buffer_specs: Mapping[str, Spec]
    input_specs: tuple[Spec, ...]  # per user input: the layout each rank feeds (plan-independent: `runtime.batch`)
    data_parallel_axes: tuple[int, ...]  # mesh axes on which the PLAN shards the batch (reports; not the feeding layout)
    aliases: Mapping[str, str] = field(default_factory=dict)  # tied FQN -> the FQN that holds the tensor
    input_layout: str = "shard"  # how ranks feed inputs and get outputs back: their batch slice, or everything
    unsaved: frozenset[str] = frozenset()  # buffers outside the model's state_dict: non-persistent ones, lifted constants
    state_inputs: tuple[str, ...] = ()  # FQNs of the parameters and buffers the graph takes first, in argument order
    # FQN -> dtype of the parameters the graph reads as compute copies of that dtype (mixed precision), not themselves
    compute_copies: Mapping[str, torch.dtype] = field(default_factory=dict)


def lower(
    traced: TracedGraph,
    plan: Plan,
    mesh: ProcessMesh,
    params: Mapping[str, torch.Tensor] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    input_layout: InputLayout = "shard",
    device: torch.device | None = None,
    local: bool = False,
    frozen: frozenset[str] | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> fx.GraphModule:
    """This rank's GraphModule for `plan`. `params`/`buffers`: full tensors by FQN (zeros when omitted,
    for a look at the code only; given, each must hold every tensor the graph reads). local=True:
    they are this rank's blocks already, taken as they are (a `ParallelModule` lowering the same plan
    for inputs of other shapes: the new graph reads the parameters the first one trains). frozen: the FQNs of
    the parameters that take no gradient (default: those the trace recorded with requires_grad=False).
    reduce_dtype: what a ZeRO parameter cast for its gather (mixed precision) has its gradient reduce-scattered in."""
    if tuple(plan.mesh.shape) != tuple(mesh.shape):
        raise LoweringError(f"plan is for mesh {plan.mesh.shape} but the process mesh is {mesh.shape}; solve again for this mesh")
    if input_layout not in ("shard", "replicate"):
        raise LoweringError(f"input_layout={input_layout!r}; use 'shard' (each rank feeds its slice of the batch) or 'replicate'")
    return _Lowerer(traced, plan.on_mesh(), mesh, params, buffers, input_layout, device, local, frozen, reduce_dtype).run()


def _device_of(mesh: ProcessMesh) -> torch.device:
    if mesh.device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_mesh.device_type)


class _Lowerer:
    def __init__(self, traced, plan, mesh, params, buffers, input_layout, device, local, frozen, reduce_dtype):
        self.traced, self.plan, self.mesh = traced, plan, mesh
        self.reduce_dtype = reduce_dtype
        self.compute_copies: dict[str, torch.dtype] = {}  # `LoweringInfo.compute_copies`
        self.casts: dict[fx.Node, torch.dtype] = {}  # a ZeRO shard's read -> the dtype its first gather casts it to
        self.local = local
        self.full_params = params
        self.full_buffers = None if buffers is None else {**traced.constants, **buffers}  # a lifted constant is no buffer of the model
        self.input_layout = input_layout
        self.fed_dims = traced.batch_dim_of()
        self.device = device or _device_of(mesh)
        self.decisions = {d.node: d for d in plan.nodes}
        self.param_decisions = {d.node: d for d in plan.params}
        self.nodes = {n.name: n for n in traced.graph.nodes}
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.env: dict[str, fx.Node] = {}
        self.cache: dict[tuple, fx.Node] = {}
        self.edges: dict[tuple[str, int], Edge] = {}
        self.tied = _tied_groups(params or {})
        if frozen is None:
            self.frozen = traced.frozen_params()  # placeholders of parameters that take no gradient
        else:
            owners = {self.owner(fqn) for fqn in frozen}
            self.frozen = frozenset(ph for ph, fqn in traced.param_fqns.items() if self.owner(fqn) in owners)
        self._targs: dict[str, tuple[fx.Node, ...]] = {}
        self.origin: dict[str, str] = {}  # new node name -> the traced node it implements (for recompute regions)
        self.buffer_attrs: dict[str, fx.Node] = {}  # buffer FQN -> its input node
        self.param_attrs: dict[str, fx.Node] = {}  # parameter owner FQN -> its input node (tied params share one)
        self.param_storage: dict[str, Spec] = {}  # parameter owner FQN -> how its input is stored
        self.fed_inputs: dict[str, fx.Node] = {}  # user input placeholder name -> the tensor the caller feeds
        self.state_fqns: list[str] = []  # FQNs of the graph's parameter and buffer inputs, in order
        self.first_input: fx.Node | None = None  # the placeholder of the first user input

    # ------------------------------------------------------------ specs
    def out_specs(self, node: fx.Node) -> tuple[Spec, ...]:
        d = self.decisions.get(node.name)
        if d is not None:
            return d.strategy.output_specs
        if node.target is operator.getitem:  # tuple element without its own decision: as its producer made it
            return (self.out_specs(node.args[0])[node.args[1]],)
        if node.op == "placeholder" and node.name in self.param_decisions:
            return (self.param_decisions[node.name].use,)
        raise LoweringError(f"the plan has no strategy for node {node.name!r} ({node.format_node()}); the plan does not match this graph")

    def tensor_args(self, node: fx.Node) -> tuple[fx.Node, ...]:
        if node.name not in self._targs:
            self._targs[node.name] = tensor_args(node)
        return self._targs[node.name]

    def in_specs(self, node: fx.Node) -> tuple[Spec, ...]:
        specs = self.decisions[node.name].strategy.input_specs if node.name in self.decisions else ()
        targs = self.tensor_args(node)
        if len(specs) != len(targs):
            raise LoweringError(f"strategy of {node.name!r} has {len(specs)} input specs for {len(targs)} tensor arguments ({node.format_node()})")
        return specs

    def src_spec(self, producer: fx.Node) -> Spec:
        return self.out_specs(producer)[0]

    # ------------------------------------------------------------ analysis
    def analyse_edges(self) -> None:
        self.grad_carrying = grad_carrying(self.traced.graph, set(self.traced.buffer_fqns) | self.frozen, self.tensor_args)
        for node in self.traced.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            ins = self.in_specs(node)
            axes = sharded_axes(ins + self.out_specs(node))
            for i, (a, dst) in enumerate(zip(self.tensor_args(node), ins)):
                self.edges[(node.name, i)] = edge_for(a, node, i, self.src_spec(a), dst, axes, self.plan.mesh,
                                                      a.name in self.grad_carrying)

    def owner(self, fqn: str) -> str:
        return self.tied.get(fqn, fqn)

    def partial_grad_axes(self, e: Edge, uses: Mapping[str, list[Edge]]) -> tuple[set[int], list[tuple[tuple[str, int], set[int]]]]:
        """Axes on which the grad reaching `e.producer` through `e` is a per-rank term, and where those all-reduces sit.

        Besides the edge's own grad all-reduces, a consumer with one gradient-carrying input that
        is not sharded on axis k (a permute/view/cast of a weight; `embedding(weight, arange)`,
        whose index input carries no gradient) passes partial grads on k upstream unchanged: its
        backward is linear in the grad and, all its inputs being Replicate on k, identical on every
        rank of k, so the all-reduce may move above it. This is what lets a weight's DP all-reduce
        leave the graph for the bucketed grad sync although `permute(weight)` is what the matmul consumes.
        """
        axes = set(self.edges[(e.consumer, e.index)].grad_reduce_axes)
        strips = [((e.consumer, e.index), set(axes))]
        c = self.nodes[e.consumer]
        downs = uses.get(c.name, [])
        carrying = [a for a in self.tensor_args(c) if a.name in self.grad_carrying]
        single = c.target is not operator.getitem and len(carrying) == 1 and is_differentiable(c)
        if single and downs and all(u.op != "output" for u in c.users):
            free = set(range(len(self.mesh.shape))) - sharded_axes(self.in_specs(c) + self.out_specs(c))
            below = [self.partial_grad_axes(d, uses) for d in downs]
            sub = free.intersection(*(a for a, _ in below))
            if sub:
                axes |= sub
                strips += [(key, a & sub) for _, deeper in below for key, a in deeper]
        return axes, strips

    def plan_params(self) -> tuple[dict, dict]:
        """Per used parameter: (placeholder -> storage->use steps, owner FQN -> axes left to the bucketed grad sync)."""
        zero_steps, sync_axes = {}, {}
        uses: dict[str, list[Edge]] = {}
        for e in self.edges.values():
            uses.setdefault(e.producer, []).append(e)
        for ph, fqn in self.traced.param_fqns.items():
            d = self.param_decisions.get(ph)
            if d is None:
                raise LoweringError(f"the plan has no parameter decision for {fqn!r} (placeholder {ph}); the plan does not match this model")
            edges = uses.get(ph, [])
            if not edges:
                continue
            # axes on which every use holds a partial grad: reduced once, on the parameter, not per use
            lifted = [self.partial_grad_axes(e, uses) for e in edges]
            # only axes the parameter is used Replicate on: on a sharded axis the edge reshards (e.g. all-gathers)
            # the parameter first, and the all-reduce must stay after that step's backward (on the edge)
            replicated = {k for k, p in enumerate(d.use.placements) if isinstance(p, Replicate)}
            common = set.intersection(*(axes for axes, _ in lifted)) & replicated
            for _, strips in lifted:
                for key, axes in strips:
                    self.edges[key] = _without_axes(self.edges[key], axes & common)
            shape = tuple(self.nodes[ph].meta["val"].shape)
            # ZeRO: the storage->use all-gather over k takes over k's reduction (its backward reduce-scatters)
            steps, left = plan_steps(d.storage, d.use, shape, self.plan.mesh, common) if d.zero else ((), common)
            zero_steps[ph] = steps
            sync_axes[self.owner(fqn)] = tuple(sorted(left))
        return zero_steps, sync_axes

    # ------------------------------------------------------------ emission
    def collective(self, x: fx.Node, step: Step, needs_grad: bool = True) -> fx.Node:
        s, g = step.step, self.mesh.group_name(step.step.mesh_axis)
        if self.mesh.shape[s.mesh_axis] == 1:
            return x  # one rank on the axis: every step is the identity
        cast = self.casts.get(x)
        if cast is not None:  # a float32 ZeRO shard of a lower-precision graph
            if s.kind == "all_gather" and needs_grad:  # cast in the gather's packing, the gradient reduced in reduce_dtype
                extra = (cast, self.reduce_dtype) if step.reduce_scatter_grad else (cast,)
                return self.graph.call_function(C.all_gather_rs if step.reduce_scatter_grad else C.all_gather,
                                                (x, s.src_dim, g, *extra))
            x = self.graph.call_function(aten._to_copy.default, (x,), {"dtype": cast})
        if s.kind == "all_gather" and not needs_grad:  # started early, waited here (`codegen.schedule`)
            started = self.graph.call_function(C.all_gather_start, (x, g))
            return self.graph.call_function(C.wait_all_gather, (started, x, s.src_dim, g))
        if s.kind == "all_gather":
            fn = C.all_gather_rs if step.reduce_scatter_grad else C.all_gather
            return self.graph.call_function(fn, (x, s.src_dim, g))
        if s.kind == "reduce_scatter":
            return self.graph.call_function(C.reduce_scatter, (x, s.dst_dim, g))
        if s.kind == "all_reduce" and not needs_grad:  # started early, waited here (`codegen.schedule`)
            return self.graph.call_function(C.wait, (self.graph.call_function(C.all_reduce_start, (x, g)),))
        if s.kind == "all_reduce":
            return self.graph.call_function(C.all_reduce, (x, g))
        if s.kind == "all_to_all":
            return self.graph.call_function(C.all_to_all, (x, s.src_dim, s.dst_dim, g))
        if s.kind == "slice":
            return self.graph.call_function(C.local_slice, (x, s.dst_dim, g))
        if s.kind == "replicate_to_partial":
            return self.graph.call_function(C.replicate_to_partial, (x, g))
        raise LoweringError(f"no collective lowers resharding step {s}")

    def emit_steps(self, x: fx.Node, steps: tuple[Step, ...], grad_axes: tuple[int, ...], needs_grad: bool = True) -> fx.Node:
        key = (x.name, steps, grad_axes, needs_grad)
        if key in self.cache:
            return self.cache[key]
        out = x
        for step in steps:
            out = self.collective(out, step, needs_grad)
        for k in grad_axes:
            if self.mesh.shape[k] > 1:
                out = self.graph.call_function(C.grad_all_reduce, (out, self.mesh.group_name(k)))
        self.cache[key] = out
        return out

    def edge_value(self, consumer: fx.Node, index: int) -> fx.Node:
        e = self.edges[(consumer.name, index)]
        return self.emit_steps(self.env[e.producer], e.steps, e.grad_reduce_axes, e.producer in self.grad_carrying)

    def reshard(self, x: fx.Node, producer: fx.Node, src: Spec, dst: Spec) -> fx.Node:
        steps, _ = plan_steps(src, dst, tuple(producer.meta["val"].shape), self.plan.mesh, set())
        return self.emit_steps(x, steps, (), producer.name in self.grad_carrying)

    def emit_param(self, node: fx.Node, owner: str, read: fx.Node, steps: tuple[Step, ...]) -> fx.Node:
        """A parameter as its uses read it: its storage resharded to its use spec by `steps`. Traced in another
        dtype than its tensor's (mixed precision), it is read as its compute copy, or cast by its first gather."""
        traced_dtype = node.meta["val"].dtype
        if _get_nested(self.root, owner).dtype == traced_dtype:
            return self.emit_steps(read, steps, ())
        if not steps:
            self.compute_copies[owner] = traced_dtype  # the module passes the copy in the master's place
            return read
        self.casts[read] = traced_dtype
        out = self.emit_steps(read, steps, ())
        return out if out is not read else self.graph.call_function(aten._to_copy.default, (read,), {"dtype": traced_dtype})

    def state_input(self, node: fx.Node, fqn: str, value: torch.Tensor, is_param: bool) -> fx.Node:
        """Store `value` under `fqn` and take it as the graph's next argument, named as the traced placeholder."""
        trains = differentiable(value) and node.name not in self.frozen  # a frozen parameter stays frozen
        _set_nested(self.root, fqn, nn.Parameter(value, requires_grad=trains) if is_param else value, is_param)
        self.state_fqns.append(fqn)
        if self.first_input is None:
            return self.graph.placeholder(node.name)
        with self.graph.inserting_before(self.first_input):  # the state comes first (export puts it first anyway)
            return self.graph.placeholder(node.name)

    def local_tensor(self, fqn: str, node: fx.Node, spec: Spec, full: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        val = node.meta["val"]
        if full is None:
            full = self.traced.constants  # no tensors given: zeros but for the trace's own constants
        elif fqn not in full:
            raise LoweringError(f"the traced model reads {fqn!r}, which the tensors given to lower() do not hold: give "
                                "lower() every parameter and buffer of the model, by each of its names "
                                "(params=dict(model.named_parameters(remove_duplicate=False)), buffers=dict("
                                "model.named_buffers(remove_duplicate=False)))")
        if fqn in full and self.local:
            t, want = full[fqn], spec.local_shape(tuple(val.shape), self.mesh.shape)
            if tuple(t.shape) != tuple(want):
                raise LoweringError(f"{fqn!r} has local shape {tuple(t.shape)} but the plan stores it as {tuple(want)}")
            return t.detach()
        if fqn in full:
            t = full[fqn].detach()
            if tuple(t.shape) != tuple(val.shape):
                raise LoweringError(f"{fqn!r} has shape {tuple(t.shape)} but the traced model has {tuple(val.shape)}")
            if t.is_meta:  # a model built on meta: its shards too, until `to_empty` and a checkpoint fill them
                return torch.empty(spec.local_shape(tuple(t.shape), self.mesh.shape), dtype=t.dtype, device="meta")
            return local_block(t, spec, self.mesh.shape, self.mesh.coordinate).to(self.device, copy=True).contiguous()
        return torch.zeros(spec.local_shape(tuple(val.shape), self.mesh.shape), dtype=val.dtype, device=self.device)

    def run(self) -> fx.GraphModule:
        self.analyse_edges()
        zero_steps, sync_axes = self.plan_params()
        dp_axes = self.data_parallel_axes()
        self.batch = self.global_batch()
        fed_specs = []
        storage, held, buffer_specs = self.param_storage, self.param_attrs, {}
        zero_nodes: list[fx.Node] = []  # input nodes of parameters stored as ZeRO shards
        mutated = set(self.traced.buffer_mutations.values())  # buffers the forward updates
        moved = {self.owner(fqn) for fqn in self.traced.param_mutations.values()}  # frozen parameters it updates
        changed_inputs = set(self.traced.input_mutations.values())  # user inputs it updates in place
        read_owners = {self.owner(self.traced.param_fqns[ph]) for ph in zero_steps}  # parameters some op reads
        for node in self.traced.graph.nodes:
            if node.op == "placeholder":
                if node.name in self.traced.param_fqns:
                    fqn = self.traced.param_fqns[node.name]
                    d = self.param_decisions[node.name]
                    owner = self.owner(fqn)
                    if node.name not in zero_steps:  # no op reads it in this forward (XLNet's seg_embed, read with
                        # token_type_ids only): held where the plan stores it, in parameters() and the state dict as
                        # on one device, its grad None; no gradient sync waits for it. A tied name read elsewhere is held there.
                        if owner not in read_owners:
                            storage[owner] = d.storage
                            held[owner] = self.state_input(node, owner, self.local_tensor(fqn, node, d.storage, self.full_params), True)
                        continue
                    if owner in held:
                        raise LoweringError(f"tied parameters {owner!r} and {fqn!r} are used through two placeholders; not supported")
                    storage[owner] = d.storage
                    held[owner] = self.state_input(node, owner, self.local_tensor(fqn, node, d.storage, self.full_params), True)
                    # ops read a copy of a parameter the forward updates, as of a buffer it updates (below); a
                    # ZeRO gather re-run in backward starts from that copy too, not from the overwritten shard
                    read = self.graph.call_function(aten.clone.default, (held[owner],)) if owner in moved else held[owner]
                    if zero_steps[node.name]:
                        zero_nodes.append(read)
                    self.env[node.name] = self.emit_param(node, owner, read, zero_steps[node.name])
                elif node.name in self.traced.buffer_fqns:
                    fqn = self.traced.buffer_fqns[node.name]
                    spec = self.src_spec(node)
                    buffer_specs[fqn] = spec
                    self.buffer_attrs[fqn] = self.state_input(node, fqn, self.local_tensor(fqn, node, spec, self.full_buffers), False)
                    self.env[node.name] = self.buffer_attrs[fqn]
                    if fqn in mutated:  # ops read a copy: autograd may save the old value (batch norm's backward
                        # takes the running stats), and the buffer is overwritten before backward runs
                        self.env[node.name] = self.graph.call_function(aten.clone.default, (self.buffer_attrs[fqn],))
                else:
                    fed = self.fed_spec(node)
                    fed_specs.append(fed)
                    ph = self.graph.placeholder(node.name)
                    self.first_input = self.first_input or ph
                    self.fed_inputs[node.name] = ph
                    if not isinstance(node.meta.get("val"), torch.Tensor):
                        self.env[node.name] = ph  # a Python number the model takes (`temperature=2.0`)
                        continue
                    read = self.graph.call_function(aten.clone.default, (ph,)) if node.name in changed_inputs else ph
                    self.env[node.name] = self.reshard(read, node, fed, self.src_spec(node))  # a copy read, as a buffer's
            elif node.op == "call_function":
                self.env[node.name] = self.emit_call(node)
            elif node.op == "output":
                self.emit_output()
            else:
                raise LoweringError(f"unexpected {node.op} node in a traced graph: {node.format_node()}")
        aliases = {fqn: owner for fqn, owner in self.tied.items() if fqn != owner and owner in held}
        for fqn, owner in aliases.items():
            _set_nested(self.root, fqn, _get_nested(self.root, owner), True)
        recompute = {d.node for d in self.plan.nodes if d.recompute}
        regather_zero_params(self.graph, self.root, zero_nodes, recompute, self.origin)
        layers = {n.name: layer_key(module_path(n)) for n in self.traced.graph.nodes}
        outline_recompute_regions(self.graph, self.root, recompute, self.origin, layers)
        start_collectives_early(self.graph)
        fuse_cross_entropy_sums(self.graph)
        gm = fx.GraphModule(self.root, self.graph, class_name="ParallelGraph")
        share_tree(gm, self.root)  # GraphModule copies only what get_attr reads: the regions, not the parameters
        bind_python_calls(gm, self.nodes, self.origin)  # last: every pass above reads ATen targets
        unsaved = (frozenset(self.traced.constants) | self.traced.nonpersistent_buffers) & buffer_specs.keys()
        gm.meta["autopar"] = LoweringInfo(storage, sync_axes, buffer_specs, tuple(fed_specs), dp_axes, aliases, self.input_layout,
                                          unsaved, tuple(self.state_fqns), self.compute_copies)
        log.info("codegen: %d nodes, %d collectives", len(gm.graph.nodes), _count_collectives(gm))
        return gm

    def emit_call(self, node: fx.Node) -> fx.Node:
        before = next(iter(reversed(self.graph.nodes)), None)
        if node.target is operator.getitem:
            producer = node.args[0]
            out = self.graph.create_node("call_function", operator.getitem, (self.env[producer.name], node.args[1]), name=node.name)
            if node.name in self.decisions:
                out = self.reshard(out, node, self.out_specs(producer)[node.args[1]], self.src_spec(node))
        else:
            in_specs = self.in_specs(node)
            strategy = self.decisions[node.name].strategy
            # sizes first (on the traced args), then tensors and devices substituted leaf by leaf
            target, args, kwargs = localize_call(node, strategy, self.mesh.shape, self.mesh.coordinate, self.mesh.group_names)
            counter = iter(range(len(in_specs)))
            flat, spec = pytree.tree_flatten((args, kwargs))
            new_flat = []
            for leaf in flat:
                if _is_tensor_node(leaf):
                    new_flat.append(self.edge_value(node, next(counter)))
                elif isinstance(leaf, fx.Node):
                    new_flat.append(self.env[leaf.name])
                elif isinstance(leaf, torch.device):
                    new_flat.append(self.device)
                else:
                    new_flat.append(leaf)
            args, kwargs = pytree.tree_unflatten(new_flat, spec)
            target, kwargs = _as_eager_runs(node, target, kwargs)
            args = lay_out_inputs(self.graph, target, tuple(args))  # a local tensor strided where the kernel needs it not
            target, args, kwargs = random_ops.wrap(target, tuple(args), kwargs, self.out_specs(node), self.mesh)
            out = self.graph.create_node("call_function", target, tuple(args), kwargs, name=node.name)
        new = before.next if before is not None else next(iter(self.graph.nodes))
        while new.op != "root":
            self.origin.setdefault(new.name, node.name)
            new = new.next
        return out

    def fed_spec(self, node: fx.Node) -> Spec:
        """The layout a rank feeds (and gets back): its batch slice, whatever the plan (`autopar.runtime.batch`)."""
        val = node.meta.get("val")
        if self.input_layout == "replicate" or not isinstance(val, torch.Tensor):
            return Spec.replicate(len(self.mesh.shape))
        dim = self.fed_dims[node.name] if node.name in self.fed_dims else self.output_batch_dim(val)
        return fed_spec(dim, len(self.mesh.shape))

    def output_batch_dim(self, val: torch.Tensor) -> int | None:
        return output_batch_dim(val, tuple(self.fed_dims.values()), self.batch)

    def emit_buffer_updates(self) -> None:
        """Write the values a forward computes for its buffers (BatchNorm's running statistics and batch
        count) and frozen parameters (a momentum encoder) back into this rank's tensors, resharded to their
        layout (a parameter's storage: its ZeRO shard if it has one), and the values it gives
        user inputs it changes in place back into the tensors the caller fed, resharded to the layout fed:
        the traced graph is functional, the module is not."""
        placeholder_of = {fqn: name for name, fqn in self.traced.buffer_fqns.items()}
        for name, fqn in self.traced.buffer_mutations.items():
            node, buffer = self.nodes[name], self.nodes[placeholder_of[fqn]]
            value = self.reshard(self.env[name], node, self.src_spec(node), self.src_spec(buffer))
            self.graph.call_function(aten.copy_.default, (self.buffer_attrs[fqn], value))
        for name, fqn in self.traced.param_mutations.items():  # frozen: no optimizer writes them
            node, owner = self.nodes[name], self.owner(fqn)
            value = self.reshard(self.env[name], node, self.src_spec(node), self.param_storage[owner])
            self.graph.call_function(aten.copy_.default, (self.param_attrs[owner], value))
        for name, input_name in self.traced.input_mutations.items():
            node = self.nodes[name]
            value = self.reshard(self.env[name], node, self.src_spec(node), self.fed_spec(self.nodes[input_name]))
            self.graph.call_function(aten.copy_.default, (self.fed_inputs[input_name], value))

    def data_parallel_axes(self) -> tuple[int, ...]:
        """Mesh axes on which the plan shards the first batched input along its batch dim (the DDP convention's axes)."""
        name, dim = next(((n, d) for n, d in self.fed_dims.items() if d is not None), (None, None))
        if name is None:
            return ()
        spec = self.src_spec(self.nodes[name])
        return tuple(k for k, p in enumerate(spec.placements) if p == Shard(dim))

    def global_batch(self) -> int | None:
        """The global batch size (the first batched input's, `tracer.batch_dims`), checked to split over the world
        with layout 'shard'."""
        vals = [self.nodes[n].meta.get("val") for n in self.traced.input_names]
        batch = batch_size(vals, self.traced.input_batch_dims)
        if batch is not None and self.input_layout == "shard":
            check_divisible(batch, math.prod(self.mesh.shape))
        return batch

    def emit_output(self) -> None:
        self.emit_buffer_updates()
        outs = []
        for i, name in enumerate(self.traced.output_names):
            if name is None:
                raise LoweringError(f"user output {i} is a constant, not a graph value; return tensors only")
            node = self.nodes[name]
            if i == self.traced.loss_index:
                outs.append(self.emit_loss(self.env[name], node))
            else:
                outs.append(self.reshard(self.env[name], node, self.src_spec(node), self.fed_spec(node)))
        self.graph.output(tuple(outs))

    def emit_loss(self, x: fx.Node, node: fx.Node) -> fx.Node:
        """The loss, summed over the axes where it is Partial by one all-reduce over a group spanning them,
        which backward does not wait for (`runtime.deferred_loss`): no synchronisation point ends the forward.
        A mean over a global count (sum / count, the count gradient-free, all-reduced over some of those
        axes or replicated) has its count all-reduced by `start_count` instead, which
        `schedule.start_collectives_early` moves to the start of the forward (the solver prices it
        as hidden there: `problem.count_hidden_in_forward`)."""
        src = self.src_spec(node)
        if any(not isinstance(p, (Partial, Replicate)) for p in src.placements):
            return self.reshard(x, node, src, Spec.replicate(len(self.mesh.shape)))  # not a scalar: gathered as usual
        axes = [k for k, p in enumerate(src.placements) if isinstance(p, Partial) and self.mesh.shape[k] > 1]
        if not axes:
            return x
        group = self.mesh.flat_group_name(axes)
        groups = {self.mesh.group_name(k): self.mesh.shape[k] for k in axes}
        divisor = node.args[1] if node.target is aten.div.Tensor and len(node.args) == 2 else None
        count = isinstance(divisor, fx.Node) and divisor.name not in self.grad_carrying  # a count of labels
        mean = _mean_over_count(x, set(groups)) if count else None
        if mean is None:
            return self.graph.call_function(deferred_all_reduce, (x, group))
        total, count, dead, count_groups = mean
        replicas = math.prod(n for g, n in groups.items() if g not in count_groups)  # ranks sharing a count term
        started = self.graph.call_function(start_count, (count, group, replicas))
        out = self.graph.call_function(deferred_mean, (total, started, group))
        for n in dead:  # the division and the count's own all-reduces, now done by start_count and deferred_mean
            self.graph.erase_node(n)
        return out


def output_batch_dim(val: torch.Tensor, input_dims: tuple[int | None, ...], batch: int | None) -> int | None:
    """The dim along which an output comes back cut, as the inputs were fed (`input_dims`: each input's batch dim,
    in order; `batch`: the global batch size): along the first batched input's batch dim where it has the batch's
    size there (a sequence-first model's `(seq, batch, vocab)` logits), else along dim 0 where it has it there
    (its `(batch, classes)` logits), else None (whole). A pipeline stage's inputs are fed as the stage before
    returns them, by this rule (`autopar.pipeline.cut`)."""
    first = next((d for d in input_dims if d is not None), None)
    for dim in dict.fromkeys((first, 0)):
        if dim is not None and val.dim() > dim and int(val.shape[dim]) == batch:
            return dim
    return None


def _as_eager_runs(node: fx.Node, target: Any, kwargs: dict) -> tuple[Any, dict]:
    """Layout ops as eager runs them, whatever layout the kernels that run give their outputs.

    A traced `view` was valid for the strides the trace saw, and export writes `.contiguous()` as a
    copy (`clone`) whenever the traced strides were not already contiguous. Some kernels' output
    layout depends on the backend that runs: SDPA's CPU flash kernel returns its output laid out
    (B, T, H, D), its math backend (B, H, T, D), on the meta device of a trace too. So `view` is
    lowered as `reshape` (the same view where one exists, a copy where the running layout needs one)
    and `clone(memory_format=contiguous_format)` as `contiguous` (no copy when already contiguous,
    which is what the profiler priced: `profile.elided_copies`), except for a graph output, which
    must not alias another tensor. The `clone` export writes for a Dropout that does nothing is
    `contiguous` too: eager returns the input itself, with no copy and no backward node."""
    if target is aten.view.default:
        return aten.reshape.default, kwargs
    if all(u.op != "output" for u in node.users) and (
            is_dropout_clone(node) or (target is aten.clone.default and kwargs.get("memory_format") == torch.contiguous_format)):
        return aten.contiguous.default, {}
    return target, kwargs


def _mean_over_count(x: fx.Node, groups: set[str]) -> tuple[fx.Node, fx.Node, list[fx.Node], set[str]] | None:
    """(sum, local count, nodes to drop, the count's groups) when `x` is div(sum, count) and count is
    the local count all-reduced, without gradient, over some of `groups` (a chain of started
    all-reduces, the sum's Partial axes); else None."""
    if x.op != "call_function" or x.target is not aten.div.Tensor or len(x.users) or len(x.args) != 2:
        return None
    total, c = x.args
    dead, seen = [x], set()
    while isinstance(c, fx.Node) and c.target is C.wait and len(c.users) == 1:
        start = c.args[0]
        if start.target is not C.all_reduce_start or len(start.users) != 1:
            return None
        dead += [c, start]
        seen.add(start.args[1])
        c = start.args[0]
    if not isinstance(total, fx.Node) or not isinstance(c, fx.Node) or not seen <= groups:
        return None
    return total, c, dead, seen


def _without_axes(e: Edge, axes: set[int]) -> Edge:
    return Edge(e.producer, e.consumer, e.index, e.src, e.dst, e.steps, tuple(k for k in e.grad_reduce_axes if k not in axes))


def _tied_groups(full: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """FQN -> the first FQN naming the same tensor (GPT-2's lm_head.weight -> transformer.wte.weight)."""
    first: dict[int, str] = {}
    out = {}
    for fqn, t in full.items():
        out[fqn] = first.setdefault(id(t), fqn)
    return out


def _set_nested(root: nn.Module, fqn: str, value: Any, is_param: bool) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if is_param:
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)


def share_tree(dst: nn.Module, src: nn.Module) -> None:
    """Make `src`'s submodules, parameters and buffers `dst`'s too, under the same names (the objects, not copies)."""
    for name, child in src.named_children():
        dst.add_module(name, child)
    for name, p in src.named_parameters(recurse=False):
        dst.register_parameter(name, p)
    for name, b in src.named_buffers(recurse=False):
        dst.register_buffer(name, b)


def _get_nested(root: nn.Module, fqn: str) -> Any:
    for part in fqn.split("."):
        root = getattr(root, part)
    return root


def _count_collectives(gm: fx.GraphModule) -> int:
    names = set(C.COLLECTIVES.values())
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in names)
