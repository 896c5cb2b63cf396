"""The cost model's side: autopar's plan per budget and the same model's price for each hand-written baseline.

    pred = Predictor(model, sample, {"1d": mesh_4, "2d": mesh_2x2}, block_paths(model))
    pred.baseline("fsdp", ac=True)           # Plan: ZeRO-3 with every block recomputed, priced
    pred.autopar(budget_bytes)               # fastest plan over the meshes, or None if nothing fits

Each baseline is priced as the same ILP with what the baseline fixes pinned:
every parameter's use spec, the batch inputs' spec (Shard(0) over the data-parallel
axis), for ddp/fsdp every batch-carrying activation split over that axis (as
`autopar.solver.baseline_plan("data_parallel")` does: otherwise the cheapest "data
parallel" plan may gather the batch and compute it whole on every rank, which is not
what DDP runs) and ZeRO (never for ddp and tp); the ILP picks the rest. tp pins what
`tensor_parallel.PLANS` runs: column-parallel weight Shard(0), row-parallel Shard(1)
on the tp axis, everything else replicated. fsdp is priced from the ddp plan plus
FSDP2's own collectives: per `fully_shard` unit (each block, and the root for the
rest) one all-gather of the unit's parameters in forward, one again in backward
(not for the root, which FSDP2 keeps unsharded after forward) and one
reduce-scatter of its gradients, instead of ddp's bucketed all-reduce, and the
optimizer's step on each rank's shard only (the ZeRO-3 plan's); its memory is
the ILP's ZeRO-3 plan's. (autopar's own ZeRO gathers each parameter on its own,
which is what the ILP prices; FSDP2 gathers a block's parameters at once.) The
"+ac" variants add the recompute time of every node inside a transformer block
(what checkpointing each block does), priced with `fixed_plan`. tp adds DTensor's
own per-module cost, measured on the live world (`overheads.py`). Every baseline
leaves out what the ILP charges for resharding 0-d tensors (`scalar_reshard_s`): the
hand-written baselines return each rank's local mean and let the gradient averaging
do the rest, so they run no such collective. autopar's graph returns the exact global
mean: its token count is all-reduced in the background from the start of the forward,
which the ILP does not charge (`problem.count_hidden_in_forward`), so for a mean
loss there is nothing to leave out; a 0-d value resharded inside the graph is.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from autopar.api import trace_copy
from autopar.errors import AutoparError, InfeasibleError
from autopar.profiler import profile
from autopar.solver import fixed_plan, solve
from autopar.solver.anytime import solve_problem
from autopar.solver.ilp import Restrictions
from autopar.solver.cost import bucketed_all_reduce_s, collective_time_s, sync_latency_s
from autopar.solver.mesh import Mesh
from autopar.solver.plan import Plan
from autopar.solver.problem import build_problem, count_hidden_in_forward
from autopar.solver.reshard import reshard_cost
from autopar.solver.assemble import to_plan
from autopar.solver.textbook import batch_dependent, splits_batch
from autopar.solver.spec import Replicate, Shard, Spec
from autopar.solver.strategies import enumerate_strategies, strategy_inputs
from autopar.tracer import TracedGraph, module_path, output_vals

from benchmarks.baselines.tensor_parallel import COL, PLANS

log = logging.getLogger(__name__)

# system -> (which mesh, ZeRO rule)
BASELINE_OF = {"ddp": ("1d", "never"), "fsdp": ("1d", "always"), "tp": ("2d", "never")}


class Predictor:
    def __init__(self, model: nn.Module, sample: Any, meshes: dict[str, Mesh], blocks: list[str], family: str,
                 optimizer: str = "adamw", time_limit_s: float = 30.0, tp_module_overhead_s: float = 0.0):
        self.traced = trace_copy(model, sample, "cpu")
        self.profile = profile(self.traced, optimizer=optimizer).evaluate()
        self.meshes = meshes
        self.time_limit_s = time_limit_s
        self._recompute = frozenset(
            n.name for n in self.traced.graph.nodes
            if n.op == "call_function" and any(_inside(module_path(n), b) for b in blocks))
        self._baselines: dict[str, Plan] = {}
        self._blocks = blocks
        # DTensor's per-module cost in the tp baseline (`overheads.py`), for every parallelized linear
        self._tp_overhead_s = tp_module_overhead_s * len(blocks) * len(PLANS.get(family, {}))
        self._param_bytes = {fqn: p.param_bytes for fqn, p in self.profile.params.items()}
        self._tp_specs = _tp_param_specs(family, blocks)

    def baseline(self, system: str, ac: bool = False) -> Plan:
        """The cost model's plan (and price) for a hand-written baseline."""
        plan = self._pinned(system)
        timed = self._pinned("ddp") if system == "fsdp" else plan  # fsdp's strategies: ddp's, see the docstring
        if ac:
            choices = {d.node: d.strategy for d in timed.nodes if d.op != "output"}
            timed = fixed_plan(self.traced, self.profile, timed.mesh, choices, recompute=self._recompute)
        if system == "fsdp":  # memory: the ZeRO-3 plan's (recomputing the blocks under ac); time: see the docstring
            if ac:
                choices = {d.node: d.strategy for d in plan.nodes if d.op != "output"}
                plan = fixed_plan(self.traced, self.profile, plan.mesh, choices, recompute=self._recompute,
                                  zero_params=frozenset(p.fqn for p in plan.params if p.zero))
            t = timed.time
            comm_s = t.comm_s + self._fsdp_extra_comm_s(plan.mesh) - scalar_reshard_s(self.traced, timed)
            update_s = plan.time.update_s  # each rank steps its shards only
            return replace(plan, time=replace(t, compute_s=t.compute_s - t.update_s + update_s, comm_s=comm_s, update_s=update_s))
        if system == "tp":
            timed = replace(timed, time=replace(timed.time, compute_s=timed.time.compute_s + self._tp_overhead_s))
        return replace(timed, time=replace(timed.time, comm_s=timed.time.comm_s - scalar_reshard_s(self.traced, timed)))

    def _pinned(self, system: str) -> Plan:
        """The ILP's plan with what `system` fixes pinned (cached), before any baseline-specific price."""
        if system not in self._baselines:
            mesh, zero = BASELINE_OF[system]
            self._baselines[system] = self.pinned_plan(self.meshes[mesh], tp_params=system == "tp", zero=zero)
        return self._baselines[system]

    def _fsdp_extra_comm_s(self, mesh: Mesh) -> float:
        """FSDP2's collectives per step minus the ddp gradient all-reduce they replace (see the docstring)."""
        axis = mesh.axes[0]
        units = [sum(self._param_bytes[f] for f in self._param_bytes if _inside(f, b)) for b in self._blocks]
        root = sum(self._param_bytes.values()) - sum(units)
        fsdp = sum(2 * collective_time_s("all_gather", b, axis) + collective_time_s("reduce_scatter", b, axis) for b in units)
        fsdp += collective_time_s("all_gather", root, axis) + collective_time_s("reduce_scatter", root, axis)
        # what the pinned plan charged for each gradient's bucketed all-reduce (`strategy_cost`), and the last bucket
        ddp_sync = sum(bucketed_all_reduce_s(b, mesh, (0,)) for b in self._param_bytes.values()) + sync_latency_s(mesh, (0,))
        return fsdp - ddp_sync

    def pinned_plan(self, mesh: Mesh, tp_params: bool, zero: str) -> Plan:
        """The fastest plan with batch inputs Shard(0) over the outer axis and parameters used replicated,
        or (tp_params) as the Megatron baseline shards them over the last axis."""
        ndim = len(mesh.shape)
        strategies = enumerate_strategies(self.traced, mesh)
        built = build_problem(self.traced, self.profile, mesh, strategies, mesh.memory_bytes)
        inputs = set(self.traced.input_names)
        batched = batch_dependent(self.traced)
        allowed = {}
        for v, node in enumerate(built.problem.nodes):
            leader = built.grouping.clusters[built.grouping.classes[v][0]].leader
            placements = [Replicate()] * ndim
            if leader in inputs:
                placements[0] = Shard(0)
            elif leader in self.traced.param_fqns:
                if tp_params:
                    placements[-1] = self._tp_specs.get(self.traced.param_fqns[leader], Replicate())
            elif leader in batched and not tp_params:
                # ddp/fsdp: every activation carrying the batch is split over the data-parallel axis (on some dim)
                split = frozenset(i for i in range(len(node.options))
                                  if splits_batch(built.strategies[leader][built.member_strategy(leader, i)]))
                if split:
                    allowed[v] = split
                else:
                    log.info("baseline: no batch-split strategy for %s; left free", leader)
                continue
            else:
                continue
            want = Spec(tuple(placements))
            allowed[v] = frozenset(i for i in range(len(node.options))
                                   if built.strategies[leader][built.member_strategy(leader, i)].output_specs[0] == want)
            if not allowed[v]:
                raise AutoparError(f"the solver has no strategy giving {leader} the spec {want}; cannot price this baseline")
        sol = solve_problem(built.problem, self.time_limit_s, restrictions=Restrictions(allowed, zero=zero, recompute="never"))
        return to_plan(self.traced, mesh, built, sol)

    def autopar(self, budget_bytes: float) -> Plan | None:
        """The fastest plan within `budget_bytes` over every mesh shape, or None when none fits."""
        best = None
        for mesh in self.meshes.values():
            try:
                plan = solve(self.traced, self.profile, mesh, memory_budget_bytes=budget_bytes,
                             time_limit_s=self.time_limit_s)
            except InfeasibleError as err:
                log.info("autopar: no plan within %.2f MB on %s: %s", budget_bytes / 1e6, mesh, err)
                continue
            if best is None or plan.time.total_s < best.time.total_s:
                best = plan
        return best


