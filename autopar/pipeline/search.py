"""The pipeline search: stages, cuts, micro-batches and schedule around the solver's intra-stage plans.

    plan = solve_pipeline(lambda m: trace_at(m), global_batch=64, num_devices=64, hardware="h100-ib")

The structure is Alpa's and Mist's (arXiv 2201.12023, 2503.19050): an outer search over the number
of stages, the stage mesh and the micro-batch count, whose inner call is the intra-stage solve
(`autopar.solver.solve`, a black box here). It runs in two rounds:

1. Estimate. The graph between two cut points (a layer, the embeddings before the first layer, the
   head and loss after the last) is a unit; each unit of a distinct structure is solved alone on the
   stage mesh at the micro-batch's size (a transformer has three: embeddings, a layer, head and loss).
   A stage's price is the sum of its units' (`cost.StageCost`), the cuts are balanced by a dynamic
   program (the slowest stage as fast as it can be, each stage's memory with its micro-batches in
   flight within the budget), and every schedule is priced (`cost.price`).
2. Solve. The best few estimates are solved for real: each stage's own part of the graph, with the
   budget less what its other micro-batches in flight hold, again until it fits. Stages of the same
   structure (the middle stages of a transformer) are solved once and the plan renamed onto each.

A `SearchCache` (`pipeline.cache`) holds the traces, units, profiles and plans: passed to several searches
(pp degrees, device counts) it makes each only once per micro-batch size, structure and stage mesh.
`price_config` prices one configuration given by hand (pp, stage mesh, micro-batches, schedule) the same way.

Where the mesh spans nodes (`Topology`), tensor-parallel and data-parallel axes stay inside a node
as long as the stage does, and a boundary between stages on different nodes sends over the slower link.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from autopar.errors import AutoparError, InfeasibleError
from autopar.pipeline.cache import SearchCache, unit_bounds
from autopar.pipeline.cost import StageCost, in_flight, price, stage_cost
from autopar.pipeline.cut import CutError, StageGraph, cut
from autopar.pipeline.deadline import Deadline, SearchTimeUp
from autopar.pipeline.loss import LossError, split_loss
from autopar.pipeline.plan import SCHEDULES, PipelinePlan, StagePlan, schedule_problem, with_pp
from autopar.solver.mesh import PRESETS, Mesh, MeshAxis, default_axis_names
from autopar.tracer import TracedGraph

log = logging.getLogger(__name__)


class PipelineSearchError(AutoparError):
    """No pipeline plan: the model cannot be cut (the reason), or no configuration fits the budget."""


@dataclass(frozen=True)
class Topology:
    """Devices in nodes: a fast link inside a node, a slower one between nodes."""

    intra: MeshAxis  # inside a node (NVLink)
    inter: MeshAxis  # between nodes (InfiniBand)
    gpus_per_node: int
    base: Mesh  # the device's compute and memory numbers

    @staticmethod
    def of(hardware: str | Mesh, gpus_per_node: int = 8) -> "Topology":
        """A preset or mesh's links: its last axis inside a node, its first between nodes (one axis: both)."""
        mesh = PRESETS[hardware] if isinstance(hardware, str) else hardware
        return Topology(mesh.axes[-1], mesh.axes[0], gpus_per_node, mesh)

    def stage_mesh(self, shape: tuple[int, ...], microbatches: int = 1) -> Mesh:
        """A stage's mesh, ranks in row-major order from the innermost axis: an axis stays on the fast link while
        the ranks it spans (its size times the sizes inside it) fit in a node. Its plans are priced per micro-batch
        with the gradient sync and optimizer step once for `microbatches` of them (`Mesh.microbatches`): a plan
        that gathers a weight in every micro-batch's forward to save the once-a-step sync pays it M times."""
        axes, span = [], 1
        names = default_axis_names(len(shape))
        for name, size in reversed(list(zip(names, shape))):
            span *= size
            link = self.intra if span <= self.gpus_per_node else self.inter
            axes.append(replace(link, name=name, size=size, per_kind=()))
        return replace(self.base, axes=tuple(reversed(axes)), groups=(), microbatches=microbatches)

    def boundary_links(self, stage_size: int, num_stages: int, pp: int) -> list[MeshAxis]:
        """The link each boundary between consecutive stages crosses (stage s on pp rank s % pp, ranks of pp rank
        r from r * stage_size)."""
        def node(s: int) -> int:
            return (s % pp) * stage_size // self.gpus_per_node
        return [self.intra if node(s) == node(s + 1) and stage_size < self.gpus_per_node else self.inter
                for s in range(num_stages - 1)]


