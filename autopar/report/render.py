"""The plan report as rich renderables: mesh, layers, memory, step time, communication, baselines.

    console.print(*plan_report(summarize(plan)))
"""
from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from autopar.report.summary import TIME_PARTS
from autopar.report.units import fmt_bytes, fmt_seconds

BASELINE_NAMES = {"data_parallel": "pure data parallel", "zero3": "ZeRO-3 / FSDP", "megatron": "Megatron TP + DP"}
KIND_STYLE = {"replicated": "white", "data": "green", "tensor": "magenta", "partial": "yellow"}


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def mesh_line(s: dict[str, Any]) -> Text:
    m = s["mesh"]
    axes = " x ".join(f"{a['name']}={a['size']}" for a in m["axes"])
    return Text.assemble(("Mesh ", "bold"), f"{axes}  ({m['devices']} devices, {m['hardware']})")


def layers_table(s: dict[str, Any]) -> Table:
    t = Table(title="Per layer (repeated blocks shown once)", title_justify="left", expand=False)
    for col in ("module", "x", "parameters", "output activation", "recomputed"):
        t.add_column(col, justify="right" if col == "x" else "left", overflow="fold")
    for r in s["layers"]:
        t.add_row(Text(r["module"], style=KIND_STYLE.get(r["kind"], "")), str(r["count"]), r["params"], r["output"], r["recompute"])
    return t


def memory_table(s: dict[str, Any]) -> Table:
    m = s["memory"]
    t = Table(title="Memory per device (at the step's peak)", title_justify="left")
    t.add_column("part")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    for key, label in (("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer state"),
                       ("activations_bytes", "saved activations"), ("temp_bytes", "largest temporary")):
        t.add_row(label, fmt_bytes(m[key]), _pct(m[key], m["total_bytes"]))
    budget = m["budget_bytes"]
    t.add_row(Text("peak", style="bold"), Text(fmt_bytes(m["total_bytes"]), style="bold"), _pct(m["total_bytes"], budget) + " of budget" if budget else "")
    t.add_row("budget", fmt_bytes(budget), "")
    if m.get("overhead_bytes"):  # the default budget is the device's memory less these
        t.add_row("device overheads (CUDA context, cuBLAS, NCCL)", fmt_bytes(m["overhead_bytes"]), "beside the budget")
    return t


def time_table(s: dict[str, Any]) -> Table:
    tm = s["time"]
    t = Table(title="Predicted step time", title_justify="left")
    t.add_column("part")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    for key, label in TIME_PARTS:
        t.add_row(label, fmt_seconds(tm[key]), _pct(tm[key], tm["total_s"]))
    t.add_row(Text("total", style="bold"), Text(fmt_seconds(tm["total_s"]), style="bold"), "")
    return t


def comm_table(s: dict[str, Any]) -> Table | None:
    vols = s["comm_bytes_by_kind"]
    if not vols:
        return None
    t = Table(title="Communication per device", title_justify="left")
    t.add_column("collective")
    t.add_column("bytes", justify="right")
    for kind, nbytes in sorted(vols.items(), key=lambda kv: -kv[1]):
        t.add_row(kind.replace("_", "-"), fmt_bytes(nbytes))
    return t


def baselines_table(s: dict[str, Any]) -> Table | None:
    if not s["baselines"]:
        return None
    t = Table(title="Same cost model, textbook plans", title_justify="left")
    for col in ("plan", "step time", "memory/device", "fits", "autopar is"):
        t.add_column(col, justify="left" if col == "plan" else "right")
    t.add_row(Text("autopar", style="bold"), fmt_seconds(s["time"]["total_s"]), fmt_bytes(s["memory"]["total_bytes"]), "yes", "")
    for b in s["baselines"]:
        speed = "-" if b["plan_speedup"] is None else f"{b['plan_speedup']:.2f}x faster"
        t.add_row(BASELINE_NAMES.get(b["name"], b["name"]), fmt_seconds(b["step_s"]), fmt_bytes(b["memory_bytes"]), "yes" if b["fits"] else Text("no", style="red"), speed)
    return t


def solver_line(s: dict[str, Any]) -> Text:
    sv = s["solver"]
    gap = f", gap {100 * sv['gap']:.1f}%" if sv["gap"] else ""
    return Text(
        f"Solver: {sv['backend']} {sv['status']}{gap} in {sv['solve_s']:.2f} s ({sv['num_variables']:,} variables); "
        f"{s['zero_params']} of {s['params']} parameters ZeRO-sharded, {s['recomputed_nodes']} nodes recomputed",
        style="dim",
    )


def plan_report(s: dict[str, Any]) -> list:
    """Renderables in reading order; print them with one rich Console."""
    parts: list = [mesh_line(s), layers_table(s), memory_table(s), time_table(s)]
    parts += [t for t in (comm_table(s), baselines_table(s)) if t is not None]
    parts.append(solver_line(s))
    parts += [Text(f"note: {n}", style="yellow") for n in s["notes"]]
    return parts
