"""A plan as a plain, JSON-ready summary: what `--json` prints and what the terminal and HTML reports draw.

    summary = summarize(plan)   # dict of plain values

Everything a report says comes from the plan alone (layouts and the memory timeline included), so
`autopar plan`, `show`, `--json` and `--html` agree whether the model is at hand or not.
"""
from __future__ import annotations

from typing import Any

from autopar.report.layers import rollup
from autopar.report.words import NO_TIMELINE, OLD_PLAN_FILE, baseline_words
from autopar.solver.plan import MemoryBreakdown, Plan, TimeBreakdown


def memory_dict(m: MemoryBreakdown) -> dict[str, float | None]:
    return {
        "params_bytes": m.params_bytes,
        "grads_bytes": m.grads_bytes,
        "optimizer_bytes": m.optimizer_bytes,
        "activations_bytes": m.activations_bytes,
        "temp_bytes": m.temp_bytes,
        "total_bytes": m.total_bytes,
        "budget_bytes": m.budget_bytes,
        # the host tier's (`solver.offload`): 0 when nothing is offloaded
        "host_params_bytes": m.host_params_bytes,
        "host_grads_bytes": m.host_grads_bytes,
        "host_optimizer_bytes": m.host_optimizer_bytes,
        "host_bytes": m.host_bytes,
    }


# the peak's parts and the step time's parts as the reports name them (the optimizer's step is a part of compute)
MEMORY_PARTS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer state"),
                ("activations_bytes", "saved activations"), ("temp_bytes", "largest temporary"))
TIME_PARTS = (("compute_s", "compute"), ("update_s", "  of which optimizer step"), ("comm_s", "communication"),
              ("recompute_s", "recompute"), ("offload_s", "host tier (copies, host optimizer step)"))


def time_dict(t: TimeBreakdown) -> dict[str, float]:
    return {"compute_s": t.compute_s, "update_s": t.update_s, "comm_s": t.comm_s, "recompute_s": t.recompute_s,
            "offload_s": t.offload_s, "total_s": t.total_s}


def unrecorded(plan: Plan) -> list[str]:
    """What a plan file written by an older autopar lacks, and so what its reports cannot tell."""
    out = []
    if plan.params and all(p.layout == "" for p in plan.params):
        out.append(OLD_PLAN_FILE)
    if not plan.memory_timeline:
        out.append(NO_TIMELINE)
    return out


def summarize(plan: Plan) -> dict[str, Any]:
    zero = [p.fqn for p in plan.params if p.zero]
    baselines = []
    for b in plan.baselines:
        baselines.append({
            "name": b.name,
            "words": baseline_words(b.name),
            "step_s": None if b.time is None else b.time.total_s,
            "memory_bytes": None if b.memory is None else b.memory.total_bytes,
            "fits": b.fits,
            # > 1: the plan is that many times faster than this baseline under the same cost model
            "plan_speedup": None if b.time is None or plan.time.total_s <= 0 else b.time.total_s / plan.time.total_s,
        })
    return {
        "model": plan.made_for(),
        "mesh": {
            "axes": [{"name": a.name, "size": a.size} for a in plan.mesh.axes],
            "devices": plan.mesh.num_devices,
            "hardware": plan.mesh.hardware,
        },
        "layers": [
            {"module": r.module, "count": r.count, "params": r.params, "output": r.output, "recompute": r.recompute, "kind": r.kind}
            for r in rollup(plan)
        ],
        # the device's fixed overheads (CUDA context, cuBLAS workspace, NCCL buffers) beside the step's tensors
        "memory": {**memory_dict(plan.memory), "overhead_bytes": plan.mesh.overhead_bytes()},
        "memory_timeline": [{"at": where, "bytes": nbytes} for where, nbytes in plan.memory_timeline],
        "time": time_dict(plan.time),
        "comm_bytes_by_kind": dict(plan.comm_bytes_by_kind),
        "baselines": baselines,
        "zero_params": len(zero),
        "params": len(plan.params),
        "recomputed_nodes": len(plan.recomputed()),
        "solver": {
            "backend": plan.solver.backend,
            "status": plan.solver.status,
            "solve_s": plan.solver.solve_s,
            "num_variables": plan.solver.num_variables,
            "num_constraints": plan.solver.num_constraints,
            "gap": plan.solver.gap,
        },
        "notes": list(plan.notes),
        "unrecorded": unrecorded(plan),
    }
