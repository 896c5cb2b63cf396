"""The solver's plain-data problem: options per (clustered) node, resharding edges, memory budget.

`autopar.solver.ilp` only ever sees a `Problem`, so it can be tested on
hand-built 3-5 node graphs. `build_problem` (below) makes one from
a traced graph, a profile and the strategies (merging followers and tying
repeated layers first, see `cluster.py`); the costs of a tied class are the sums
over its copies, so the ILP node stands for all of them at once.

Units: seconds for times (one training step, forward + backward), bytes per
device for memory.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import fx

from autopar.profiler import storage_facts
from autopar.profiler.memory import optimizer_step_temp_bytes
from autopar.profiler.types import ConcreteProfile
from autopar.solver.cluster import Cluster, Grouping, group, singletons
from autopar.solver.cost import (bucketed_all_reduce_s, bucketed_sync_s, collective_time_s, grad_sync_groups, input_partial_axes, optimizer_step_s,
                                 recompute_time_s, split_axes, split_factor, strategy_cost, sync_latency_s)
from autopar.gc_pause import gc_paused
from autopar.solver.mesh import Mesh
from autopar.solver.offload import TierCost, forced_tier, summed, tier_cost
from autopar.solver.regions import layer_key, region_cuts
from autopar.solver.reshard import reshard_buffer_bytes, reshard_cost
from autopar.solver.spec import Replicate, Shard, Spec, Strategy
from autopar.solver.strategies import strategy_inputs
from autopar.solver.strategies.localize import in_node_collectives
from autopar.tracer import TracedGraph, module_path, output_vals
from autopar.tracer.nodes import differentiable, grad_carrying




@dataclass(frozen=True)
class ZeroOption:
    """Keeping a parameter sharded over its replicated (data-parallel) axes between uses."""

    factor: int  # param, grad and optimizer bytes are divided by this much more
    comm_s: float  # extra per-step comm vs replicated storage (gathers in fwd and bwd; reduce-scatter for all-reduce)
    gathered_bytes: float  # the param gathered to its use spec while its consumers run (a transient)
    update_saving_s: float = 0.0  # the optimizer's step updates only the stored shard: this much less compute
    # its gradient as a consumer's backward makes it, at the use spec, before the reduce-scatter shards it: a
    # transient beside the re-gathered param and the consumer's own gradients (0: a frozen parameter)
    grad_bytes: float = 0.0

    @property
    def backward_bytes(self) -> float:
        """What a consumer's backward step holds of the parameter: re-gathered, and its whole gradient."""
        return self.gathered_bytes + self.grad_bytes


@dataclass(frozen=True)
class Option:
    """One strategy of a node (or of a whole cluster / tied class: sums over its members)."""

    label: str
    compute_s: float = 0.0  # forward + backward compute (a parameter's: the optimizer's step on its local part)
    update_s: float = 0.0  # of compute_s, the optimizer's step (a cluster's sum mixes it with its ops' compute)
    comm_s: float = 0.0  # collectives inside the strategy, forward + backward
    recompute_s: float = 0.0  # forward compute paid again in backward when recomputed
    saved_bytes: float = 0.0  # activations kept for backward (freed by recompute)
    # largest transient while it runs: its scratch, and in backward the gradients of its step beside it (a max,
    # not a sum, across a tied class)
    temp_bytes: float = 0.0
    # what backward holds at this node's step beside what the layer saved before it: its largest output's gradient,
    # the gradients it makes for its activation inputs (a gated MLP's product makes two of its own size) and what
    # its own backward keeps (softmax's output) (a max, too)
    grad_flow_bytes: float = 0.0
    # recomputed, its checkpoint region saves its inputs: those from another layer (another region) that no
    # backward keeps otherwise are held through the step only because it is recomputed
    held_input_bytes: float = 0.0
    param_bytes: float = 0.0  # parameters and buffers under the use spec
    grad_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    zero: ZeroOption | None = None  # None: storage must equal the use spec
    # mesh-axis groups the bucketed sync all-reduces its parameter gradients over: each group a plan
    # uses pays one bucket's latency once (`Problem.sync_latency_s`, `cost.sync_latency_s`)
    sync_groups: frozenset[tuple[int, ...]] = frozenset()
    # a stepped parameter's block on the host tier (`solver.offload`): what it keeps on the host and costs a step
    # under the use spec (1/`zero.factor` of it under ZeRO storage); None: nothing the optimizer steps
    host: TierCost | None = None
    # the host tier of the members the caller put there (`solver.offload.offloaded_profile`): their device state
    # and step are out of the numbers above already; what the tier keeps on and off the device and costs, as `host`
    forced_host: TierCost | None = None

    @property
    def static_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Node:
    name: str
    options: tuple[Option, ...]
    recomputable: bool = False  # placeholders and nodes that save nothing are not
    # Backward rebuilds a recomputed layer's activations all at once (codegen outlines one checkpoint
    # region per run of recomputed ops in a layer), so the largest rebuilt layer is a transient.
    region: str | None = None  # the layer it is rebuilt with; None (hand-built problems): rebuild not priced
    copies: int = 1  # layers a tied class stands for: its saved bytes per layer are saved_bytes / copies

    def __post_init__(self) -> None:
        if not self.options:
            raise ValueError(f"node {self.name!r} has no options; every node needs at least one strategy")


