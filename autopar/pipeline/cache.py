"""What the pipeline search computes once per model and reuses for every pp degree, stage mesh and device count.

    cache = SearchCache(lambda m: trace_at(m))
    for devices in (64, 512, 1024):
        plan = solve_pipeline(cache, global_batch=1536, num_devices=devices, hardware="h100-ib")

A search traces the model at each micro-batch count it tries, cuts each trace into its units (the parts
between two cut points) and solves each unit and stage on a stage mesh. None of that depends on the pp
degree or on how many devices there are, only on the micro-batch's size and the stage mesh, so a cache
passed to several searches keeps:
- one trace per micro-batch count (`trace_at(m)`: the model at global_batch / m rows), its layers and its
  units (one cut at every cut point);
- one profile per graph structure (`structure_key`: the middle units and stages of a transformer share one);
- one plan per structure, stage mesh, budget, optimizer and time limit, renamed onto each graph of that
  structure (`rename_plan`);
- each micro-batch count's unit prices per stage mesh and budget.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Sequence

import torch

from autopar.errors import InfeasibleError
from autopar.pipeline.cost import StageCost, stage_cost
from autopar.pipeline.deadline import NO_LIMIT, Deadline
from autopar.pipeline.cut import Layers, StageGraph, cut, find_layers
from autopar.profiler import profile
from autopar.profiler.types import GraphProfile
from autopar.solver import solve
from autopar.solver.mesh import Mesh
from autopar.solver.plan import ParamDecision, Plan
from autopar.solver.plan_io import with_fingerprint
from autopar.tracer import TracedGraph


# ---------------------------------------------------------------- structure: solve once, rename onto each copy
def structure_key(traced: TracedGraph) -> str:
    """The graph up to its names: ops, shapes and wiring (node references by position), which inputs are parameters
    or buffers (by position: a placeholder's target is its name, `transformer.h.3`'s in layer 3), how inputs are fed."""
    index: dict[str, int] = {}
    h = hashlib.sha256()
    for i, node in enumerate(traced.graph.nodes):
        index[node.name] = i
        val = node.meta.get("val")
        shape = (tuple(val.shape), str(val.dtype)) if hasattr(val, "shape") else type(val).__name__
        args = _positional(node.args, index), _positional(node.kwargs, index)
        what = (node.name in traced.param_fqns, node.name in traced.buffer_fqns) if node.op == "placeholder" else str(node.target)
        h.update(repr((node.op, what, shape, args)).encode())
    h.update(repr((traced.input_batch_dims, traced.loss_index, len(traced.output_names))).encode())
    return h.hexdigest()


def _positional(value, index: dict[str, int]):
    if hasattr(value, "name") and value.name in index:
        return ("node", index[value.name])
    if isinstance(value, (list, tuple)):
        return tuple(_positional(v, index) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _positional(v, index)) for k, v in value.items()))
    return repr(value)


def rename_plan(plan: Plan, source: TracedGraph, target: TracedGraph) -> Plan:
    """`plan`, made for `source`, for `target` of the same structure (`structure_key`): node i of one is node i of
    the other, and each parameter the one its placeholder stands for."""
    names = dict(zip((n.name for n in source.graph.nodes), (n.name for n in target.graph.nodes)))
    nodes = tuple(replace(d, node=names[d.node]) for d in plan.nodes)
    params = tuple(ParamDecision(target.param_fqns[names[p.node]], names[p.node], p.use, p.storage, p.layout)
                   for p in plan.params)
    return with_fingerprint(replace(plan, nodes=nodes, params=params), target, plan.mesh, plan.fingerprint.budget_bytes)


@dataclass(frozen=True)
class _Structure:
    source: TracedGraph  # the first graph of this structure seen: plans are made for it and renamed
    profile: GraphProfile


class StageSolver:
    """`solve` on stage graphs: one profile per structure, one plan per structure, mesh, budget and solve options.
    Under mixed precision, `masters` and `reduce_dtype` are `profile`'s (`MixedPrecision.masters`, its reduce dtype)."""

    def __init__(self, optimizer: str = "adamw", time_limit_s: float = 30.0,
                 masters: Mapping[str, torch.dtype] | None = None, reduce_dtype: torch.dtype | None = None):
        self.optimizer, self.time_limit_s = optimizer, time_limit_s
        self.masters, self.reduce_dtype = dict(masters or {}), reduce_dtype
        self._keys: dict[int, tuple[TracedGraph, str]] = {}  # id(graph) -> (the graph, kept alive; its key)
        self._structures: dict[tuple[str, str], _Structure] = {}
        self._plans: dict[tuple, Plan | InfeasibleError] = {}
        self.solves = 0
        self.profiles = 0
        self.deadline = NO_LIMIT  # checked before each new profile and solve (`SearchCache.limited`)

    def key(self, traced: TracedGraph) -> str:
        found = self._keys.get(id(traced))
        if found is None or found[0] is not traced:
            found = self._keys[id(traced)] = (traced, structure_key(traced))
        return found[1]

    def __call__(self, traced: TracedGraph, mesh: Mesh, budget_bytes: float) -> Plan:
        structure = (self.key(traced), self.optimizer)
        if structure not in self._structures:
            self.deadline.check()
            self.profiles += 1
            self._structures[structure] = _Structure(traced, profile(traced, optimizer=self.optimizer, masters=self.masters,
                                                                     reduce_dtype=self.reduce_dtype))
        source = self._structures[structure]
        key = (structure, mesh, round(budget_bytes / 2**20), self.time_limit_s)
        if key not in self._plans:
            self.deadline.check()
            self.solves += 1
            try:
                self._plans[key] = solve(source.source, source.profile, mesh, memory_budget_bytes=budget_bytes,
                                         time_limit_s=self.time_limit_s)
            except InfeasibleError as err:
                self._plans[key] = err
        found = self._plans[key]
        if isinstance(found, InfeasibleError):
            raise found
        return found if source.source is traced else rename_plan(found, source.source, traced)


