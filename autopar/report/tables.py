"""The plan report as plain tables and lines, before any styling: what the terminal and the HTML page both draw.

    for t in report_tables(summarize(plan)): ...   # title, columns, rows of text

`render.py` turns these into rich tables, `html.py` into HTML ones: the words and numbers are
made here once, so the two cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.report.summary import MEMORY_PARTS, TIME_PARTS
from autopar.report.units import fmt_bytes, fmt_seconds
from autopar.report.words import collective_words

KIND_MEANING = {
    "replicated": "replicated on every device",
    "data": "split by batch only (data parallel)",
    "tensor": "tensor parallel (weights or hidden dims split)",
    "partial": "partial sums pending a reduction",
}


@dataclass(frozen=True)
class TableData:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    right: frozenset[int] = frozenset()  # columns of numbers, right-aligned
    kinds: tuple[str, ...] = ()  # per row: its `KIND_MEANING` class, for colour (the layer table)
    strong: frozenset[int] = frozenset()  # rows in bold (totals)
    alarm: frozenset[tuple[int, int]] = frozenset()  # (row, column) cells that say something went wrong


def _pct(part: float, whole: float | None) -> str:
    if not whole:
        return "-"
    return "<1%" if 0 < part / whole < 0.005 else f"{100 * part / whole:.0f}%"


def mesh_line(s: dict[str, Any]) -> str:
    m = s["mesh"]
    return "Mesh " + " x ".join(f"{a['name']}={a['size']}" for a in m["axes"]) + f"  ({m['devices']} devices, {m['hardware']})"


def headline(s: dict[str, Any]) -> str:
    """The plan in one sentence: its model, step time and peak."""
    m, budget = s["memory"], s["memory"]["budget_bytes"]
    model = f"{s['model']}: " if s["model"] else ""
    return (f"{model}predicted step {fmt_seconds(s['time']['total_s'])}, peak {fmt_bytes(m['total_bytes'])} per device"
            + (f" of a {fmt_bytes(budget)} budget" if budget else ""))


def solver_line(s: dict[str, Any]) -> str:
    sv = s["solver"]
    gap = f", gap {100 * sv['gap']:.1f}%" if sv["gap"] else ""
    return (f"Solver: {sv['backend']} {sv['status']}{gap} in {sv['solve_s']:.2f} s ({sv['num_variables']:,} variables); "
            f"{s['zero_params']} of {s['params']} parameters ZeRO-sharded, {s['recomputed_nodes']} nodes recomputed")


def layers_table(s: dict[str, Any]) -> TableData:
    rows = tuple((r["module"], str(r["count"]), r["params"], r["output"], r["recompute"]) for r in s["layers"])
    return TableData("Per layer (repeated blocks shown once)", ("module", "x", "parameters", "output activation", "recomputed"),
                     rows, frozenset({1}), tuple(r["kind"] for r in s["layers"]))


def memory_table(s: dict[str, Any]) -> TableData:
    m, budget = s["memory"], s["memory"]["budget_bytes"]
    rows = [(label, fmt_bytes(m[key]), _pct(m[key], m["total_bytes"])) for key, label in MEMORY_PARTS]
    rows.append(("peak", fmt_bytes(m["total_bytes"]), _pct(m["total_bytes"], budget) + " of budget" if budget else ""))
    rows.append(("budget", fmt_bytes(budget), ""))
    peak_row = len(rows) - 2
    if m.get("overhead_bytes"):  # the default budget is the device's memory less these
        rows.append(("device overheads (CUDA context, cuBLAS, NCCL)", fmt_bytes(m["overhead_bytes"]), "beside the budget"))
    columns = ("part", "bytes", "share")
    if m.get("host_bytes"):  # parameters on the host tier: what each part keeps in host memory, beside the device's
        host = {key: m.get(f"host_{key}", 0.0) for key in ("params_bytes", "grads_bytes", "optimizer_bytes")}
        host["total_bytes"] = m["host_bytes"]
        keys = [key for key, _ in MEMORY_PARTS] + ["total_bytes"]
        rows = [(*row, fmt_bytes(host[key]) if key in host else "") for row, key in zip(rows, keys)] + \
               [(*row, "") for row in rows[len(keys):]]
        columns = ("part", "device bytes", "share", "host bytes")
    return TableData("Memory per device (at the step's peak)", columns, tuple(rows),
                     frozenset(range(1, len(columns))), strong=frozenset({peak_row}))


def time_table(s: dict[str, Any]) -> TableData:
    tm = s["time"]
    rows = [(label, fmt_seconds(tm[key]), _pct(tm[key], tm["total_s"])) for key, label in TIME_PARTS]
    rows.append(("total", fmt_seconds(tm["total_s"]), ""))
    return TableData("Predicted step time", ("part", "time", "share"), tuple(rows), frozenset({1, 2}), strong=frozenset({len(rows) - 1}))


def comm_table(s: dict[str, Any]) -> TableData | None:
    vols = s["comm_bytes_by_kind"]
    if not vols:
        return None
    rows = tuple((collective_words(kind), fmt_bytes(nbytes)) for kind, nbytes in sorted(vols.items(), key=lambda kv: -kv[1]))
    return TableData("Communication per device", ("collective", "bytes"), rows, frozenset({1}))


def baselines_table(s: dict[str, Any]) -> TableData | None:
    if not s["baselines"]:
        return None
    rows = [("autopar", fmt_seconds(s["time"]["total_s"]), fmt_bytes(s["memory"]["total_bytes"]), "yes", "")]
    for b in s["baselines"]:
        speed = "-" if b["plan_speedup"] is None else f"{b['plan_speedup']:.2f}x faster"
        rows.append((b["words"], fmt_seconds(b["step_s"]), fmt_bytes(b["memory_bytes"]), "yes" if b["fits"] else "no", speed))
    alarm = frozenset((i, 3) for i, b in enumerate(s["baselines"], start=1) if not b["fits"])
    return TableData("Same cost model, textbook plans", ("plan", "step time", "memory/device", "fits", "autopar is"),
                     tuple(rows), frozenset({1, 2, 3, 4}), strong=frozenset({0}), alarm=alarm)


def report_tables(s: dict[str, Any]) -> list[TableData]:
    """The report's tables in reading order."""
    return [t for t in (layers_table(s), memory_table(s), time_table(s), comm_table(s), baselines_table(s)) if t is not None]