@dataclass(frozen=True)
class Edge:
    """Resharding cost between producer `src` and consumer `dst`.

    Options are grouped into classes (options with the same relevant specs
    cost the same), so `cost_s[src_class[i]][dst_class[j]]` is the cost when
    src takes option i and dst option j. Grouping keeps the edge variables few.
    """

    src: int
    dst: int
    src_class: tuple[int, ...]
    dst_class: tuple[int, ...]
    cost_s: tuple[tuple[float, ...], ...]
    # The forward part of cost_s, paid again when dst is recomputed: codegen emits a node's input
    # reshards inside its checkpoint region, so backward runs their collectives again. None: not priced.
    forward_s: tuple[tuple[float, ...], ...] | None = None
    # Bytes the consumer's backward saves beyond what the producer's option counts: the resharded input
    # (an all-gathered activation or parameter) when dst saves that input and is not recomputed. None: none.
    saved_bytes: tuple[tuple[float, ...], ...] | None = None
    # Seconds src's ZeRO storage saves when dst pays the bucketed all-reduce of src's gradient over the
    # ZeRO axes (dst split there): its reduce-scatter takes that all-reduce over. None: src is no parameter.
    zero_saving_s: tuple[tuple[float, ...], ...] | None = None
    # The producer's shard that `saved_bytes` leaves out of the copy (counted as the producer's saved output):
    # when the producer is recomputed its output is not kept, so a consumer that keeps the copy holds these
    # bytes too. None: none.
    replaced_bytes: tuple[tuple[float, ...], ...] | None = None
    # The most bytes the reshard's buffers hold at once, forward or backward (`reshard.reshard_buffer_bytes`;
    # the largest over the pair's tensors, which reshard one after another): a transient. None: none.
    buffer_bytes: tuple[tuple[float, ...], ...] | None = None
    # A parameter's gradient as the consumer's backward makes it, at the consumer's input spec, where the edge
    # reshards the parameter: beside the consumer's own gradients until the reshard's backward brings it to the
    # parameter's spec (a transient; the gradient the plan keeps is the parameter's `grad_bytes`). None: none.
    grad_bytes: tuple[tuple[float, ...], ...] | None = None
    # The node whose backward step makes the gradient those terms (`grad_bytes`, a ZeRO parameter's `backward_bytes`)
    # price, when not dst: dst a view of the parameter (`t` of a weight, a problem node of its own where nodes are
    # not grouped), which receives the gradient its consumer's step makes. None: dst.
    grad_step: int | None = None
    # A parameter another use made the gradient of first (a tied embedding: the LM head's step runs before the
    # lookup's): the gradient this use adds and autograd's sum of the two, at the parameter's spec, beside that one
    # once the consumer's step (and the reshard's backward) is done; a transient of its own. Stored ZeRO, the
    # sum is of shards the reduce-scatter made: not priced. None: none.
    accumulated_bytes: tuple[tuple[float, ...], ...] | None = None

    @staticmethod
    def dense(src: int, dst: int, cost_s: list[list[float]] | tuple[tuple[float, ...], ...]) -> "Edge":
        """One class per option: for hand-built problems."""
        rows = tuple(tuple(float(c) for c in row) for row in cost_s)
        return Edge(src, dst, tuple(range(len(rows))), tuple(range(len(rows[0]))), rows)

    def cost(self, i: int, j: int) -> float:
        return self.cost_s[self.src_class[i]][self.dst_class[j]]

    def _at(self, table: tuple[tuple[float, ...], ...] | None, i: int, j: int) -> float:
        """An optional per-class-pair table's entry for src option i and dst option j (None: 0)."""
        return table[self.src_class[i]][self.dst_class[j]] if table is not None else 0.0

    def saved(self, i: int, j: int) -> float:
        return self._at(self.saved_bytes, i, j)

    def replaced(self, i: int, j: int) -> float:
        return self._at(self.replaced_bytes, i, j)

    def buffers(self, i: int, j: int) -> float:
        return self._at(self.buffer_bytes, i, j)

    def grads(self, i: int, j: int) -> float:
        return self._at(self.grad_bytes, i, j)

    @property
    def grad_maker(self) -> int:
        """The node whose backward step holds the parameter gradient this edge prices (`grad_step`)."""
        return self.dst if self.grad_step is None else self.grad_step

    def accumulated(self, i: int, j: int) -> float:
        return self._at(self.accumulated_bytes, i, j)

    def forward_cost(self, i: int, j: int) -> float:
        return self._at(self.forward_s, i, j)

    def zero_saving(self, i: int, j: int) -> float:
        return self._at(self.zero_saving_s, i, j)


class RegionCut(NamedTuple):
    """Recomputed both, `second` opens another checkpoint region after `first`'s (kept work between them reads
    first's and feeds second), unless a node of `joins` (on a path from first to second) is recomputed too, which
    carries the region on, or a node of `between` (after first in graph order, before second) opened one already,
    which left first in an earlier region. Nodes are problem node indices of one layer."""
    first: int
    second: int
    joins: tuple[int, ...]
    between: tuple[int, ...]


class SharedSync(NamedTuple):
    """A parameter whose gradient several consumers price as bucketed (tied embeddings: the lookup and the
    output projection). Each consumer's options include the sync of its part, but the sync sends the summed
    gradient once: the step pays the largest consumer's term, not their sum. `terms`: (problem node,
    seconds of that sync in the node's price per option)."""
    param: str
    terms: tuple[tuple[int, tuple[float, ...]], ...]


@dataclass(frozen=True)
class Problem:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    budget_bytes: float | None = None  # per device; None: unconstrained
    # (axes, seconds): latency of one gradient bucket over each group some option syncs over
    sync_latency_s: tuple[tuple[tuple[int, ...], float], ...] = ()
    # (u, v): v's backward keeps u's output (the profiler's saved_refs); recomputing u frees its activations
    # only when v is recomputed too (one checkpoint region): else v keeps them alive
    recompute_with: tuple[tuple[int, int], ...] = ()
    # (u, v): v reads u's output across a layer boundary; recomputed, v is in another checkpoint region than
    # u, which saves u's output as its input: recomputing u then frees nothing, so the ILP never does both
    region_inputs: tuple[tuple[int, int], ...] = ()
    # pairs of one layer's nodes that fall into two checkpoint regions (`regions.region_cuts`), by `second`'s graph order
    region_cuts: tuple[RegionCut, ...] = ()
    # fixed cost of a checkpoint region (`Mesh.recompute_region_s`), paid once per layer with recomputed nodes and
    # once more per split (`region_cuts`), times the layers a tied class stands for (`evaluate.checkpoint_regions`)
    region_s: float = 0.0
    # parameters whose bucketed gradient sync several nodes' prices include: charged once, the largest
    shared_syncs: tuple[SharedSync, ...] = ()
    # The optimizer step's scratch, per byte of a stepped parameter's local block (Adam's: 1 under foreach, the
    # square roots of the second moments; 2 per tensor, the square root and its quotient), held for every
    # parameter at once under foreach (`Mesh.optimizer_foreach`, CUDA's default) or for one at a time (CPU's)
    step_scratch_per_param_byte: float = 0.0
    step_scratch_foreach: bool = False
    # host bytes per rank the host tier may hold (`solver.offload`); None: the tier is not offered, every
    # parameter's optimizer state stays on the device
    host_budget_bytes: float | None = None

    def __post_init__(self) -> None:
        for e in self.edges:
            if e.src == e.dst:
                raise ValueError(f"edge {e.src}->{e.dst} is a self-loop; fold it into the node's option costs")
            if len(e.src_class) != len(self.nodes[e.src].options) or len(e.dst_class) != len(self.nodes[e.dst].options):
                raise ValueError(f"edge {self.nodes[e.src].name}->{self.nodes[e.dst].name}: class maps do not match option counts")

    def num_options(self) -> int:
        return sum(len(n.options) for n in self.nodes)


@dataclass(frozen=True)
class Assignment:
    """One decision per problem node: option index, recompute flag, ZeRO flag, host-tier flag."""

    choice: tuple[int, ...]
    recompute: tuple[bool, ...]
    zero: tuple[bool, ...]
    offload: tuple[bool, ...] = ()  # per node: its parameter on the host tier (empty: none is)

    @staticmethod
    def of(choice: tuple[int, ...] | list[int], recompute=(), zero=(), offload=()) -> "Assignment":
        """Choices by index; `recompute` / `zero` / `offload` are the node indices with the flag set."""
        n = len(choice)
        return Assignment(tuple(choice), tuple(i in set(recompute) for i in range(n)), tuple(i in set(zero) for i in range(n)),
                          tuple(i in set(offload) for i in range(n)) if offload else ())

    def offloaded(self, v: int) -> bool:
        """Whether node v's parameter is on the host tier."""
        return bool(self.offload) and self.offload[v]


