"""`autopar explain` and `autopar diff` for the terminal: their results (`explain.py`) as rich renderables.

    console.print(*explain_report(explain(plan, "transformer.h.0.mlp", ctx)))
    console.print(*diff_report(diff(a, b), "a.json", "b.json"))
"""
from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from autopar.report.units import fmt_bytes, fmt_seconds, fmt_signed_bytes, fmt_signed_seconds

MAX_ALTERNATIVES = 8  # per node in the table; --json lists them all


def _alternatives_table(alts: list[dict[str, Any]]) -> Table:
    t = Table(show_edge=False)
    for col in ("", "strategy", "compute", "comm", "reshard in", "at this node", "plan's step", "plan's peak", "why not chosen"):
        t.add_column(col, justify="left" if col in ("", "strategy", "why not chosen") else "right", overflow="fold")
    shown = alts[:MAX_ALTERNATIVES] + [a for a in alts[MAX_ALTERNATIVES:] if a["chosen"]]
    for a in shown:
        t.add_row("chosen" if a["chosen"] else "", a["strategy"], fmt_seconds(a["compute_s"]), fmt_seconds(a["comm_s"]),
                  fmt_seconds(a["reshard_s"]), fmt_seconds(a["total_s"]), fmt_seconds(a["step_s"]), fmt_bytes(a["peak_bytes"]),
                  "" if a["chosen"] else a["why"], style="bold" if a["chosen"] else None)
    return t


def host_tier_words(t: dict[str, Any]) -> str:
    """What a parameter on the host tier keeps where, per rank, and its price (`explain.host_tier`)."""
    if t["lean"]:
        held = (f"its float32 master ({fmt_bytes(t['host_params_bytes'])}), its gradient ({fmt_bytes(t['host_grads_bytes'])}) "
                f"and its optimizer state ({fmt_bytes(t['host_optimizer_bytes'])}) are in host memory, stepped there; only its "
                f"bf16 copy ({fmt_bytes(t['device_bytes'])}) is on the device (ZeRO-Offload's layout)")
    else:
        held = (f"its master ({fmt_bytes(t['host_params_bytes'])}), a copy of its gradient ({fmt_bytes(t['host_grads_bytes'])}) "
                f"and its optimizer state ({fmt_bytes(t['host_optimizer_bytes'])}) are in host memory, stepped there; its "
                f"parameter and gradient stay on the device too ({fmt_bytes(t['device_bytes'])})")
    return (f"{held}, per rank; the host tier adds {fmt_seconds(t['step_s'])} to the step: {fmt_seconds(t['transfer_s'])} "
            f"of copies over the host link and {fmt_seconds(t['host_step_s'])} of the host's optimizer step")


def explain_report(result: dict[str, Any]) -> list:
    parts: list = [Text(result["mesh"], style="bold"), Text(result["headline"]), Text(result["legend"], style="dim")]
    for n in result["nodes"]:
        parts.append(Text(f"{n['node']} ({n['op']}) in {n['module'] or '(top level)'}: {n['strategy']}", style="bold"))
        if "parameter" in n:
            if "host_tier" in n:
                stepped = host_tier_words(n["host_tier"])
            elif n.get("tier") == "host":
                stepped = "its optimizer state is in host memory, stepped there"
            else:
                stepped = "its compute is the optimizer's step on each device's block"
            parts.append(Text(f"  parameter {n['parameter']} ({n['layout']}): {n['words']} (use {n['use']}, storage {n['storage']}); "
                              f"{stepped}"))
            if (other := n.get("other_tier")) is not None:
                where = "on the host tier" if other["tier"] == "host" else "with its optimizer state on the device"
                parts.append(Text(f"  {where} the plan's step would be {fmt_seconds(other['step_s'])} and its device peak "
                                  f"{fmt_bytes(other['peak_bytes'])} (host {fmt_bytes(other['host_bytes'])})"
                                  f"{'' if other['fits'] else ', over the budget'}"))
        parts.append(Text(f"  output: {n['output']}; recomputed in backward: {'yes' if n['recompute'] else 'no'}"))
        alts = n.get("alternatives")
        if alts:
            parts.append(_alternatives_table(alts))
            if len(alts) > MAX_ALTERNATIVES + 1:
                parts.append(Text(f"  ... {len(alts) - MAX_ALTERNATIVES} more alternatives, each dearer at this node (--json lists all)"))
    if result["nodes"] and result["priced"]:
        parts.append(Text("at this node: compute, collectives and input reshards of the option; plan's step and peak: the whole plan "
                          "with only this decision changed (priced for options cheaper at this node)", style="dim"))
    if not result["priced"]:
        # a plan's recorded model file is named, never imported: whoever wrote the plan must not choose the code that runs
        why = (f"the plan was made from {result['model_file']}, which explain never imports from a plan file"
               if result["model_file"] else "the plan records no model")
        parts.append(Text(f"alternatives not priced: {why}; pass --model MODEL.py", style="dim"))
    parts += [Text(f"note: {n}", style="dim") for n in result["unrecorded"]]
    return parts


def diff_report(d: dict[str, Any], name_a: str, name_b: str) -> list:
    parts: list = []
    if d["mesh"]["changed"]:
        parts.append(Text(f"mesh: {d['mesh']['a']} -> {d['mesh']['b']}"))
    if not d["same_model"]:
        models = f": {d['model_a'] or 'not recorded'} and {d['model_b'] or 'not recorded'}"
        parts.append(Text(f"note: the plans were made for different models{models}", style="yellow"))
    ta, dt = d["time_a"], d["time_delta"]
    ma, dm = d["memory_a"], d["memory_delta"]
    parts.append(Text(
        f"step time {fmt_seconds(ta['total_s'])} -> {fmt_seconds(ta['total_s'] + dt['total_s'])} ({fmt_signed_seconds(dt['total_s'])}: "
        f"compute {fmt_signed_seconds(dt['compute_s'])}, comm {fmt_signed_seconds(dt['comm_s'])}, recompute {fmt_signed_seconds(dt['recompute_s'])})"))
    parts.append(Text(
        f"peak memory {fmt_bytes(ma['total_bytes'])} -> {fmt_bytes(ma['total_bytes'] + dm['total_bytes'])} ({fmt_signed_bytes(dm['total_bytes'])}: "
        f"params {fmt_signed_bytes(dm['params_bytes'])}, optimizer {fmt_signed_bytes(dm['optimizer_bytes'])}, "
        f"activations {fmt_signed_bytes(dm['activations_bytes'])})"))
    if d["layers"]:
        t = Table(title="Changed layers", title_justify="left")
        for col in ("module", "before (params | output | recompute)", "after"):
            t.add_column(col, overflow="fold")
        for row in d["layers"]:
            t.add_row(row["module"], row["a"], row["b"])
        parts.append(t)
    only = (f"; {len(d['only_in_a'])} nodes only in {name_a}, {len(d['only_in_b'])} only in {name_b}"
            if d["only_in_a"] or d["only_in_b"] else "")
    parts.append(Text(f"{len(d['nodes'])} node decisions and {len(d['params'])} parameter placements differ{only}"))
    parts += [Text(f"note: {n}", style="dim") for n in d["unrecorded"]]
    return parts