# ---------------------------------------------------------------- traces, layers, units
def unit_bounds(layers: Layers) -> list[int]:
    """The op positions where units start, and the end: units are the spans between consecutive cut points."""
    return [0, *layers.cut_points(), layers.num_ops]


def unit_costs(units: Sequence[StageGraph], mesh: Mesh, budget_bytes: float, solver: StageSolver) -> list[StageCost]:
    """Each unit's price alone on `mesh` (its sends those of its own boundary, whole: a unit's estimate does not
    know the cut of the value it sends)."""
    out = []
    for unit in units:
        cost = stage_cost(solver(unit.traced, mesh, budget_bytes), unit, None)
        if unit.sent:  # (the last unit sends nothing)
            sent = sum(unit.traced.node(v).meta["val"].numel() * unit.traced.node(v).meta["val"].element_size()
                       for v in unit.sent)
            cost = replace(cost, send_bytes=sent / mesh.num_devices)
        out.append(cost)
    return out


class SearchCache:
    """Traces, layers, units, profiles, plans and unit prices of one model, kept across pipeline searches (for one
    global batch: `trace_at(m)` traces micro-batches of global_batch / m rows). A model traced under a mixed-precision
    policy (`api.traced_model`) is priced with its masters: `masters=policy.masters(model)`,
    `reduce_dtype=policy.reduce_dtype`."""

    def __init__(self, trace_at: Callable[[int], TracedGraph], optimizer: str = "adamw", time_limit_s: float = 30.0,
                 masters: Mapping[str, torch.dtype] | None = None, reduce_dtype: torch.dtype | None = None):
        self.trace_at = trace_at
        self.solver = StageSolver(optimizer, time_limit_s, masters, reduce_dtype)
        self._traces: dict[int, TracedGraph] = {}
        self._layers: dict[int, Layers] = {}
        self._units: dict[int, tuple[StageGraph, ...]] = {}
        self._unit_costs: dict[tuple, list[StageCost] | InfeasibleError] = {}
        self.deadline = NO_LIMIT

    @property
    def traces(self) -> int:
        return len(self._traces)

    @contextmanager
    def limited(self, deadline: Deadline) -> Iterator[None]:
        """Within the block, a new trace, profile or solve past `deadline` raises `SearchTimeUp`; what is cached
        is still answered."""
        self.deadline = self.solver.deadline = deadline
        try:
            yield
        finally:
            self.deadline = self.solver.deadline = NO_LIMIT

    def traced(self, microbatches: int) -> TracedGraph:
        if microbatches not in self._traces:
            self.deadline.check()
            self._traces[microbatches] = self.trace_at(microbatches)
        return self._traces[microbatches]

    def layers(self, microbatches: int) -> Layers:
        if microbatches not in self._layers:
            self._layers[microbatches] = find_layers(self.traced(microbatches))
        return self._layers[microbatches]

    def units(self, microbatches: int) -> tuple[StageGraph, ...]:
        """The trace cut at every cut point: its units in graph order."""
        if microbatches not in self._units:
            layers = self.layers(microbatches)
            self._units[microbatches] = cut(self.traced(microbatches), tuple(unit_bounds(layers)[1:-1]), layers)
        return self._units[microbatches]

    def unit_costs(self, microbatches: int, mesh: Mesh, budget_bytes: float) -> list[StageCost]:
        """`unit_costs` of the trace's units; raises the solver's `InfeasibleError` when a unit alone does not fit."""
        key = (microbatches, mesh, round(budget_bytes / 2**20), self.solver.optimizer, self.solver.time_limit_s)
        if key not in self._unit_costs:
            try:
                self._unit_costs[key] = unit_costs(self.units(microbatches), mesh, budget_bytes, self.solver)
            except InfeasibleError as err:
                self._unit_costs[key] = err
        found = self._unit_costs[key]
        if isinstance(found, InfeasibleError):
            raise found
        return found