# ---------------------------------------------------------------- building a Problem from a traced graph
@dataclass(frozen=True)
class BuiltProblem:
    """A Problem plus what is needed to map its assignment back onto the graph."""

    problem: Problem
    grouping: Grouping
    strategies: Mapping[str, tuple[Strategy, ...]]
    storage: Mapping[tuple[str, int], Spec]  # (param node, strategy index) -> ZeRO storage spec, where one exists
    num_graph_nodes: int
    # param node -> bytes of its gradient as the ranks sum it per byte as computed (2 for a bf16 copy's summed in
    # float32: mixed precision); 1 where absent
    summed_per_computed: Mapping[str, float] = field(default_factory=dict)

    def member_strategy(self, node: str, option: int) -> int:
        """Strategy index of graph node `node` when its problem node (class) takes `option`."""
        return grouping_choice(self.grouping.clusters[self.grouping.cluster_of[node]], node, option)


def _ints(shape) -> tuple[int, ...]:
    return tuple(int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in shape)


def _zero(spec: Spec, shape: tuple[int, ...], local_bytes: float, mesh: Mesh,
          summed_bytes: float | None = None, has_grad: bool = False) -> tuple[Spec, ZeroOption] | None:
    """ZeRO storage for a param used as `spec`: sharded over every replicated axis (one tensor dim).

    Its price, per step and axis: a gather before forward use and again before backward
    (codegen re-gathers rather than keeping it), and a reduce-scatter of the gradient, each
    its own collective. What it saves, the bucketed all-reduce of the gradient, is on the edges
    to the consumers that pay it (`Edge.zero_saving_s`): only a consumer split over those axes
    gets a partial gradient there (otherwise codegen slices the gradient in backward, and the
    reduce-scatter priced here is not run: an overestimate). `local_bytes`: the parameter as its uses read it
    (gathered in the compute dtype under mixed precision); `summed_bytes`: its gradient as reduce-scattered
    (default: local_bytes); `has_grad`: backward makes its gradient (as its uses read it) before the reduce-scatter.
    """
    axes = zero_axes(spec, mesh)
    factor = math.prod(mesh.shape[a] for a in axes)
    if factor <= 1:
        return None
    local = spec.local_shape(shape, mesh.shape)
    dim = next((d for d, n in enumerate(local) if n % factor == 0), None)
    if dim is None:
        return None
    storage = Spec(tuple(Shard(dim) if a in axes else p for a, p in enumerate(spec.placements)))
    comm_s, gathered, summed = 0.0, local_bytes, local_bytes if summed_bytes is None else summed_bytes
    for a in reversed(axes):  # innermost gather first: each step gathers a bigger piece
        ax = mesh.axes[a]
        comm_s += 2 * collective_time_s("all_gather", gathered, ax) + collective_time_s("reduce_scatter", summed, ax)
        gathered /= mesh.shape[a]
        summed /= mesh.shape[a]
    return storage, ZeroOption(factor, comm_s, local_bytes, grad_bytes=local_bytes if has_grad else 0.0)


def zero_axes(spec: Spec, mesh: Mesh) -> tuple[int, ...]:
    """The mesh axes ZeRO shards a parameter used as `spec` over: those it is replicated on (more than one rank)."""
    return tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Replicate) and mesh.shape[a] > 1)


class _Arc(NamedTuple):
    """One kind of producer -> consumer input between two classes (per option: the specs at either end)."""

    src: tuple[Spec, ...]  # the producer's output spec, per src option
    dst: tuple[Spec, ...]  # the consumer's input spec, per dst option
    shape: tuple[int, ...]
    itemsize: int
    floating: bool
    kept: bool  # the consumer's backward saves this input (or reads it through views that do)
    persistent: bool  # the input is a parameter or buffer (or a view of one): alive all step whatever is saved
    # a parameter's gradient: per src option (ZeRO axes, local bytes) or None, per dst option its partial axes
    zero: tuple | None
    # a gradient the consumer's price sends to the bucketed sync through a producer that is not the parameter
    # itself: per src option the axes the producer splits, per dst option (partial axes, local bytes). None: none
    lift: tuple | None = None
    learned: bool = False  # a trained parameter's value (or a view of one): the consumer's backward makes its gradient
    # another use of the parameter made its gradient first (`_later_uses`): the consumer's is summed into that one
    accumulated: bool = False


def _param_root(node, params: Mapping[str, object], costs: Mapping[str, object],
                inputs: Callable[[fx.Node], tuple[tuple[fx.Node, int], ...]] = strategy_inputs) -> str | None:
    """The parameter whose gradient `node`'s gradient flows into through ops with one gradient-carrying
    input (t, view, cast, `embedding(weight, arange)`...), or None. Codegen lifts the all-reduce of such a
    gradient out of the graph into the bucketed grad sync (`codegen.lower.partial_grad_axes`), which
    the pricing follows."""
    while node is not None:
        if node.name in params:
            return node.name
        if node.op != "call_function" or node.target is operator.getitem:
            return None
        ins = [p for p, _ in inputs(node) if costs[p.name].requires_grad]
        if len(ins) != 1:
            return None
        node = ins[0]
    return None


def in_node_comm_s(node, strategy: Strategy, mesh: Mesh) -> tuple[float, float]:
    """(step, forward) time of the collectives `node`'s lowering runs inside the node under `strategy`
    (statistics exchanged by vocabulary-parallel log-softmax and batch-split batch norm); the
    forward part is paid again when the node is recomputed."""
    times = [(collective_time_s(c.kind, c.nbytes, mesh.axes[c.mesh_axis]), c.forward)
             for c in in_node_collectives(node, strategy, mesh.shape)]
    return sum(t for t, _ in times), sum(t for t, fwd in times if fwd)