def scalar_reshard_s(traced: TracedGraph, plan: Plan) -> float:
    """Seconds `plan` spends resharding 0-d tensors between nodes (a loss sum, a token count), forward and
    backward, as the ILP priced them (`reshard_cost`). A mean loss's token count is not among them: its
    all-reduce runs behind the forward, which the ILP does not charge (`count_hidden_in_forward`)."""
    strategy = {d.node: d.strategy for d in plan.nodes}
    free = count_hidden_in_forward(traced)
    total = 0.0
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.name not in strategy:
            continue
        for a, (p, k) in enumerate(strategy_inputs(node)):
            val = output_vals(p)[k]
            if p.name not in strategy or not isinstance(val, torch.Tensor) or val.dim() != 0 or (node.name, a) in free:
                continue
            total += reshard_cost(strategy[p.name].output_specs[k], strategy[node.name].input_specs[a], (),
                                  val.element_size(), plan.mesh, with_backward=val.is_floating_point())
    return total


def _tp_param_specs(family: str, blocks: list[str]) -> dict[str, Shard | Replicate]:
    """FQN -> placement on the tp axis of every parameter `apply_tensor_parallel` shards."""
    specs: dict[str, Shard | Replicate] = {}
    for block in blocks:
        for path, style in PLANS[family].items():
            specs[f"{block}.{path}.weight"] = Shard(0) if style is COL else Shard(1)  # nn.Linear weight is (out, in)
            specs[f"{block}.{path}.bias"] = Shard(0) if style is COL else Replicate()
    return specs


def _inside(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")
