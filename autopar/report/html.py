"""One self-contained HTML page for a plan: colour-coded layer list and a per-device memory timeline.

    write_html(summary, timeline, "plan.html")

No external assets (no scripts, fonts or stylesheets from the network): the chart
is an inline SVG polyline, so the file opens anywhere, offline.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Mapping, Sequence

from autopar.profiler.types import ConcreteProfile
from autopar.report.summary import TIME_PARTS
from autopar.report.units import fmt_bytes, fmt_seconds
from autopar.solver.plan import Plan

KIND_COLOUR = {"replicated": "#eeeeee", "data": "#c8f0c8", "tensor": "#ecd0f5", "partial": "#fbefb0"}
KIND_MEANING = {
    "replicated": "replicated on every device",
    "data": "split by batch only (data parallel)",
    "tensor": "tensor parallel (weights or hidden dims split)",
    "partial": "partial sums pending a reduction",
}


def memory_timeline(plan: Plan, profile: ConcreteProfile | None = None) -> list[tuple[str, float]]:
    """Per-device bytes after each op of forward then backward: static state + live saved activations.

    With a profile: each node's saved bytes (divided by how its output is sharded)
    are added in forward and freed in reverse in backward; a recomputed node's
    activations live only for the moment it is recomputed. Without one, the
    plan's own totals give a three-point ramp.
    """
    m = plan.memory
    static = m.params_bytes + m.grads_bytes + m.optimizer_bytes
    if profile is None:
        return [("start", static), ("end of forward", static + m.activations_bytes), ("end of backward", static)]
    mesh_shape = plan.mesh.shape
    saved: list[tuple[str, float, bool]] = []
    for d in plan.nodes:
        cost = profile.nodes.get(d.node)
        if cost is None:
            continue
        nbytes = cost.extra_saved_bytes
        for i, (b, keep) in enumerate(zip(cost.output_bytes, cost.saved_outputs)):
            spec = d.strategy.output_specs[i] if i < len(d.strategy.output_specs) else None
            if keep:
                nbytes += b / (spec.shard_factor(mesh_shape) if spec is not None else 1)
        if nbytes > 0:
            saved.append((d.node, nbytes, d.recompute))
    points, live = [("start", static)], static
    for name, nbytes, recompute in saved:
        if not recompute:
            live += nbytes
        points.append((f"fwd {name}", live))
    for name, nbytes, recompute in reversed(saved):
        points.append((f"bwd {name}", live + (nbytes if recompute else 0.0)))
        if not recompute:
            live -= nbytes
    points.append(("end of backward", live))
    return points


def _svg(points: Sequence[tuple[str, float]], budget: float | None, width: int = 760, height: int = 260) -> str:
    pad_l, pad_b, pad_t = 70, 30, 10
    peak = max(b for _, b in points)
    # A budget far above the peak would flatten the curve: then it is named in the corner instead of drawn.
    budget_drawn = budget is not None and budget <= 2 * peak
    top = (max(peak, budget) if budget_drawn else peak) * 1.1 or 1.0
    n = max(len(points) - 1, 1)

    def xy(i: int, b: float) -> tuple[float, float]:
        return pad_l + i * (width - pad_l - 10) / n, pad_t + (1 - b / top) * (height - pad_t - pad_b)

    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, b) for i, (_, b) in enumerate(points)))
    peak_i = max(range(len(points)), key=lambda i: points[i][1])
    px, py = xy(peak_i, points[peak_i][1])
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="memory timeline">',
        f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - 10}" y2="{height - pad_b}" stroke="#888"/>',
        f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{height - pad_b}" stroke="#888"/>',
        f'<text x="{pad_l - 5}" y="{pad_t + 10}" text-anchor="end" font-size="11">{html.escape(fmt_bytes(top))}</text>',
        f'<text x="{pad_l - 5}" y="{height - pad_b}" text-anchor="end" font-size="11">0</text>',
        f'<text x="{pad_l}" y="{height - 8}" font-size="11">forward &#8594;</text>',
        f'<text x="{width - 10}" y="{height - 8}" text-anchor="end" font-size="11">&#8592; backward ends</text>',
        f'<polyline fill="none" stroke="#3366cc" stroke-width="2" points="{line}"/>',
        f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#cc3333"><title>peak {html.escape(fmt_bytes(points[peak_i][1]))} at {html.escape(points[peak_i][0])}</title></circle>',
    ]
    if budget is not None and not budget_drawn:
        parts.append(f'<text x="{width - 12}" y="{pad_t + 10}" text-anchor="end" font-size="11" fill="#cc3333">budget {html.escape(fmt_bytes(budget))} (above the chart)</text>')
    elif budget is not None:
        _, by = xy(0, budget)
        parts.append(f'<line x1="{pad_l}" y1="{by:.1f}" x2="{width - 10}" y2="{by:.1f}" stroke="#cc3333" stroke-dasharray="6 4"/>')
        parts.append(f'<text x="{width - 12}" y="{by - 4:.1f}" text-anchor="end" font-size="11" fill="#cc3333">budget {html.escape(fmt_bytes(budget))}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], styles: Sequence[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        style = f' style="background:{styles[i]}"' if styles else ""
        body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_html(s: Mapping[str, Any], timeline: Sequence[tuple[str, float]]) -> str:
    mesh = " x ".join(f"{a['name']}={a['size']}" for a in s["mesh"]["axes"])
    legend = " ".join(f'<span class="chip" style="background:{c}">{html.escape(KIND_MEANING[k])}</span>' for k, c in KIND_COLOUR.items())
    layers = _table(
        ("module", "x", "parameters", "output activation", "recomputed"),
        [(r["module"], r["count"], r["params"], r["output"], r["recompute"]) for r in s["layers"]],
        [KIND_COLOUR.get(r["kind"], "#fff") for r in s["layers"]],
    )
    m, t = s["memory"], s["time"]
    memory = _table(("part", "bytes"), [(k.replace("_bytes", "").replace("_", " "), fmt_bytes(v)) for k, v in m.items()])
    step = _table(("part", "time"), [(label.strip(), fmt_seconds(t[k])) for k, label in TIME_PARTS]
                  + [("total", fmt_seconds(t["total_s"]))])
    comm = _table(("collective", "bytes per device"), [(k, fmt_bytes(v)) for k, v in s["comm_bytes_by_kind"].items()]) if s["comm_bytes_by_kind"] else ""
    base = ""
    if s["baselines"]:
        rows = [(b["name"], fmt_seconds(b["step_s"]), fmt_bytes(b["memory_bytes"]), "yes" if b["fits"] else "no",
                 "-" if b["plan_speedup"] is None else f"{b['plan_speedup']:.2f}x") for b in s["baselines"]]
        base = "<h2>Textbook plans, same cost model</h2>" + _table(("plan", "step time", "memory/device", "fits", "autopar speed-up"), rows)
    notes = "".join(f"<p class=note>{html.escape(n)}</p>" for n in s["notes"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>autopar plan: {html.escape(mesh)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; font-size: 13px; }}
.chip {{ padding: 2px 8px; margin-right: 6px; font-size: 12px; border: 1px solid #ccc; }}
.note {{ color: #8a6d00; }}
</style></head><body>
<h1>autopar plan</h1>
<p>Mesh {html.escape(mesh)} ({s['mesh']['devices']} devices, {html.escape(s['mesh']['hardware'])}).
Predicted step {html.escape(fmt_seconds(t['total_s']))}; peak memory {html.escape(fmt_bytes(m['total_bytes']))} per device
(budget {html.escape(fmt_bytes(m['budget_bytes']))}).</p>
<h2>Memory per device across the training step</h2>
{_svg(timeline, m['budget_bytes'])}
<h2>Layers</h2>
<p>{legend}</p>
{layers}
<h2>Memory at the peak</h2>{memory}
<h2>Step time</h2>{step}
{comm}
{base}
{notes}
</body></html>
"""


def write_html(s: Mapping[str, Any], timeline: Sequence[tuple[str, float]], path: str | Path) -> None:
    Path(path).write_text(render_html(s, timeline))