class _Pricer:
    """Option of one graph node under one strategy, cached by everything that determines it."""

    def __init__(self, traced: TracedGraph, profile: ConcreteProfile, mesh: Mesh, strategies):
        self.traced, self.mesh, self.strategies = traced, mesh, strategies
        self.nodes = {n.name: n for n in traced.graph.nodes}
        self.fed_dims = traced.batch_dim_of()
        self.costs = profile.nodes
        self.facts = storage_facts(traced, profile)  # which node owns the storage each tensor views
        self.params = {p.node: p for p in profile.params.values()}
        self.storage: dict[tuple[str, int], Spec] = {}
        self._cache: dict[tuple, Option] = {}
        self._nodes: dict[str, tuple] = {}
        self._producers: dict[str, tuple[tuple[fx.Node, int], ...]] = {}  # `strategy_inputs`, asked per option

    def inputs(self, node: fx.Node) -> tuple[tuple[fx.Node, int], ...]:
        """`strategy_inputs(node)`, found once (a build asks it of a node per option and per gradient chain)."""
        producers = self._producers.get(node.name)
        if producers is None:
            producers = self._producers[node.name] = strategy_inputs(node)
        return producers

    def param_root(self, node: fx.Node) -> str | None:
        return _param_root(node, self.params, self.costs, self.inputs)

    def views_param(self, node: fx.Node) -> bool:
        """Whether `node` is a view of a parameter (through views: `t`, `permute`, `view` of a weight): the gradient
        its backward receives is the parameter's own, which the parameter's terms price (its `grad_bytes`, or as a
        transient the edges' `grad_bytes` and its ZeRO `backward_bytes`), so the view carries none of its own."""
        return node.op == "call_function" and node.name not in self.params and self.is_view(node) \
            and self.param_root(node) is not None

    def grad_maker(self, node: fx.Node) -> fx.Node:
        """The node whose backward step makes the gradient of `node`'s inputs: `node`, or for a view of a parameter
        the one op past its views that reads it (the views' backward passes that op's gradient on as it is)."""
        while self.views_param(node):
            users = [u for u in node.users if u.op == "call_function" and u.name in self.strategies]
            if len(users) != 1:
                break
            node = users[0]
        return node

    def option(self, name: str, k: int) -> Option:
        role, cost, outs, ins, param, base = self._node(name)
        strat = self.strategies[name][k]
        key = (base, strat)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._price(role, cost, strat, outs, ins, param, base[-1])
        total_s, forward_s = in_node_comm_s(self.nodes[name], strat, self.mesh)
        if total_s:  # depends on the node's dim arguments, so not cached by shapes
            hit = replace(hit, comm_s=hit.comm_s + total_s, recompute_s=hit.recompute_s + forward_s)
        if hit.zero is not None:  # the storage spec is per parameter, the price is shared
            self.storage[name, k] = _zero(strat.output_specs[0], outs[0], hit.param_bytes, self.mesh)[0]
        return hit

    def _node(self, name: str) -> tuple:
        """What the price of `name` depends on besides its strategy (computed once per node)."""
        info = self._nodes.get(name)
        if info is None:
            node, cost = self.nodes[name], self.costs[name]
            outs = tuple(None if v is None else _ints(v.shape) for v in output_vals(node))
            ins: tuple = ()
            if node.op == "call_function":
                producers = self.inputs(node)
                # an input with no gradient (token ids, masks, buffers) needs no backward all-reduce
                roots = [self.param_root(p) for p, _ in producers]
                # a parameter's gradient is summed in the reduce dtype (mixed precision), the others as computed
                in_bytes = tuple(_tensor_bytes(output_vals(p)[i]) * (_summed_per_computed(self.params[r]) if r else 1.0)
                                 if self.costs[p.name].requires_grad else 0.0 for (p, i), r in zip(producers, roots))
                bucketed = tuple(r is not None for r in roots)
                held = tuple(_tensor_bytes(output_vals(p)[i]) if self._region_input(p, i, node) else 0.0 for p, i in producers)
                ins = (in_bytes, bucketed, held)
            param = self.params.get(name)
            role = "param" if param else "buffer" if name in self.traced.buffer_fqns else node.op
            if role == "placeholder":
                ins = self._fed(node)
            base = (role, cost.op, cost.fwd_flops, cost.bwd_flops, cost.output_bytes, cost.saved_outputs,
                    cost.extra_saved_bytes, cost.temp_bytes, cost.requires_grad, cost.value_bytes, cost.grad_input_bytes,
                    cost.self_saved_bytes, cost.dtype, outs, ins,
                    param and (param.param_bytes, param.grad_bytes, param.optimizer_bytes, param.host_optimizer_bytes),
                    self.views_param(node))
            info = self._nodes[name] = (role, cost, outs, ins, param, base)
        return info

    def param_syncs(self, name: str, k: int) -> dict[str, float]:
        """Per parameter whose gradient node `name` sends to the bucketed sync under its strategy k: the seconds of
        that sync its option's price includes (`cost.bucketed_sync_s`)."""
        role, cost, _, ins, _, _ = self._node(name)
        if role != "call_function":
            return {}
        in_bytes, bucketed, _ = ins
        producers = self.inputs(self.nodes[name])
        out: dict[str, float] = {}
        for index, seconds in bucketed_sync_s(cost, self.strategies[name][k], self.mesh, in_bytes, bucketed).items():
            root = self.param_root(producers[index][0])
            out[root] = out.get(root, 0.0) + seconds
        return out

    def is_view(self, node: fx.Node) -> bool:
        """Every output of `node` aliases an input (a view, or a copy the profiler priced as one)."""
        return all(self.facts.aliases.get(node.name, (False,)))

    def saves(self, consumer: fx.Node, ref: tuple[str, int]) -> bool:
        """Whether `consumer`'s backward keeps storage `ref`, or, for a view, the backward of an op reading
        it through views: codegen reshards a view's input before the view, so what is saved is the resharded copy."""
        if ref in self.costs[consumer.name].saved_refs:
            return True
        return self.is_view(consumer) and any(self.saves(user, ref) for user in consumer.users if user.op == "call_function")

    def _region_input(self, producer: fx.Node, index: int, consumer: fx.Node) -> bool:
        """Whether output `index` of `producer` (or the storage it views) is held only by the checkpoint
        region of a recomputed `consumer`: made in another layer (region) and kept by no backward."""
        if self.is_view(consumer):
            return False  # a view: codegen takes it into the region of the op that reads it
        name, index = self.facts.base.get((producer.name, index), (producer.name, index))
        source = self.nodes[name]
        saved = self.costs[name].saved_outputs
        return (source.op == "call_function" and not (index < len(saved) and saved[index])
                and layer_key(module_path(source)) != layer_key(module_path(consumer)))

    def _fed(self, node) -> tuple:
        """(global shape, itemsize, batch dim) of a user input as fed: each rank its slice along the input's batch
        dim, Shard(dim) on every mesh axis (`input_layout="shard"`, `runtime.batch`); () when it is fed whole."""
        vals = output_vals(node)  # none for a Python number the model takes (`temperature=2.0`)
        val, dim = (vals[0] if vals else None), self.fed_dims.get(node.name)
        if not isinstance(val, torch.Tensor) or dim is None or _ints(val.shape)[dim] % self.mesh.num_devices:
            return ()
        return (_ints(val.shape), val.element_size(), dim)

    def _price(self, role, cost, strat: Strategy, outs, ins, param, views_param: bool) -> Option:
        mesh = self.mesh
        if role in ("param", "buffer", "placeholder", "get_attr"):
            if not strat.output_specs:  # a Python number the model takes (`temperature=2.0`): nothing to place
                return Option(str(strat))
            spec = strat.output_specs[0]
            shard = spec.shard_factor(mesh.shape)
            if role == "param":
                found = _zero(spec, outs[0], param.compute_bytes / shard, mesh, param.summed_bytes / shard, param.grad_bytes > 0)
                update_s = optimizer_step_s(param, shard, mesh)
                zero = None
                if found:
                    zero = replace(found[1], update_saving_s=update_s - optimizer_step_s(param, shard * found[1].factor, mesh))
                return Option(str(spec), compute_s=update_s, update_s=update_s, param_bytes=param.param_bytes / shard,
                              grad_bytes=param.grad_bytes / shard, optimizer_bytes=param.optimizer_bytes / shard, zero=zero,
                              host=tier_cost(param, shard, mesh) if param.optimizer_bytes else None,
                              forced_host=forced_tier(param, shard, mesh))
            if role == "buffer":
                return Option(str(spec), param_bytes=sum(cost.output_bytes) / shard)
            saved = sum(b for b, s in zip(cost.output_bytes, cost.saved_outputs) if s) / shard
            comm = 0.0
            if ins:  # resharding the fed slices to the chosen spec: forward only (inputs get no gradient)
                shape, itemsize, dim = ins
                comm = reshard_cost(Spec((Shard(dim),) * len(mesh.shape)), spec, shape, itemsize, mesh, with_backward=False)
            return Option(str(spec), comm_s=comm, saved_bytes=saved)
        in_bytes, bucketed, held = ins
        compute_s, comm_s = strategy_cost(cost, strat, outs, mesh, in_bytes, bucketed)
        held_bytes = sum(b / spec.shard_factor(mesh.shape) for b, spec in zip(held, strat.input_specs) if b)
        shards = [s.shard_factor(mesh.shape) for s in strat.output_specs] or [1]
        saved = sum(b / shards[min(i, len(shards) - 1)] for i, (b, s) in enumerate(zip(cost.output_bytes, cost.saved_outputs)) if s)
        saved += cost.extra_saved_bytes / shards[0]
        grads = 0.0
        if cost.requires_grad and not views_param:  # the gradient arriving, and those made for inputs that are not parameters (theirs are grads)
            grads = max((b / shards[min(i, len(shards) - 1)] for i, b in enumerate(cost.value_bytes)), default=0.0)
            grads += sum(b / spec.shard_factor(mesh.shape)
                         for b, spec, param in zip(cost.grad_input_bytes, strat.input_specs, bucketed) if b and not param)
        # Backward's step through the node holds its gradients beside its scratch and the kept activations (the
        # loss's step, first of all: the logits' gradients beside the saved log-softmax; GPT-2 small on 4 ranks,
        # three 196 MiB tensors at once), less what its consumers kept of its outputs: their steps, which made
        # its gradient, came first and freed it (unless its own backward keeps it). In a rebuilt layer, where the
        # rebuild rows count what was rebuilt before it, it holds what its own backward kept too: `grad_flow_bytes`.
        own = cost.self_saved_bytes / shards[0]
        temp = cost.temp_bytes / split_factor(strat, mesh) + max(0.0, grads - (saved - own))
        flow = grads + own if grads else 0.0
        return Option(str(strat), compute_s=compute_s, comm_s=comm_s, recompute_s=recompute_time_s(cost, strat, mesh),
                      sync_groups=grad_sync_groups(cost, strat, mesh, in_bytes, bucketed),
                      saved_bytes=saved, temp_bytes=temp, grad_flow_bytes=flow, held_input_bytes=held_bytes)


