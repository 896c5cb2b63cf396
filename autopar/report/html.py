"""One self-contained HTML page for a plan: the report's tables, colour-coded, and the memory model's timeline.

    write_html(summarize(plan), "plan.html")

The tables are `tables.py`'s, as the terminal prints them; the chart draws the plan's own
`memory_timeline`, whose highest point is the report's peak. No external assets (no scripts,
fonts or stylesheets from the network): the chart is an inline SVG, so the file opens anywhere, offline.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Mapping, Sequence

from autopar.report.tables import KIND_MEANING, TableData, headline, mesh_line, report_tables, solver_line
from autopar.report.units import fmt_bytes

KIND_COLOUR = {"replicated": "#eeeeee", "data": "#c8f0c8", "tensor": "#ecd0f5", "partial": "#fbefb0"}
LINE_COLOUR = "#3366cc"
PEAK_COLOUR = "#cc3333"

_W, _H = 860, 300
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 80, 20, 24, 34


def _e(text: object) -> str:
    return html.escape(str(text))


def _svg(points: Sequence[Mapping[str, Any]], budget: float | None) -> str:
    values = [p["bytes"] for p in points]
    peak_i = max(range(len(values)), key=values.__getitem__)
    peak, start = values[peak_i], values[0]
    # A budget far above the peak would flatten the curve: then it is named in the corner instead of drawn.
    budget_drawn = budget is not None and budget <= 2 * peak
    top = (max(peak, budget) if budget_drawn else peak) * 1.12 or 1.0
    n = max(len(points) - 1, 1)

    def x(i: float) -> float:
        return _PAD_L + i * (_W - _PAD_L - _PAD_R) / n

    def y(b: float) -> float:
        return _PAD_T + (1 - b / top) * (_H - _PAD_T - _PAD_B)

    base = _H - _PAD_B
    line = " ".join(f"{x(i):.1f},{y(b):.1f}" for i, b in enumerate(values))
    dots = "".join(f'<circle cx="{x(i):.1f}" cy="{y(b):.1f}" r="2" fill="{LINE_COLOUR}"><title>{_e(p["at"])}: {_e(fmt_bytes(b))}</title></circle>'
                   for i, (p, b) in enumerate(zip(points, values)))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" role="img" '
        f'aria-label="memory per device through one training step, peak {_e(fmt_bytes(peak))}">',
        f'<line x1="{_PAD_L}" y1="{base}" x2="{_W - _PAD_R}" y2="{base}" stroke="#888"/>',
        f'<line x1="{_PAD_L}" y1="{_PAD_T}" x2="{_PAD_L}" y2="{base}" stroke="#888"/>',
        f'<text x="{_PAD_L - 6}" y="{base}" text-anchor="end" font-size="11">0</text>',
        f'<line x1="{_PAD_L}" y1="{y(start):.1f}" x2="{_W - _PAD_R}" y2="{y(start):.1f}" stroke="#aaa" stroke-dasharray="3 3"/>',
        f'<text x="{_PAD_L - 6}" y="{y(start) + 4:.1f}" text-anchor="end" font-size="11">{_e(fmt_bytes(start))}</text>',
        f'<text x="{_PAD_L + 4}" y="{y(start) + 14:.1f}" font-size="11" fill="#777">parameters, gradients, optimizer state</text>',
        f'<line x1="{x(peak_i):.1f}" y1="{_PAD_T}" x2="{x(peak_i):.1f}" y2="{base}" stroke="#ccc"/>',
        f'<text x="{x(peak_i) - 6:.1f}" y="{_H - 12}" text-anchor="end" font-size="11">&#8592; forward</text>',
        f'<text x="{x(peak_i) + 6:.1f}" y="{_H - 12}" font-size="11">backward &#8594;</text>',
        f'<polyline fill="none" stroke="{LINE_COLOUR}" stroke-width="2" points="{line}"/>',
        dots,
        f'<circle cx="{x(peak_i):.1f}" cy="{y(peak):.1f}" r="5" fill="{PEAK_COLOUR}"><title>{_e(points[peak_i]["at"])}</title></circle>',
        f'<text x="{x(peak_i) + 8:.1f}" y="{y(peak) - 6:.1f}" font-size="12" fill="{PEAK_COLOUR}">peak {_e(fmt_bytes(peak))}</text>',
    ]
    if budget is not None and budget_drawn:
        parts.append(f'<line x1="{_PAD_L}" y1="{y(budget):.1f}" x2="{_W - _PAD_R}" y2="{y(budget):.1f}" stroke="{PEAK_COLOUR}" stroke-dasharray="6 4"/>')
        parts.append(f'<text x="{_W - _PAD_R}" y="{y(budget) - 4:.1f}" text-anchor="end" font-size="11" fill="{PEAK_COLOUR}">budget {_e(fmt_bytes(budget))}</text>')
    elif budget is not None:
        parts.append(f'<text x="{_W - _PAD_R}" y="{_PAD_T - 8}" text-anchor="end" font-size="11" fill="{PEAK_COLOUR}">budget {_e(fmt_bytes(budget))} (above the chart)</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _cell(t: TableData, row: int, col: int, text: str) -> str:
    classes = " ".join(name for name, on in (("num", col in t.right), ("alarm", (row, col) in t.alarm)) if on)
    return f'<td class="{classes}">{_e(text)}</td>' if classes else f"<td>{_e(text)}</td>"


def html_table(t: TableData) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in t.columns)
    body = []
    for r, row in enumerate(t.rows):
        style = f' style="background:{KIND_COLOUR.get(t.kinds[r], "#fff")}"' if t.kinds else ""
        cls = ' class="strong"' if r in t.strong else ""
        cells = "".join(_cell(t, r, c, v) for c, v in enumerate(row))
        body.append(f"<tr{style}{cls}>{cells}</tr>")
    return f"<h2>{_e(t.title)}</h2>\n<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_html(s: Mapping[str, Any]) -> str:
    legend = " ".join(f'<span class="chip" style="background:{c}">{_e(KIND_MEANING[k])}</span>' for k, c in KIND_COLOUR.items())
    tables = report_tables(s)
    chart = (_svg(s["memory_timeline"], s["memory"]["budget_bytes"]) if s["memory_timeline"]
             else "<p>(no chart: the plan file records no memory timeline)</p>")
    notes = "".join(f"<p class=note>note: {_e(n)}</p>" for n in s["notes"] + s["unrecorded"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>autopar plan: {_e(mesh_line(s))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; font-size: 13px; }}
td.num {{ text-align: right; }}
td.alarm {{ color: #cc3333; }}
tr.strong td {{ font-weight: bold; }}
.chip {{ padding: 2px 8px; margin-right: 6px; font-size: 12px; border: 1px solid #ccc; }}
.note {{ color: #8a6d00; }}
.dim {{ color: #777; }}
</style></head><body>
<h1>autopar plan</h1>
<p><b>{_e(mesh_line(s))}</b><br>{_e(headline(s))}</p>
<h2>Memory per device through one training step</h2>
{chart}
<p class=dim>As the memory model counts it: what stays through the step, each activation saved for backward as forward
reaches it, the largest transient on top of them all (the peak), then backward freeing them in reverse.</p>
<p>{legend}</p>
{chr(10).join(html_table(t) for t in tables)}
<p class=dim>{_e(solver_line(s))}</p>
{notes}
</body></html>
"""


def write_html(s: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(render_html(s))
