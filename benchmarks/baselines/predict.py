"""The cost model's side: autopar's plan per budget and the same model's price for each hand-written baseline.

    pred = Predictor(model, sample, {"1d": mesh_4, "2d": mesh_2x2}, block_paths(model))
    pred.baseline("fsdp", ac=True)           # Plan: ZeRO-3 with every block recomputed, priced
    pred.autopar(budget_bytes)               # fastest plan over the meshes, or None if nothing fits

Each baseline is priced as the same ILP with what the baseline fixes pinned:
every parameter's use spec, the batch inputs' spec (Shard(0) over the data-parallel
axis) and ZeRO (always for fsdp, never otherwise); the ILP picks the rest. Pinning
the inputs matters: `autopar.solver.baseline_plan("data_parallel")` only restricts
parameters, and on a calibrated CPU mesh its cheapest "data parallel" plan computes
the whole batch on every rank (no gradient all-reduce), which is not what DDP runs.
Its "megatron" likewise only allows tensor-parallel weights. tp pins what
`tensor_parallel.PLANS` runs: column-parallel weight Shard(0), row-parallel Shard(1)
on the tp axis, everything else replicated. The "+ac" variants re-price a plan with
`fixed_plan` and every node inside a transformer block recomputed (what
checkpointing each block does).
"""
from __future__ import annotations

import logging
from typing import Any

from torch import nn

from autopar.api import meta_copy, meta_sample
from autopar.errors import AutoparError, InfeasibleError
from autopar.profiler import profile
from autopar.solver import fixed_plan, solve
from autopar.solver.ilp import Restrictions, solve_problem
from autopar.solver.mesh import Mesh
from autopar.solver.plan import Plan
from autopar.solver.problem import build_problem
from autopar.solver.search import to_plan
from autopar.solver.spec import Replicate, Shard, Spec
from autopar.solver.strategies import enumerate_strategies
from autopar.tracer import module_path, trace

from benchmarks.baselines.tensor_parallel import COL, PLANS

log = logging.getLogger(__name__)

# system -> (which mesh, ZeRO rule)
BASELINE_OF = {"ddp": ("1d", "never"), "fsdp": ("1d", "always"), "tp": ("2d", "never")}


class Predictor:
    def __init__(self, model: nn.Module, sample: Any, meshes: dict[str, Mesh], blocks: list[str], family: str,
                 optimizer: str = "adamw", time_limit_s: float = 30.0):
        self.traced = trace(meta_copy(model), meta_sample(sample))
        self.profile = profile(self.traced, optimizer=optimizer).evaluate()
        self.meshes = meshes
        self.time_limit_s = time_limit_s
        self._recompute = frozenset(
            n.name for n in self.traced.graph.nodes
            if n.op == "call_function" and any(_inside(module_path(n), b) for b in blocks))
        self._baselines: dict[str, Plan] = {}
        self._tp_specs = _tp_param_specs(family, blocks)

    def baseline(self, system: str, ac: bool = False) -> Plan:
        """The cost model's plan (and price) for a hand-written baseline."""
        if system not in self._baselines:
            mesh, zero = BASELINE_OF[system]
            self._baselines[system] = self.pinned_plan(self.meshes[mesh], tp_params=system == "tp", zero=zero)
        plan = self._baselines[system]
        if not ac:
            return plan
        choices = {d.node: d.strategy for d in plan.nodes if d.op != "output"}
        zero_fqns = frozenset(p.fqn for p in plan.params if p.zero)
        return fixed_plan(self.traced, self.profile, plan.mesh, choices, recompute=self._recompute, zero_params=zero_fqns)

    def pinned_plan(self, mesh: Mesh, tp_params: bool, zero: str) -> Plan:
        """The fastest plan with batch inputs Shard(0) over the outer axis and parameters used replicated,
        or (tp_params) as the Megatron baseline shards them over the last axis."""
        ndim = len(mesh.shape)
        strategies = enumerate_strategies(self.traced, mesh)
        built = build_problem(self.traced, self.profile, mesh, strategies, mesh.memory_bytes)
        inputs = set(self.traced.input_names)
        allowed = {}
        for v, node in enumerate(built.problem.nodes):
            leader = built.grouping.clusters[built.grouping.classes[v][0]].leader
            placements = [Replicate()] * ndim
            if leader in inputs:
                placements[0] = Shard(0)
            elif leader in self.traced.param_fqns:
                if tp_params:
                    placements[-1] = self._tp_specs.get(self.traced.param_fqns[leader], Replicate())
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
