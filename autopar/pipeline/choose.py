"""Pipeline or not: the pipeline search's best plan against the single-mesh plan, the faster one kept.

    chosen = choose(flat_plan, lambda m: trace_at(m), global_batch=64, num_devices=64, pp="auto", hardware="h100-ib")

`pp="auto"` keeps a pipeline only when its predicted step beats the single-mesh plan's; a model the
pipeline cannot split, or no pipeline that fits, leaves the single-mesh plan with a note saying why.
`pp=N` asks for a pipeline of N pp ranks whatever it costs (and fails with the reason when there is none).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Literal

from autopar.pipeline.cache import SearchCache
from autopar.pipeline.plan import PipelinePlan
from autopar.pipeline.search import PipelineSearchError, solve_pipeline
from autopar.solver.mesh import Mesh
from autopar.solver.plan import Plan
from autopar.tracer import TracedGraph

log = logging.getLogger(__name__)

PP = Literal["auto"] | int


def check_pp(pp: object) -> None:
    """`pp` is "auto" or a whole number of at least 2 (else a `ValueError` naming it and the fix)."""
    if pp == "auto" or (isinstance(pp, int) and not isinstance(pp, bool) and pp >= 2):
        return
    raise ValueError(f"pp={pp!r}: give 'auto' (the solver decides whether stages pay) or a number of pp ranks of at "
                     "least 2")


def choose(
    flat: Plan | None,
    trace_at: Callable[[int], TracedGraph] | SearchCache,
    global_batch: int,
    num_devices: int,
    pp: PP = "auto",
    hardware: str | Mesh = "h100",
    memory_budget_bytes: float | None = None,
    optimizer: str = "adamw",
    time_limit_s: float = 30.0,
    gpus_per_node: int = 8,
    search_time_limit_s: float | None = None,
) -> Plan | PipelinePlan:
    """The faster of `flat` (the single-mesh plan; None when none fits) and the best pipeline plan of the model
    `trace_at(m)` traces at micro-batches of global_batch / m rows (or a `SearchCache` built on it: a model traced under
    a mixed-precision policy is priced with its masters). Each carries a note with the other's step. `time_limit_s` bounds
    each ILP solve, `search_time_limit_s` the pipeline search in CPU seconds (`solve_pipeline`)."""
    check_pp(pp)
    try:
        piped = solve_pipeline(trace_at, global_batch, num_devices, hardware, memory_budget_bytes, optimizer, time_limit_s,
                               gpus_per_node=gpus_per_node, pp=None if pp == "auto" else pp,
                               search_time_limit_s=search_time_limit_s)
    except PipelineSearchError as err:
        if flat is None or pp != "auto":
            raise
        log.info("pipeline: %s", err)
        return replace(flat, notes=(*flat.notes, f"no pipeline stages: {err}"))
    if flat is None:
        return replace(piped, notes=(*piped.notes, "pipeline stages: no plan without them fits the budget"))
    flat_s, piped_s = flat.time.total_s, piped.time.step_s
    if pp == "auto" and flat_s <= piped_s:
        return replace(flat, notes=(*flat.notes, f"no pipeline stages: the best pipeline ({describe(piped)}) predicts "
                                                 f"{piped_s * 1e3:.4g} ms a step, this plan {flat_s * 1e3:.4g} ms"))
    return replace(piped, notes=(*piped.notes, f"pipeline stages predict {piped_s * 1e3:.4g} ms a step, the best plan "
                                               f"without them {flat_s * 1e3:.4g} ms ({flat_s / piped_s:.2f}x)"))


def describe(plan: PipelinePlan) -> str:
    """'pp=4 x dp=2 x tp=8, 1f1b, 8 micro-batches'."""
    axes = " x ".join(f"{a.name}={a.size}" for a in plan.mesh.axes if a.size > 1 or a.name == "pp")
    return f"{axes}, {plan.schedule}, {plan.microbatches} micro-batches"
