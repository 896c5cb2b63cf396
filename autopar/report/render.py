"""The plan report for the terminal: `tables.py`'s tables and lines as rich renderables.

    console.print(*plan_report(summarize(plan)))
"""
from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from autopar.report.tables import TableData, headline, mesh_line, report_tables, solver_line

KIND_STYLE = {"replicated": "white", "data": "green", "tensor": "magenta", "partial": "yellow"}


def rich_table(t: TableData) -> Table:
    table = Table(title=t.title, title_justify="left")
    for i, col in enumerate(t.columns):
        table.add_column(col, justify="right" if i in t.right else "left", overflow="fold")
    for r, row in enumerate(t.rows):
        cells: list[Text | str] = list(row)
        if t.kinds:  # the layer table: the module coloured by how it is split
            cells[0] = Text(row[0], style=KIND_STYLE.get(t.kinds[r], ""))
        for c in range(len(row)):
            if (r, c) in t.alarm:
                cells[c] = Text(row[c], style="red")
        table.add_row(*cells, style="bold" if r in t.strong else None)
    return table


def plan_report(s: dict[str, Any]) -> list:
    """Renderables in reading order; print them with one rich Console."""
    parts: list = [Text(mesh_line(s), style="bold"), Text(headline(s))]
    parts += [rich_table(t) for t in report_tables(s)]
    parts.append(Text(solver_line(s), style="dim"))
    parts += [Text(f"note: {n}", style="yellow") for n in s["notes"]]
    parts += [Text(f"note: {n}", style="dim") for n in s["unrecorded"]]
    return parts
