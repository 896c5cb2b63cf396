"""The cost model's side: autopar's plan per budget and the same model's price for each hand-written baseline.

    pred = Predictor(model, sample, {"1d": mesh_4, "2d": mesh_2x2}, block_paths(model))
    pred.baseline("fsdp", ac=True)           # Plan: ZeRO-3 with every block recomputed, priced
    pred.autopar(budget_bytes)               # fastest plan over the meshes, or None if nothing fits

Baselines map onto `autopar.solver.baseline_plan` (ddp -> data_parallel, fsdp ->
zero3 on the 1-D mesh), solved with no memory pressure. Its "megatron" baseline
only ALLOWS tensor parallel weights (without memory pressure the ILP keeps them
replicated), so tp is priced here with every parameter's use spec pinned to what
`tensor_parallel.PLANS` runs (column-parallel weight Shard(0), row-parallel
Shard(1) on the tp axis, everything else replicated) and the rest left to the
same ILP. The "+ac" variants re-price a plan with `fixed_plan` and every node
inside a transformer block recomputed (what checkpointing each block does).
"""
from __future__ import annotations

import logging
from typing import Any

from torch import nn

from autopar.api import meta_copy, meta_sample
from autopar.errors import AutoparError, InfeasibleError
from autopar.profiler import profile
from autopar.solver import baseline_plan, fixed_plan, solve
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

# system -> (autopar baseline name, which mesh); tp is priced by `tensor_parallel_plan`
BASELINE_OF = {"ddp": ("data_parallel", "1d"), "fsdp": ("zero3", "1d")}


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
        if system == "tp" and system not in self._baselines:
            self._baselines[system] = self.tensor_parallel_plan(self.meshes["2d"])
        if system not in self._baselines:
            name, mesh = BASELINE_OF[system]
            self._baselines[system] = baseline_plan(self.traced, self.profile, self.meshes[mesh], name,
                                                    time_limit_s=self.time_limit_s)
        plan = self._baselines[system]
        if not ac:
            return plan
        choices = {d.node: d.strategy for d in plan.nodes if d.op != "output"}
        zero = frozenset(p.fqn for p in plan.params if p.zero)
        return fixed_plan(self.traced, self.profile, plan.mesh, choices, recompute=self._recompute, zero_params=zero)

    def tensor_parallel_plan(self, mesh: Mesh) -> Plan:
        """The fastest plan whose parameters are used exactly as the Megatron baseline shards them."""
        ndim = len(mesh.shape)
        strategies = enumerate_strategies(self.traced, mesh)
        built = build_problem(self.traced, self.profile, mesh, strategies, mesh.memory_bytes)
        allowed = {}
        for v, node in enumerate(built.problem.nodes):
            leader = built.grouping.clusters[built.grouping.classes[v][0]].leader
            fqn = self.traced.param_fqns.get(leader)
            if fqn is None:
                continue
            placements = [Replicate()] * ndim
            placements[-1] = self._tp_specs.get(fqn, Replicate())
            want = Spec(tuple(placements))
            allowed[v] = frozenset(i for i in range(len(node.options))
                                   if built.strategies[leader][built.member_strategy(leader, i)].output_specs[0] == want)
            if not allowed[v]:
                raise AutoparError(f"the solver has no strategy using parameter {fqn} as {want}; cannot price the tp baseline")
        sol = solve_problem(built.problem, self.time_limit_s, restrictions=Restrictions(allowed, zero="never", recompute="never"))
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