@dataclass(frozen=True)
class Config:
    pp: int
    stage_shape: tuple[int, ...]
    microbatches: int
    virtual: int = 1


# ---------------------------------------------------------------- round 1: estimates from units
def _sum(costs: Sequence[StageCost]) -> StageCost:
    return StageCost(*(sum(getattr(c, f) for c in costs) for f in ("micro_s", "sync_s", "update_s", "static_bytes",
                                                                   "activation_bytes")),
                     send_bytes=costs[-1].send_bytes, receive_bytes=0.0)


def balanced_cuts(units: Sequence[StageCost], num_stages: int, pp: int, schedule: str, microbatches: int,
                  budget_bytes: float) -> tuple[int, ...] | None:
    """Unit indices where stages 1.. start: the slowest stage as fast as possible with every stage's memory (its
    micro-batches in flight included) within its share of the budget; None when no cut fits. With `virtual` stages a
    pp rank, the rank's memory is its stages' sum: each stage is held to budget / virtual, which keeps every rank
    within the budget (`_estimates` checks the rank's sum as priced)."""
    n = len(units)
    if num_stages > n:
        return None
    prefix = [StageCost(0, 0, 0, 0, 0, 0, 0)]
    for c in units:
        prefix.append(_sum([prefix[-1], c]))
    virtual = num_stages // pp
    stage_budget = budget_bytes / virtual

    def span(i: int, j: int) -> tuple[float, float, float]:  # time, static and activation bytes of units [i, j)
        a, b = prefix[i], prefix[j]
        return b.micro_s - a.micro_s, b.static_bytes - a.static_bytes, b.activation_bytes - a.activation_bytes

    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]  # best[s][j]: (slowest, total) of stages 0..s-1 over units [0, j)
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        held = in_flight(schedule, pp, virtual, microbatches, (s - 1) % pp)
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                t, static, act = span(i, j)
                if static + held * act > stage_budget:
                    continue
                cand = (max(best[s - 1][i][0], t), best[s - 1][i][1] + t)
                if cand < best[s][j]:
                    best[s][j], choice[s][j] = cand, i
    if best[num_stages][n] == inf:
        return None
    starts, j = [], n
    for s in range(num_stages, 0, -1):
        j = choice[s][j]
        starts.append(j)
    return tuple(reversed(starts))[1:]


# ---------------------------------------------------------------- the search
@dataclass(frozen=True)
class Estimate:
    config: Config
    schedule: str
    step_s: float
    starts: tuple[int, ...]  # unit indices


