"""A pipeline plan's report: its mesh, schedule and bubble, and which layers each stage holds.

    console.print(*pipeline_report(pipeline_summary(plan)))

`pipeline_summary` is the report's data (what `autopar plan --json` prints for a pipeline plan); each
stage's own plan is an ordinary plan, shown with `autopar show` after `autopar.pipeline.plan`'s JSON.
"""
from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from autopar.pipeline.choose import describe
from autopar.pipeline.plan import PipelinePlan
from autopar.report.units import fmt_bytes, fmt_seconds


def _layer_span(layers: tuple[str, ...]) -> str:
    """'transformer.h.0 .. transformer.h.11 (12)', or the one layer, or '-'."""
    if not layers:
        return "-"
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)})"


def pipeline_summary(plan: PipelinePlan) -> dict[str, Any]:
    t = plan.time
    stages = []
    for i, s in enumerate(plan.stages):
        held = [name for name, flag in (("embeddings", s.has_embedding), ("head and loss", s.has_head)) if flag]
        stages.append({"stage": i, "pp_rank": plan.rank_of(i), "layers": list(s.layers), "also": held,
                       "micro_s": t.stage_s[i], "memory_bytes": plan.memory_bytes[plan.rank_of(i)],
                       "zero": sum(p.zero for p in s.plan.params), "recomputed": len(s.plan.recomputed())})
    return {"kind": "pipeline", "model": plan.model, "layout": describe(plan), "hardware": plan.mesh.hardware,
            "schedule": plan.schedule, "microbatches": plan.microbatches, "virtual": plan.virtual,
            "step_s": t.step_s, "bubble_s": t.bubble_s, "bubble_fraction": t.bubble_fraction, "p2p_s": t.p2p_s,
            "sync_s": t.sync_s, "update_s": t.update_s, "budget_bytes": plan.budget_bytes,
            "peak_bytes": max(plan.memory_bytes), "stages": stages, "notes": list(plan.notes)}


def pipeline_report(s: dict[str, Any]) -> list:
    """Renderables in reading order."""
    budget = f" of {fmt_bytes(s['budget_bytes'])}" if s["budget_bytes"] else ""
    parts: list = [
        Text(f"{s['model']}: pipeline {s['layout']} on {s['hardware']}", style="bold"),
        Text(f"predicted step {fmt_seconds(s['step_s'])}: bubble {fmt_seconds(s['bubble_s'])} "
             f"({s['bubble_fraction']:.0%}), sends {fmt_seconds(s['p2p_s'])} a micro-batch at the slowest boundary, "
             f"gradient sync {fmt_seconds(s['sync_s'])}, optimizer {fmt_seconds(s['update_s'])}; peak memory "
             f"{fmt_bytes(s['peak_bytes'])}{budget} per device"),
    ]
    table = Table(title="stages", title_justify="left")
    for col, right in (("stage", True), ("pp rank", True), ("layers", False), ("also", False),
                       ("fwd+bwd / micro-batch", True), ("rank memory", True), ("ZeRO params", True),
                       ("recomputed", True)):
        table.add_column(col, justify="right" if right else "left", overflow="fold")
    for st in s["stages"]:
        table.add_row(str(st["stage"]), str(st["pp_rank"]), _layer_span(tuple(st["layers"])), ", ".join(st["also"]),
                      fmt_seconds(st["micro_s"]), fmt_bytes(st["memory_bytes"]), str(st["zero"]), str(st["recomputed"]))
    parts.append(table)
    parts += [Text(f"note: {n}", style="yellow") for n in s["notes"]]
    return parts