def _summed_per_computed(param) -> float:
    """Bytes of a parameter's gradient as summed over ranks per byte of it as computed (2 for a bf16 copy's gradient
    summed in float32; 1 without mixed precision)."""
    return param.summed_bytes / param.compute_bytes if param.compute_bytes and param.grad_bytes else 1.0


def _master_share(profile: ConcreteProfile) -> float:
    """Of the bytes held for the stepped parameters, the masters' (what the optimizer's step reads): 1 unless
    mixed precision keeps compute copies beside them."""
    held = sum(p.param_bytes for p in profile.params.values() if p.optimizer_bytes)
    return sum(p.param_bytes - p.copy_bytes for p in profile.params.values() if p.optimizer_bytes) / held if held else 1.0


def _tensor_bytes(val) -> float:
    return float(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0.0


def _sum(options: list[Option], label: str) -> Option:
    zeros = [o.zero for o in options if o.zero is not None]
    zero = None
    if zeros:  # the parameter member of a cluster (its views have none)
        zero = ZeroOption(zeros[0].factor, sum(z.comm_s for z in zeros), max(z.gathered_bytes for z in zeros),
                          sum(z.update_saving_s for z in zeros), max(z.grad_bytes for z in zeros))
    hosts = [o.host for o in options if o.host is not None]
    forced = [o.forced_host for o in options if o.forced_host is not None]
    return Option(
        label,
        compute_s=sum(o.compute_s for o in options), update_s=sum(o.update_s for o in options), comm_s=sum(o.comm_s for o in options),
        recompute_s=sum(o.recompute_s for o in options), saved_bytes=sum(o.saved_bytes for o in options),
        temp_bytes=max(o.temp_bytes for o in options), grad_flow_bytes=max(o.grad_flow_bytes for o in options),
        held_input_bytes=sum(o.held_input_bytes for o in options),
        param_bytes=sum(o.param_bytes for o in options),
        grad_bytes=sum(o.grad_bytes for o in options), optimizer_bytes=sum(o.optimizer_bytes for o in options), zero=zero,
        sync_groups=frozenset().union(*(o.sync_groups for o in options)), host=summed(hosts) if hosts else None,
        forced_host=summed(forced) if forced else None,
    )


@gc_paused
def count_hidden_in_forward(traced: TracedGraph) -> set[tuple[str, int]]:
    """(node, input index) of a loss's gradient-free divisor: a mean's global token count. Codegen starts
    its all-reduce at the start of the forward (`runtime.deferred_loss.start_count`), where it runs
    behind the forward's compute, and backward reads it long after: its reshard is priced free."""
    if traced.loss_index is None or traced.output_names[traced.loss_index] is None:
        return set()
    loss = traced.node(traced.output_names[traced.loss_index])
    if loss.target is not torch.ops.aten.div.Tensor or len(loss.args) != 2 or not isinstance(loss.args[1], fx.Node):
        return set()
    if loss.args[1].name in grad_carrying(traced.graph, set(traced.buffer_fqns) | traced.frozen_params()):
        return set()  # a divisor with a gradient is an input of the loss like any other
    return {(loss.name, 1)}


def build_problem(
    traced: TracedGraph,
    profile: ConcreteProfile,
    mesh: Mesh,
    strategies: Mapping[str, tuple[Strategy, ...]],
    budget_bytes: float | None,
    grouped: bool = True,
    per_layer: bool = False,
    host_budget_bytes: float | None = None,
) -> BuiltProblem:
    """grouped=False keeps one problem node per graph node (for pricing arbitrary per-node plans); per_layer ties
    repeated blocks in runs of layers that may decide recompute and ZeRO apart (`cluster.group`); host_budget_bytes:
    the host tier offered with that many host bytes per rank (`Problem.host_budget_bytes`)."""
    grouping = group(traced, strategies, per_layer) if grouped else singletons(traced, strategies)
    pricer = _Pricer(traced, profile, mesh, strategies)
    clusters = grouping.clusters

    def cluster_option(c: int, i: int) -> Option:
        cl = clusters[c]
        return _sum([pricer.option(m, k) for m, k in zip(cl.members, cl.choices[i])], str(strategies[cl.leader][cl.choices[i][0]]))

    class_opts = []
    for members in grouping.classes:
        n_opts = len(clusters[members[0]].choices)
        label = lambda i: str(strategies[clusters[members[0]].leader][i])  # noqa: E731
        first = [cluster_option(members[0], i) for i in range(n_opts)]
        if len(members) > 1 and first == [cluster_option(members[-1], i) for i in range(n_opts)]:
            # tied copies price alike (the first and the last copy checked: the ones whose neighbours differ):
            # the class is the first one's sum taken as many times, not each copy priced (flat in depth)
            class_opts.append([_sum([o] * len(members), label(i)) for i, o in enumerate(first)])
            _copy_storage(pricer, [clusters[c] for c in members])
        else:
            class_opts.append([_sum([cluster_option(c, i) for c in members], label(i)) for i in range(n_opts)])
    shared, saved_by = _shared_syncs(traced, strategies, pricer, grouping)

    def zero_terms(p: fx.Node, node: fx.Node, index: int, u: int, v: int) -> tuple | None:
        """For an arc from a parameter's cluster (through views) into `node`'s input `index`: per src option, the
        parameter's (ZeRO axes, local bytes of its gradient as summed) or None (no ZeRO option), and per dst option
        the axes on which `node` gets a partial gradient there. None for any other arc. What `Edge.zero_saving_s`
        is priced from: the bucketed all-reduce the consumer pays, of the gradient in the reduce dtype (under
        mixed precision not the bytes held, which count the float32 master and its bf16 copy)."""
        root = pricer.param_root(p)
        if root is None or grouping.cluster_of[root] != u or saved_by.get(root, node.name) != node.name:
            return None
        src = []
        for i in range(len(clusters[u].choices)):
            k = grouping_choice(clusters[u], root, i)
            spec = strategies[root][k].output_specs[0]
            summed = pricer.params[root].summed_bytes / spec.shard_factor(mesh.shape)
            src.append((zero_axes(spec, mesh), summed) if pricer.option(root, k).zero is not None else None)
        cost = pricer.costs[node.name]
        dst = tuple(input_partial_axes(cost, strategies[node.name][grouping_choice(clusters[v], node.name, j)], len(mesh.shape), index)
                    for j in range(len(clusters[v].choices)))
        return tuple(src), dst

    def lift_terms(p: fx.Node, val: Any, node: fx.Node, index: int, u: int, v: int) -> tuple | None:
        """For an arc whose producer passes a parameter's gradient on (`_param_root`) without being that parameter:
        per src option the axes the producer splits, per dst option the consumer's (partial axes, local bytes) on
        that input. The consumer's option priced that gradient's all-reduce as bucketed, which codegen does only on
        axes the producer does not split (`codegen.lower.partial_grad_axes` lifts it above the producer only
        there); `_lift_correction` prices the rest as the in-graph all-reduces codegen emits. (Lifting through a
        chain of several such producers needs each one unsplit; only the nearest is priced.)"""
        if p.name in pricer.params or not pricer.costs[p.name].requires_grad or not isinstance(val, torch.Tensor) \
                or pricer.param_root(p) is None:
            return None
        nbytes = _tensor_bytes(val)
        ndim = len(mesh.shape)
        src = tuple(frozenset(split_axes(strategies[p.name][grouping_choice(clusters[u], p.name, i)], ndim))
                    for i in range(len(clusters[u].choices)))
        cost = pricer.costs[node.name]
        dst = []
        for j in range(len(clusters[v].choices)):
            strat = strategies[node.name][grouping_choice(clusters[v], node.name, j)]
            dst.append((input_partial_axes(cost, strat, ndim, index), nbytes / strat.input_specs[index].shard_factor(mesh.shape)))
        return src, tuple(dst)

    arcs: dict[tuple[int, int, _Arc], int] = {}  # (src class, dst class, arc) -> how many (copies of tied layers)
    grad_steps: dict[int, int] = {}  # dst class -> the class whose step makes its inputs' gradients (`Edge.grad_step`)
    later = _later_uses(traced, pricer)
    free = count_hidden_in_forward(traced)
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.name not in strategies:
            continue
        v = grouping.cluster_of[node.name]
        maker = grouping.class_of[grouping.cluster_of[pricer.grad_maker(node).name]]
        if maker != grouping.class_of[v]:
            grad_steps[grouping.class_of[v]] = maker
        for a, (p, k) in enumerate(pricer.inputs(node)):
            u = grouping.cluster_of[p.name]
            if u == v or (node.name, a) in free:
                continue  # a follower and its producer: consistent by construction; or sent with the loss
            val = output_vals(p)[k]
            base = pricer.facts.base.get((p.name, k), (p.name, k))
            kept = pricer.saves(node, base)
            persistent = base[0] in traced.param_fqns or base[0] in traced.buffer_fqns
            learned = base[0] in pricer.params and pricer.params[base[0]].grad_bytes > 0 and differentiable(val)
            src = tuple(strategies[p.name][grouping_choice(clusters[u], p.name, i)].output_specs[k] for i in range(len(clusters[u].choices)))
            dst = tuple(strategies[node.name][grouping_choice(clusters[v], node.name, j)].input_specs[a] for j in range(len(clusters[v].choices)))
            arc = _Arc(src, dst, _ints(val.shape), val.element_size(), differentiable(val), kept, persistent, zero_terms(p, node, a, u, v),
                       lift_terms(p, val, node, a, u, v), learned, learned and (node.name, pricer.param_root(p)) in later)
            key = (grouping.class_of[u], grouping.class_of[v], arc)
            arcs[key] = arcs.get(key, 0) + 1
    pair_arcs: dict[tuple[int, int], list[tuple[_Arc, int]]] = {}
    for (a_cls, b_cls, arc), mult in arcs.items():
        pair_arcs.setdefault((a_cls, b_cls), []).append((arc, mult))
    edges = []
    for (a_cls, b_cls), items in pair_arcs.items():
        def price(i: int, j: int, with_backward: bool = True) -> float:
            return sum(m * (reshard_cost(arc.src[i], arc.dst[j], arc.shape, arc.itemsize, mesh, with_backward=arc.floating and with_backward)
                            + (_lift_correction(arc, i, j, mesh) if with_backward else 0.0))
                       for arc, m in items)

        def saved(i: int, j: int) -> float:
            """What the consumer saves of its resharded inputs beyond the producer's shard (when larger): the whole
            resharded copy when the input is a parameter, whose own shard stays alive anyway (measured: gpt2 with
            weights stored split and gathered into data-parallel matmuls saves the full weights)."""
            return sum(m * max(0.0, math.prod(arc.shape) * arc.itemsize
                                   * (1 / arc.dst[j].shard_factor(mesh.shape) - (0 if arc.persistent else 1 / arc.src[i].shard_factor(mesh.shape))))
                       for arc, m in items if arc.kept and arc.src[i] != arc.dst[j])

        def replaced(i: int, j: int) -> float:
            """The part of the consumer's resharded copy `saved` leaves out: the producer's shard, when smaller."""
            return sum(m * math.prod(arc.shape) * arc.itemsize
                       * min(1 / arc.dst[j].shard_factor(mesh.shape), 1 / arc.src[i].shard_factor(mesh.shape))
                       for arc, m in items if arc.kept and not arc.persistent and arc.src[i] != arc.dst[j])

        def buffers(i: int, j: int) -> float:
            """The largest of the pair's reshards' buffers (`reshard_buffer_bytes`): the reshards run one at a time."""
            return max((reshard_buffer_bytes(arc.src[i], arc.dst[j], arc.shape, arc.itemsize, mesh, arc.floating)
                        for arc, _ in items if arc.src[i] != arc.dst[j]), default=0.0)

        def grads(i: int, j: int) -> float:
            """The gradients the consumer makes for the parameters the pair reshards, at its input specs: one step
            makes those of its own inputs together (each arc once: the copies of a tied pair are other layers' steps)."""
            return sum(math.prod(arc.shape) * arc.itemsize / arc.dst[j].shard_factor(mesh.shape)
                       for arc, _ in items if arc.learned and arc.src[i] != arc.dst[j])

        def accumulated(i: int) -> float:
            """For a parameter another use made the gradient of first (a tied embedding's lookup, whose step follows
            the LM head's): this use's gradient at the parameter's spec and autograd's sum of the two, beside that one
            (measured: GPT-2 with a vocabulary-sized tied embedding holds three whole gradients after the lookup's step)."""
            return sum(2 * math.prod(arc.shape) * arc.itemsize / arc.src[i].shard_factor(mesh.shape)
                       for arc, _ in items if arc.accumulated)

        def zero_saving(i: int, j: int) -> float:
            """The bucketed all-reduce the consumer pays for the parameter's gradient over its ZeRO axes, which
            the ZeRO reduce-scatter takes over: only when the consumer is split on all of them."""
            total = 0.0
            for arc, m in items:
                if arc.zero is None or arc.zero[0][i] is None:
                    continue
                axes, local_bytes = arc.zero[0][i]
                if set(axes) <= set(arc.zero[1][j]):
                    total += m * bucketed_all_reduce_s(local_bytes, mesh, axes)
            return total

        if a_cls == b_cls:  # consecutive copies of a tied block: both ends take the same option
            class_opts[a_cls] = [replace(o, comm_s=o.comm_s + price(i, i), recompute_s=o.recompute_s + price(i, i, False),
                                         temp_bytes=max(o.temp_bytes, buffers(i, i)))
                                 for i, o in enumerate(class_opts[a_cls])]
            continue
        # options alike on every arc share a class; the ZeRO terms tell apart options with equal specs (a dst
        # split on other axes gets its partial gradient elsewhere)
        src_keys = [tuple((arc.src[i], arc.zero and arc.zero[0][i], arc.lift and arc.lift[0][i]) for arc, _ in items)
                    for i in range(len(class_opts[a_cls]))]
        dst_keys = [tuple((arc.dst[j], arc.zero and arc.zero[1][j], arc.lift and arc.lift[1][j]) for arc, _ in items)
                    for j in range(len(class_opts[b_cls]))]
        src_ids, dst_ids = _classes(src_keys), _classes(dst_keys)
        first_src = [src_ids.index(c) for c in range(max(src_ids) + 1)]
        first_dst = [dst_ids.index(c) for c in range(max(dst_ids) + 1)]
        cost = tuple(tuple(price(i, j) for j in first_dst) for i in first_src)
        forward = tuple(tuple(price(i, j, False) for j in first_dst) for i in first_src)
        kept = tuple(tuple(saved(i, j) for j in first_dst) for i in first_src)
        zero = tuple(tuple(zero_saving(i, j) for j in first_dst) for i in first_src)
        held = tuple(tuple(replaced(i, j) for j in first_dst) for i in first_src)
        buffer = tuple(tuple(buffers(i, j) for j in first_dst) for i in first_src)
        grad = tuple(tuple(grads(i, j) for j in first_dst) for i in first_src)
        summed = tuple(tuple(accumulated(i) for _ in first_dst) for i in first_src)
        edges.append(Edge(a_cls, b_cls, tuple(src_ids), tuple(dst_ids), cost, forward,
                          kept if any(b for row in kept for b in row) else None,
                          zero if any(t for row in zero for t in row) else None,
                          held if any(b for row in held for b in row) else None,
                          buffer if any(b for row in buffer for b in row) else None,
                          grad if any(b for row in grad for b in row) else None, grad_steps.get(b_cls),
                          summed if any(b for row in summed for b in row) else None))
    nodes = []
    for cls, members in enumerate(grouping.classes):
        leader = pricer.nodes[clusters[members[0]].leader]
        # a parameter's layer is its FQN's: the ILP counts a ZeRO parameter as gathered while its layer is rebuilt
        path = traced.param_fqns.get(leader.name) or module_path(leader)
        nodes.append(Node(leader.name, tuple(class_opts[cls]), recomputable=leader.op == "call_function",
                          region=layer_key(path), copies=len(members)))
    groups = sorted(frozenset().union(*(o.sync_groups for n in nodes for o in n.options)))
    # a consumer whose backward keeps a producer's output (the profiler's saved_refs) must be recomputed with it
    cls = {name: grouping.class_of[c] for name, c in grouping.cluster_of.items()}
    together = {(cls[ref], cls[c.name]) for c in profile.nodes.values() if c.name in cls
                for ref, _ in c.saved_refs if ref in cls and cls[ref] != cls[c.name]}
    facts = pricer.facts
    sources = ((n, pricer.nodes[facts.base.get(ref, ref)[0]]) for n in traced.graph.nodes
               if n.op == "call_function" and not pricer.is_view(n) for ref in facts.arg_refs[n.name])
    crossing = {(cls[p.name], cls[n.name]) for n, p in sources
                if p.op == "call_function" and p.name in cls and n.name in cls and cls[p.name] != cls[n.name]
                and layer_key(module_path(p)) != layer_key(module_path(n))}
    # the step reads the masters only, not the compute copies a stepped parameter's bytes include (mixed precision)
    step_scratch = optimizer_step_temp_bytes(profile.optimizer, [1.0], foreach=mesh.optimizer_foreach) * _master_share(profile)
    problem = Problem(tuple(nodes), tuple(edges), budget_bytes, tuple((g, sync_latency_s(mesh, g)) for g in groups),
                      tuple(sorted(together)), tuple(sorted(crossing)), _cuts(traced, nodes, cls, together), mesh.recompute_region_s,
                      shared, step_scratch, mesh.optimizer_foreach, host_budget_bytes)
    wire = {p.node: _summed_per_computed(p) for p in profile.params.values() if _summed_per_computed(p) != 1.0}
    return BuiltProblem(problem, grouping, strategies, dict(pricer.storage), len(grouping.cluster_of), wire)


def _later_uses(traced: TracedGraph, pricer: _Pricer) -> set[tuple[str, str]]:
    """(node, parameter) for each use of a parameter read by several ops (directly or through its views) but the
    last in graph order: backward runs that last use's step first, which makes the gradient the others' steps add
    theirs to (autograd sums them before the parameter's gradient is set)."""
    uses: dict[str, list[str]] = {}  # parameter -> the ops making its gradient, in graph order
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.name not in pricer.strategies or pricer.views_param(node):
            continue
        for p, _ in pricer.inputs(node):
            if p.name in pricer.params or pricer.views_param(p):
                names = uses.setdefault(pricer.param_root(p), [])
                if node.name not in names:
                    names.append(node.name)
    return {(name, param) for param, names in uses.items() for name in names[:-1]}


def _lift_correction(arc: _Arc, i: int, j: int, mesh: Mesh) -> float:
    """Seconds to add to the consumer's bucketed price of a gradient (see `lift_terms` in `build_problem`): on the
    axes the producer splits, the in-graph collective codegen emits instead of the bucketed sync: the
    reduce-scatter that is the backward of the edge's all-gather where the producer's output is sharded there
    (`all_gather_rs`), else an all-reduce (the producer's output is partial or whole there)."""
    if arc.lift is None:
        return 0.0
    split, (partial, local_bytes) = arc.lift[0][i], arc.lift[1][j]
    kept = tuple(a for a in partial if a in split)
    if not kept:
        return 0.0
    lifted = tuple(a for a in partial if a not in split)
    bucketed = bucketed_all_reduce_s(local_bytes, mesh, lifted) if lifted else 0.0
    in_graph = sum(collective_time_s("reduce_scatter" if isinstance(arc.src[i].placements[a], Shard) else "all_reduce",
                                     local_bytes, mesh.axes[a]) for a in kept)
    return in_graph + bucketed - bucketed_all_reduce_s(local_bytes, mesh, partial)


def grouping_choice(cluster: Cluster, node: str, option: int) -> int:
    return cluster.choices[option][cluster.members.index(node)]


def _copy_storage(pricer: _Pricer, copies: list[Cluster]) -> None:
    """The ZeRO storage specs of the first copy's parameters for the same parameters of the other copies (tied
    copies have the same members in the same order, of the same shapes and strategies)."""
    stored = {(m, k): spec for (m, k), spec in pricer.storage.items() if m in copies[0].members}
    for copy in copies[1:]:
        for (m, k), spec in stored.items():
            pricer.storage[copy.members[copies[0].members.index(m)], k] = spec


def _shared_syncs(traced: TracedGraph, strategies, pricer: _Pricer, grouping: Grouping
                  ) -> tuple[tuple[SharedSync, ...], dict[str, str]]:
    """`Problem.shared_syncs`: a parameter whose gradient more than one node's price sends to the bucketed sync,
    with each such node's part per option of its class (codegen sums the uses' gradients before the sync); and
    per such parameter its first such node, the one whose edge carries its ZeRO saving (saved once, as paid)."""
    readers: dict[str, int] = {}  # parameter -> nodes whose inputs lead to it: only one, and nothing is shared
    for node in traced.graph.nodes:
        if node.op == "call_function" and node.name in strategies:
            for root in {pricer.param_root(p) for p, _ in pricer.inputs(node)} - {None}:
                readers[root] = readers.get(root, 0) + 1
    terms: dict[str, list[tuple[int, tuple[float, ...]]]] = {}
    first: dict[str, str] = {}
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.name not in strategies:
            continue
        if all(readers.get(pricer.param_root(p), 0) < 2 for p, _ in pricer.inputs(node)):
            continue
        cluster = grouping.clusters[grouping.cluster_of[node.name]]
        per_option = [pricer.param_syncs(node.name, grouping_choice(cluster, node.name, i)) for i in range(len(cluster.choices))]
        for root in set().union(*per_option):
            seconds = tuple(syncs.get(root, 0.0) for syncs in per_option)
            if any(seconds):
                terms.setdefault(root, []).append((grouping.class_of[grouping.cluster_of[node.name]], seconds))
                first.setdefault(root, node.name)
    shared = tuple(SharedSync(root, tuple(t)) for root, t in terms.items() if len(t) > 1)
    return shared, {s.param: first[s.param] for s in shared}


def _cuts(traced: TracedGraph, nodes: list[Node], cls: Mapping[str, int], together: set[tuple[int, int]]
          ) -> tuple[RegionCut, ...]:
    """`Problem.region_cuts`, per layer over the classes the ILP may recompute there (those that save something,
    or keep another's output): each class's traced nodes in the layer it is priced for (a tied class, its leader's).
    The runs are found over the graph from the layer's first such node to its last, other layers' nodes included:
    a layer need not be contiguous (GPT-2's top level holds the position ids and the loss)."""
    ops = [n for n in traced.graph.nodes if n.op == "call_function"]
    layer = {n.name: layer_key(module_path(n)) for n in ops}
    keepers = {v for _, v in together}
    units: dict[str, dict[int, list[int]]] = {}  # layer -> class -> positions in `ops` of its nodes there
    for i, n in enumerate(ops):
        c = cls.get(n.name)
        if c is not None and nodes[c].recomputable and nodes[c].region == layer[n.name] and (
                c in keepers or any(o.saved_bytes > 0 for o in nodes[c].options)):
            units.setdefault(layer[n.name], {}).setdefault(c, []).append(i)
    cuts = []
    for by_class in units.values():
        order = list(by_class)
        first = min(i for positions in by_class.values() for i in positions)
        last = max(i for positions in by_class.values() for i in positions)
        named = [[ops[i].name for i in by_class[c]] for c in order]
        reach = _reachable_units(ops[first:last + 1], named)
        for i, j in sorted(region_cuts(ops[first:last + 1], named, layer), key=lambda pair: (pair[1], pair[0])):
            on_path = tuple(order[m] for m in range(i + 1, j) if m in reach[i] and j in reach[m])
            cuts.append(RegionCut(order[i], order[j], on_path, tuple(order[i + 1:j])))
    return tuple(cuts)


def _reachable_units(span: list[fx.Node], units: list[list[str]]) -> list[set[int]]:
    """Per unit, the other units some node of which reads it, directly or through other nodes of `span`."""
    unit_of = {name: k for k, names in enumerate(units) for name in names}
    inside = set(span)
    reach = []
    for k, names in enumerate(units):
        seen: set[fx.Node] = set()
        stack = [n for n in span if n.name in names]
        while stack:
            for user in stack.pop().users:
                if user in inside and user not in seen:
                    seen.add(user)
                    stack.append(user)
        reach.append({unit_of[n.name] for n in seen if n.name in unit_of} - {k})
    return reach


def _classes(keys: list) -> list[int]:
    """Dense ids for equal keys, in first-seen order."""
    ids: dict = {}
    return [ids.setdefault(k, len(ids)) for k in keys]