def configs(num_devices: int, global_batch: int, num_units: int, gpus_per_node: int, pp: int | None = None) -> list[Config]:
    """pp x stage mesh x micro-batch counts worth estimating: pp from 2 up to the units (only `pp` where given), a
    stage mesh of one axis or (dp, tp) with tp filling a node, micro-batches of n, 2n and 4n rows (n: the stage's
    devices; each rank feeds its slice of each micro-batch)."""
    out = []
    degrees = [pp] if pp is not None else [p for p in range(2, num_devices + 1) if num_devices % p == 0]
    for pp in (p for p in degrees if p <= num_units):
        n = num_devices // pp
        shapes = [(n,)] + ([(n // min(n, gpus_per_node), min(n, gpus_per_node))] if 1 < min(n, gpus_per_node) < n else [])
        for rows in (n, 2 * n, 4 * n):
            if global_batch % rows:
                continue
            for shape in shapes:
                for virtual in (1, 2):
                    if pp * virtual <= num_units:
                        out.append(Config(pp, shape, global_batch // rows, virtual))
    return out


def solve_pipeline(
    trace_at: Callable[[int], TracedGraph] | SearchCache,
    global_batch: int,
    num_devices: int,
    hardware: str | Mesh = "h100",
    memory_budget_bytes: float | None = None,
    optimizer: str = "adamw",
    time_limit_s: float = 30.0,
    schedules: Sequence[str] = SCHEDULES,
    gpus_per_node: int = 8,
    candidates: int = 3,
    topology: Topology | None = None,
    pp: int | None = None,
    search_time_limit_s: float | None = None,
) -> PipelinePlan:
    """The fastest pipeline plan found for the model `trace_at(m)` traces at micro-batches of global_batch / m rows
    (`pp`: only pipelines of that many pp ranks; default: every degree that divides num_devices). `trace_at` may be
    a `SearchCache` built on it, to reuse traces, profiles and plans across searches. `time_limit_s` bounds each
    ILP solve; `search_time_limit_s`, the whole search in CPU seconds (`deadline.Deadline`): where it runs out, the
    answer is the best plan solved so far, with a note that says so.

    Raises `PipelineSearchError` with the reason when the model cannot be cut or no configuration fits (or none was
    solved within `search_time_limit_s`)."""
    if pp is not None and (pp < 2 or num_devices % pp):
        raise PipelineSearchError(f"pp={pp} does not split {num_devices} devices into stages: give a divisor of "
                                  f"{num_devices} of at least 2, or 'auto'")
    if search_time_limit_s is not None and not search_time_limit_s > 0:
        raise ValueError(f"search_time_limit_s={search_time_limit_s!r}: give the CPU seconds the search may take, e.g. "
                         "600.0, or None for no limit")
    cache = _cache(trace_at, optimizer, time_limit_s)
    topo = topology or Topology.of(hardware, gpus_per_node)
    budget = topo.base.memory_bytes if memory_budget_bytes is None else float(memory_budget_bytes)
    deadline = Deadline(search_time_limit_s)
    with cache.limited(deadline):
        try:
            first, num_units = _cuttable(cache)
        except SearchTimeUp as up:
            raise PipelineSearchError(f"the pipeline search stopped: {up}, while tracing the model") from None
    if pp is not None and pp > num_units:
        raise PipelineSearchError(f"{first.model_name} has {num_units} parts between its cut points, too few for pp={pp}: "
                                  f"give pp <= {num_units}, or 'auto'")
    todo = [c for c in configs(num_devices, global_batch, num_units, gpus_per_node, pp)
            if not (cache.layers(1).batch_statistics and c.microbatches > 1)]
    estimates: list[Estimate] = []
    best: PipelinePlan | None = None
    estimated = tried = fitted = 0
    stopped = None
    with cache.limited(deadline):
        try:
            for config in todo:
                estimates += _estimates(config, cache, topo, budget, schedules)
                estimated += 1
            estimates.sort(key=lambda e: e.step_s)
            log.info("pipeline: %d configurations estimated in %.1f CPU s (%d solves)", len(estimates),
                     deadline.spent_s(), cache.solver.solves)
            keys = list(dict.fromkeys((e.config, e.schedule) for e in estimates))  # each configuration once, fastest first
            found = {(e.config, e.schedule): e for e in reversed(estimates)}
            for key in keys[:4 * candidates]:  # the best `candidates` that fit (an estimate's memory is rough: some do not)
                if fitted >= candidates:
                    break
                tried += 1
                try:
                    plan = _exact(found[key], cache, topo, budget)
                except (InfeasibleError, ValueError) as err:
                    log.info("pipeline: %s %s does not fit: %s", *key, err)
                    continue
                fitted += 1
                if best is None or plan.time.step_s < best.time.step_s:
                    best = plan
        except SearchTimeUp as up:
            stopped = (f"the pipeline search stopped: {up}, with {estimated} of {len(todo)} configurations estimated and "
                       f"{fitted} solved of {tried} tried")
            log.info("pipeline: %s", stopped)
    if best is None:
        raise PipelineSearchError(stopped or f"no pipeline of {num_devices} devices fits {budget / 2**30:.1f} GiB per "
                                             f"device for {first.model_name}: raise the budget or use more devices")
    if stopped:
        best = replace(best, notes=(*best.notes, f"{stopped}: the best plan solved so far"))
    return best


def price_config(
    trace_at: Callable[[int], TracedGraph] | SearchCache,
    config: Config,
    schedule: str,
    hardware: str | Mesh = "h100",
    memory_budget_bytes: float | None = None,
    optimizer: str = "adamw",
    time_limit_s: float = 30.0,
    gpus_per_node: int = 8,
    topology: Topology | None = None,
    starts: Sequence[int] | None = None,
) -> PipelinePlan:
    """One configuration priced as the search prices it (`config`: pp ranks, stage mesh, micro-batch count, stages a
    rank; `schedule`): cut where the search's balance puts the cuts, or before the units `starts` (unit indices,
    ascending: 1 is the first layer), each stage solved on the stage mesh. For comparing with a configuration
    chosen by hand (Megatron-LM's t, p, d).

    Raises `PipelineSearchError` when the model cannot be cut or the configuration does not fit."""
    cache = _cache(trace_at, optimizer, time_limit_s)
    topo = topology or Topology.of(hardware, gpus_per_node)
    budget = topo.base.memory_bytes if memory_budget_bytes is None else float(memory_budget_bytes)
    first, num_units = _cuttable(cache, config.microbatches)
    what = f"{first.model_name} as pp={config.pp} x {config.stage_shape}, {config.microbatches} micro-batches, {schedule}"
    if schedule not in SCHEDULES or schedule_problem(schedule, config.pp, config.virtual, config.microbatches):
        raise PipelineSearchError(f"{what}: {schedule_problem(schedule, config.pp, config.virtual, config.microbatches) or 'unknown schedule'}")
    if starts is None:
        found = _estimates(config, cache, topo, budget, (schedule,))
        if not found:
            raise PipelineSearchError(f"{what}: no cut fits {budget / 2**30:.1f} GiB per device")
        estimate = found[0]
    else:
        if len(starts) + 1 != config.pp * config.virtual or list(starts) != sorted(set(starts)) or \
                not 0 < min(starts, default=1) <= max(starts, default=1) < num_units:
            raise PipelineSearchError(f"{what}: starts {list(starts)} must be {config.pp * config.virtual - 1} ascending "
                                      f"unit indices in 1..{num_units - 1}")
        estimate = Estimate(config, schedule, math.nan, tuple(starts))
    try:
        return _exact(estimate, cache, topo, budget)
    except (InfeasibleError, ValueError) as err:
        raise PipelineSearchError(f"{what} does not fit: {err}") from None


def _cache(trace_at: Callable[[int], TracedGraph] | SearchCache, optimizer: str, time_limit_s: float) -> SearchCache:
    if not isinstance(trace_at, SearchCache):
        return SearchCache(trace_at, optimizer, time_limit_s)
    if (trace_at.solver.optimizer, trace_at.solver.time_limit_s) != (optimizer, time_limit_s):
        raise ValueError(f"the cache solves for {trace_at.solver.optimizer!r} within {trace_at.solver.time_limit_s} s, "
                         f"not {optimizer!r} within {time_limit_s} s: build a SearchCache with these, or pass them")
    return trace_at


def _cuttable(cache: SearchCache, microbatches: int = 1) -> tuple[TracedGraph, int]:
    """The trace at `microbatches` and its number of units; `PipelineSearchError` with the reason when it cannot be
    cut."""
    first, layers = cache.traced(microbatches), cache.layers(microbatches)
    try:
        if layers.reason:
            raise CutError(layers.reason)
        split_loss(first)
    except (CutError, LossError) as err:
        raise PipelineSearchError(f"{first.model_name or 'the model'} gets no pipeline: {err}") from None
    return first, len(unit_bounds(layers)) - 1


def _estimates(config: Config, cache: SearchCache, topo: Topology, budget: float,
               schedules: Sequence[str]) -> list[Estimate]:
    """The configuration's estimate under each schedule whose balanced cut fits the budget. The units are solved
    alone at the whole budget, where the ILP recomputes nothing; when no schedule fits so, they are estimated again
    recomputed (`_recomputed`), as the exact round's lowered budgets make the stages' plans recompute; and when
    that does not fit either, solved at a stage's budget shared by its units, where the ILP keeps leaner plans
    (weights sharded over the data-parallel axes, recompute) that a unit alone at the whole budget has no reason to."""
    mesh = topo.stage_mesh(config.stage_shape, config.microbatches)
    leaner = [s for s in schedules if s != "zero_bubble"]  # (zero bubble is solved without recompute: `_exact`)

    def fitting(unit_budget: float) -> tuple[list[Estimate], int]:
        units = cache.unit_costs(config.microbatches, mesh, unit_budget)
        return (_fitting(config, units, topo, budget, schedules)
                or _fitting(config, [_recomputed(u) for u in units], topo, budget, leaner)), len(units)

    try:
        out, num_units = fitting(budget)
        return out or fitting(budget * config.pp * config.virtual / num_units)[0]
    except InfeasibleError:
        return []


def _recomputed(unit: StageCost) -> StageCost:
    """A unit's price with its forward run again in backward, as activation checkpointing does: it keeps only the
    activation it receives a micro-batch, and its forward, about a third of forward and backward (Narayanan et al.
    2021, section 3.5: recomputation costs 33% more compute), runs twice."""
    return replace(unit, micro_s=unit.micro_s * 4 / 3, activation_bytes=min(unit.activation_bytes, unit.receive_bytes))


def _fitting(config: Config, units: Sequence[StageCost], topo: Topology, budget: float,
             schedules: Sequence[str]) -> list[Estimate]:
    mesh = topo.stage_mesh(config.stage_shape)
    num = config.pp * config.virtual
    out = []
    for schedule in schedules:
        if schedule_problem(schedule, config.pp, config.virtual, config.microbatches):
            continue
        starts = balanced_cuts(units, num, config.pp, schedule, config.microbatches, budget)
        if starts is None:
            continue
        bounds = (0, *starts, len(units))
        costs = [_sum(units[a:b]) for a, b in zip(bounds, bounds[1:])]
        costs = [replace(c, receive_bytes=costs[i - 1].send_bytes if i else 0.0) for i, c in enumerate(costs)]
        links = topo.boundary_links(math.prod(config.stage_shape), num, config.pp)
        step, memory = price(costs, schedule, with_pp(mesh, config.pp, topo.inter), config.microbatches, links)
        if max(memory) <= budget:
            out.append(Estimate(config, schedule, step.step_s, starts))
    return out


def _exact(e: Estimate, cache: SearchCache, topo: Topology, budget: float) -> PipelinePlan:
    """The estimate's configuration solved stage by stage and priced; ValueError or InfeasibleError when it does
    not fit."""
    config = e.config
    traced, layers = cache.traced(config.microbatches), cache.layers(config.microbatches)
    bounds = unit_bounds(layers)
    stages = cut(traced, tuple(bounds[u] for u in e.starts), layers)
    mesh = topo.stage_mesh(config.stage_shape, config.microbatches)
    pmesh = with_pp(replace(mesh, microbatches=1), config.pp, topo.inter)
    links = topo.boundary_links(mesh.num_devices, len(stages), config.pp)
    shared = _shared(stages)
    budgets = [budget] * len(stages)
    for _ in range(6):  # until every rank's stages fit with their micro-batches in flight
        plans = [cache.solver(s.traced, mesh, b) for s, b in zip(stages, budgets)]
        costs = [stage_cost(p, s, stages[i + 1] if i + 1 < len(stages) else None, shared)
                 for i, (p, s) in enumerate(zip(plans, stages))]
        step, memory = price(costs, e.schedule, pmesh, config.microbatches, links)
        over = [memory[i % config.pp] - budget for i in range(len(stages))]
        if max(over) <= 0:
            break
        # from what each plan holds (a plan well under its budget would come back unchanged for a budget cut by less);
        # a plan is made for one micro-batch and its rank holds `held` of them, so a byte of activations the lower
        # budget makes it recompute is `held` bytes off the rank: the excess is shared by its stages and divided so
        held = [max(in_flight(e.schedule, config.pp, config.virtual, config.microbatches, i % config.pp), 1.0)
                for i in range(len(stages))]
        budgets = [min(b, p.memory.total_bytes) - max(o, 0.0) / (config.virtual * h)
                   for b, p, o, h in zip(budgets, plans, over, held)]
        if min(budgets) <= 0:
            raise ValueError("the micro-batches in flight alone exceed the budget")
    else:
        raise ValueError(f"stages need {max(memory) / 2**30:.1f} GiB with their micro-batches in flight")
    # a rank that does not set the pace gains nothing from a faster micro-batch, while its stages' sync and optimizer
    # step still count whole: each of its stages is offered its plan solved with them weighed as one pass's (a rank
    # within 1% of the pace has no time to give for them)
    rank_s = [sum(step.stage_s[config.pp * k + r] for k in range(config.virtual)) for r in range(config.pp)]
    for i, stage in enumerate(stages):
        if config.microbatches == 1 or rank_s[i % config.pp] >= 0.99 * max(rank_s):
            continue
        try:
            alone = cache.solver(stage.traced, replace(mesh, microbatches=1), budgets[i])
        except InfeasibleError:
            continue
        trial = [*costs[:i], stage_cost(alone, stage, stages[i + 1] if i + 1 < len(stages) else None, shared), *costs[i + 1:]]
        trial_step, trial_memory = price(trial, e.schedule, pmesh, config.microbatches, links)
        if trial_step.step_s < step.step_s and max(trial_memory) <= budget:
            plans[i], costs, step, memory = alone, trial, trial_step, trial_memory
    if e.schedule == "zero_bubble" and any(p.recomputed() for p in plans):
        raise ValueError("zero_bubble needs stage plans without recompute")
    ops = [n.name for n in traced.graph.nodes if n.op == "call_function"]
    stage_plans = tuple(StagePlan(s.start, ops[s.start], s.layers, p, has_embedding=i == 0, has_head=s.is_last)
                        for i, (s, p) in enumerate(zip(stages, plans)))
    return PipelinePlan(pmesh, e.schedule, config.microbatches, stage_plans, step, memory, budget, traced.model_name)


def _shared(stages: Sequence[StageGraph]) -> frozenset[str]:
    """FQNs of the parameters more than one stage reads."""
    seen: dict[str, int] = {}
    for s in stages:
        for fqn in set(s.traced.param_fqns.values()):
            seen[fqn] = seen.get(fqn, 0) + 1
    return frozenset(f for f, k in seen.items() if k > 1)
