"""`autopar explain` and `autopar diff`: why a node got its strategy, and what changed between two plans.

    explain(plan, "transformer.h.0.mlp.c_fc", ctx)  # chosen strategy + every alternative's cost
    diff(plan_a, plan_b)                            # changed decisions + predicted time/memory deltas

Alternatives are priced with the solver's own cost model (`autopar.solver.cost`
for compute and in-strategy collectives, `autopar.solver.reshard` for
resharding the inputs from what their producers chose in the plan), so the
numbers are the ones the ILP compared. An option that costs less at the node
than the chosen one is priced once more as the whole plan with only that
decision changed (`evaluate.evaluate`): that says why it lost (it does not fit, or
it costs more elsewhere than it saves at the node).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from autopar.errors import AutoparError
from autopar.profiler.types import ConcreteProfile
from autopar.report.layers import rollup, split_block
from autopar.report.summary import memory_dict, summarize, time_dict, unrecorded
from autopar.report.tables import headline, mesh_line
from autopar.report.units import fmt_bytes, fmt_seconds, fmt_signed_seconds
from autopar.report.words import LAYOUT_WORDS, LEGEND, activation_words, param_words
from autopar.solver.plan import MemoryBreakdown, NodeDecision, ParamDecision, Plan, TimeBreakdown
from autopar.solver.problem import Assignment, BuiltProblem
from autopar.solver.spec import Strategy
from autopar.tracer import TracedGraph, output_vals
from autopar.tracer.nodes import differentiable


@dataclass(frozen=True)
class ExplainContext:
    """What pricing alternatives needs beyond the plan: the re-traced model, its costs, its strategies, and the
    solver's problem with one node per graph node, on which the plan with one decision changed is priced."""

    traced: TracedGraph
    costs: ConcreteProfile
    strategies: Mapping[str, tuple[Strategy, ...]]
    built: BuiltProblem
    planned: Assignment | None  # the plan on `built`; None when a decision is no strategy the solver enumerates


def make_context(plan: Plan, traced: TracedGraph, costs: ConcreteProfile) -> ExplainContext:
    """The context for explaining `plan` of the model `traced` (the solver's own strategies and problem, not a copy)."""
    from autopar.solver.problem import build_problem
    from autopar.solver.strategies import enumerate_strategies

    strategies = enumerate_strategies(traced, plan.mesh)
    built = build_problem(traced, costs, plan.mesh, strategies, plan.memory.budget_bytes, grouped=False)
    return ExplainContext(traced, costs, strategies, built, _planned(plan, built))


def _planned(plan: Plan, built: BuiltProblem) -> Assignment | None:
    decisions = {d.node: d for d in plan.nodes}
    zero = {p.node for p in plan.params if p.zero}
    choice, recompute = [], []
    for node in built.problem.nodes:
        d = decisions.get(node.name)
        options = built.strategies[node.name]
        if d is None or d.strategy not in options:
            return None
        choice.append(options.index(d.strategy))
        recompute.append(d.recompute)
    host = {p.node for p in plan.params if p.tier == "host"}
    return Assignment(tuple(choice), tuple(recompute), tuple(n.name in zero for n in built.problem.nodes),
                      tuple(n.name in host for n in built.problem.nodes) if host else ())


def other_tier(plan: Plan, node: str, ctx: ExplainContext) -> dict[str, Any] | None:
    """The plan priced with parameter node `node` on the other tier (`solver.offload`), every other decision as
    planned: its step, device peak and host bytes; None for a parameter the optimizer does not step."""
    from autopar.solver.evaluate import evaluate

    a = ctx.planned
    v = ctx.built.grouping.cluster_of[node]
    if a is None or ctx.built.problem.nodes[v].options[a.choice[v]].host is None:
        return None
    flags = list(a.offload or (False,) * len(a.choice))
    flags[v] = not flags[v]
    memory, time = evaluate(ctx.built.problem, replace(a, offload=tuple(flags)))
    return {"tier": "host" if flags[v] else "device", "step_s": time.total_s, "peak_bytes": memory.total_bytes,
            "host_bytes": memory.host_bytes, "fits": plan.memory.budget_bytes is None or memory.total_bytes <= plan.memory.budget_bytes}


def host_tier(plan: Plan, p: ParamDecision, ctx: ExplainContext) -> dict[str, Any] | None:
    """Parameter `p` on the host tier: what it keeps per rank on the host and on the device, and what the tier costs
    a step (`solver.offload.tier_cost`, as the solver priced it): ZeRO-Offload's layout (`lean`: its bf16 copy alone on
    the device) where mixed precision computes it on a copy and it is not ZeRO-sharded, else the float32 one (its
    parameter and gradient kept on the device too). None on the device tier, or for a parameter nothing steps."""
    from autopar.solver.offload import storage_shard, tier_cost

    param = ctx.costs.params.get(p.fqn)
    if p.tier != "host" or param is None or not param.optimizer_bytes:
        return None
    use, stored = storage_shard(p.use, plan.mesh), storage_shard(p.storage, plan.mesh)
    tier = tier_cost(param, use, plan.mesh).layout(stored / use)
    device_bytes = param.copy_bytes / use if tier.lean else (param.param_bytes + param.grad_bytes) / stored
    return {"lean": tier.lean, "device_bytes": device_bytes, "host_params_bytes": tier.host_params_bytes,
            "host_grads_bytes": tier.host_grads_bytes, "host_optimizer_bytes": tier.host_optimizer_bytes,
            "transfer_s": tier.transfer_s, "host_step_s": tier.host_step_s, "step_s": tier.step_s}


def _with_option(ctx: ExplainContext, node: str, k: int) -> tuple[MemoryBreakdown, TimeBreakdown]:
    """The plan priced with graph node `node` taking its strategy `k`, every other decision as planned (ZeRO
    storage kept where strategy `k` has one; each parameter's tier kept)."""
    from autopar.solver.evaluate import evaluate

    a = ctx.planned
    assert a is not None
    v = ctx.built.grouping.cluster_of[node]
    option = ctx.built.problem.nodes[v].options[k]
    changed = Assignment(a.choice[:v] + (k,) + a.choice[v + 1:], a.recompute,
                         a.zero[:v] + (a.zero[v] and option.zero is not None,) + a.zero[v + 1:], a.offload)
    return evaluate(ctx.built.problem, changed)


def find_nodes(plan: Plan, query: str) -> tuple[NodeDecision, ...]:
    """A node by fx name, a parameter by FQN, or every node of a module path (and its submodules)."""
    by_name = {d.node: d for d in plan.nodes}
    if query in by_name:
        return (by_name[query],)
    for p in plan.params:
        if p.fqn == query and p.node in by_name:
            return (by_name[p.node],)
    prefix = query.rstrip(".") + "."
    param_nodes = {p.node for p in plan.params if p.fqn.startswith(prefix)}
    hits = tuple(d for d in plan.nodes if d.module == query or d.module.startswith(prefix) or d.node in param_nodes)
    if hits:
        return hits
    modules = sorted({d.module for d in plan.nodes if d.module})
    close = [m for m in modules if query.split(".")[-1] in m][:3] or modules[:3]
    raise AutoparError(f"no node, parameter or module named {query!r} in the plan\n  fix: use a node name or module path from the plan, e.g. {', '.join(close)}")


def _concrete_shape(val: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s.node.hint) if isinstance(s, torch.SymInt) and s.node.has_hint() else int(s) for s in val.shape)


def alternatives(plan: Plan, decision: NodeDecision, ctx: ExplainContext) -> list[dict[str, Any]]:
    """Every strategy of the node, priced: compute, in-strategy comm, resharding of inputs, saved bytes.
    A parameter's compute is the optimizer's step on the block each device holds, as the ILP prices it."""
    from autopar.solver.cost import optimizer_step_s, strategy_cost  # the solver's own formulas, not a copy
    from autopar.solver.problem import in_node_comm_s
    from autopar.solver.reshard import reshard_cost
    from autopar.solver.strategies import strategy_inputs

    node = ctx.traced.node(decision.node)
    cost = ctx.costs.nodes.get(decision.node)
    mesh = plan.mesh
    vals = output_vals(node)
    out_shapes = [None if v is None else _concrete_shape(v) for v in vals]
    inputs = strategy_inputs(node)
    in_vals = [output_vals(src)[i] if i < len(output_vals(src)) else None for src, i in inputs]
    in_bytes = [0.0 if v is None else float(math.prod(_concrete_shape(v)) * v.element_size()) for v in in_vals]
    chosen_by_name = {d.node: d for d in plan.nodes}
    param = next((ctx.costs.params[p.fqn] for p in plan.params if p.node == decision.node and p.fqn in ctx.costs.params), None)
    rows = []
    for strat in ctx.strategies.get(decision.node, ()):
        if param is not None:
            compute_s, comm_s = optimizer_step_s(param, strat.output_specs[0].shard_factor(mesh.shape), mesh), 0.0
        else:
            compute_s, comm_s = strategy_cost(cost, strat, out_shapes, mesh, in_bytes) if cost is not None else (0.0, 0.0)
        comm_s += in_node_comm_s(node, strat, mesh)[0]
        reshard_s = 0.0
        for (src, idx), want, val in zip(inputs, strat.input_specs, in_vals):
            prod = chosen_by_name.get(src.name)
            if prod is None or want is None or val is None or idx >= len(prod.strategy.output_specs):
                continue
            have = prod.strategy.output_specs[idx]
            if have is not None and have != want:
                reshard_s += reshard_cost(have, want, _concrete_shape(val), val.element_size(), mesh, differentiable(val))
        saved = 0.0
        if cost is not None:
            for i, (b, keep) in enumerate(zip(cost.output_bytes, cost.saved_outputs)):
                spec = strat.output_specs[i] if i < len(strat.output_specs) else None
                if keep:
                    saved += b / (spec.shard_factor(mesh.shape) if spec is not None else 1)
        rows.append({
            "strategy": str(strat),
            "compute_s": compute_s,
            "comm_s": comm_s,
            "reshard_s": reshard_s,
            "total_s": compute_s + comm_s + reshard_s,
            "saved_bytes": saved,
            "chosen": strat == decision.strategy,
        })
    _why_not(plan, decision, ctx, rows)
    return sorted(rows, key=lambda r: (r["total_s"], not r["chosen"]))


def _why_not(plan: Plan, decision: NodeDecision, ctx: ExplainContext, rows: list[dict[str, Any]]) -> None:
    """Each row's whole-plan step and peak and its `why` (`rows` in the order of the node's strategies). An option
    dearer at the node lost there; one cheaper there is priced as the plan with this node's option changed and
    every other decision kept (relative to the plan's own numbers): it does not fit, or what it costs elsewhere (its consumers' reshards, their gradient
    sync) outweighs what it saves at the node."""
    chosen = next((r for r in rows if r["chosen"]), None)
    base = None if ctx.planned is None else evaluate_plan(ctx)
    for k, r in enumerate(rows):
        r.update(step_s=None, peak_bytes=None, fits=None)
        if r["chosen"]:
            r.update(step_s=plan.time.total_s, peak_bytes=plan.memory.total_bytes, fits=True, why="chosen")
        elif chosen is None:
            r["why"] = "the plan's own strategy is not among these"
        elif r["total_s"] > chosen["total_s"]:
            r["why"] = f"costs {fmt_seconds(r['total_s'] - chosen['total_s'])} more here"
        elif base is None:
            r["why"] = "not priced on the whole plan: the plan's strategies are not all the solver's"
        else:
            memory, time = _with_option(ctx, decision.node, k)
            r.update(step_s=plan.time.total_s + time.total_s - base[1].total_s,
                     peak_bytes=plan.memory.total_bytes + memory.total_bytes - base[0].total_bytes)
            r.update(fits=plan.memory.budget_bytes is None or r["peak_bytes"] <= plan.memory.budget_bytes * (1 + 1e-9))
            r["why"] = _why(plan, r, chosen["total_s"] - r["total_s"])


def _why(plan: Plan, r: dict[str, Any], saved_here_s: float) -> str:
    """Why an option no dearer at the node than the chosen one lost, from its whole-plan step and peak."""
    if not r["fits"]:
        return f"does not fit: the plan's peak would be {fmt_bytes(r['peak_bytes'])}, over the {fmt_bytes(plan.memory.budget_bytes)} budget"
    extra_s = r["step_s"] - plan.time.total_s
    if extra_s > plan.time.total_s * 1e-6:
        saves = f"outweighs the {fmt_seconds(saved_here_s)} it saves here" if saved_here_s > 1e-9 else "where it is no cheaper here"
        return f"step {fmt_signed_seconds(extra_s)}: what it costs elsewhere (reshards, gradient sync) {saves}"
    if r["peak_bytes"] >= plan.memory.total_bytes:
        return f"as fast ({fmt_signed_seconds(extra_s)}) and as lean: a tie"
    return f"as fast ({fmt_signed_seconds(extra_s)}) and leaner: the solver stopped ({plan.solver.status}) before it"


def evaluate_plan(ctx: ExplainContext) -> tuple[MemoryBreakdown, TimeBreakdown]:
    """The plan as `ctx.built` prices it: the base the changed plans are compared with."""
    from autopar.solver.evaluate import evaluate

    assert ctx.planned is not None
    return evaluate(ctx.built.problem, ctx.planned)


def explain(plan: Plan, query: str, ctx: ExplainContext | None = None) -> dict[str, Any]:
    axis_names = plan.mesh.axis_names
    params_by_node = {p.node: p for p in plan.params}
    ndims = {fqn: len(shape) for fqn, shape in plan.fingerprint.param_shapes}
    out = []
    for d in find_nodes(plan, query):
        p = params_by_node.get(d.node)
        entry: dict[str, Any] = {
            "node": d.node,
            "op": d.op,
            "module": p.fqn.rpartition(".")[0] if p is not None else d.module,
            "strategy": str(d.strategy),
            "output": activation_words(d.strategy.output_specs[0] if d.strategy.output_specs else None, axis_names),
            "recompute": d.recompute,
        }
        if p is not None:
            entry.update(parameter=p.fqn, use=str(p.use), storage=str(p.storage), layout=LAYOUT_WORDS[p.layout], tier=p.tier,
                         words=param_words(p, axis_names, ndims.get(p.fqn)))
        if ctx is not None:
            entry["alternatives"] = alternatives(plan, d, ctx)
            if p is not None and (other := other_tier(plan, d.node, ctx)) is not None:
                entry["other_tier"] = other
            if p is not None and (held := host_tier(plan, p, ctx)) is not None:
                entry["host_tier"] = held
        out.append(entry)
    s = summarize(plan)
    return {"query": query, "mesh": mesh_line(s), "headline": headline(s), "legend": LEGEND.format(axes=", ".join(axis_names)),
            "step_s": plan.time.total_s, "peak_bytes": plan.memory.total_bytes, "nodes": out, "priced": ctx is not None,
            "model_file": plan.source.model_file if plan.source else "", "unrecorded": s["unrecorded"]}


# ---------------------------------------------------------------- diff
def _delta(a: Mapping[str, float | None], b: Mapping[str, float | None]) -> dict[str, float | None]:
    return {k: None if a[k] is None or b[k] is None else b[k] - a[k] for k in a}


def _per_module(plan: Plan) -> dict[str, str]:
    return {m: f"{r.params} | {r.output} | recompute {r.recompute}" for r in rollup(plan) for m in r.members}


def _changed_layers(a: Plan, b: Plan) -> list[dict[str, Any]]:
    """Modules whose decisions differ; consecutive blocks with the same change merged, as in the report."""
    before, after = _per_module(a), _per_module(b)
    groups: dict[tuple, list[int | None]] = {}
    for module in list(after) + [m for m in before if m not in after]:
        old, new = before.get(module, "-"), after.get(module, "-")
        if old != new:
            prefix, idx, rest = split_block(module)
            groups.setdefault((prefix, rest, old, new), []).append(idx)
    out = []
    for (prefix, rest, old, new), indices in groups.items():
        if indices == [None]:
            out.append({"module": prefix, "count": 1, "a": old, "b": new})
            continue
        runs: list[list[int]] = []
        for i in sorted(indices):
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for r in runs:
            label = f"{prefix}{r[0]}{rest}" if len(r) == 1 else f"{prefix}{r[0]}..{r[-1]}{rest}"
            out.append({"module": label, "count": len(r), "a": old, "b": new})
    return out


def diff(a: Plan, b: Plan) -> dict[str, Any]:
    """What `b` decides differently from `a`, per layer and per node, and the predicted effect."""
    da, db = {d.node: d for d in a.nodes}, {d.node: d for d in b.nodes}
    changed = [
        {"node": n, "op": da[n].op, "module": da[n].module, "a": str(da[n].strategy), "b": str(db[n].strategy),
         "recompute_a": da[n].recompute, "recompute_b": db[n].recompute}
        for n in da if n in db and (da[n].strategy != db[n].strategy or da[n].recompute != db[n].recompute)
    ]
    pa, pb = {p.fqn: p for p in a.params}, {p.fqn: p for p in b.params}
    params = [
        {"param": f, "a": f"use {pa[f].use}, storage {pa[f].storage}, {pa[f].tier}",
         "b": f"use {pb[f].use}, storage {pb[f].storage}, {pb[f].tier}"}
        for f in pa if f in pb and (pa[f].use, pa[f].storage, pa[f].tier) != (pb[f].use, pb[f].storage, pb[f].tier)
    ]
    layers = _changed_layers(a, b)
    mesh_changed = a.mesh.shape != b.mesh.shape or a.mesh.axis_names != b.mesh.axis_names or a.mesh.hardware != b.mesh.hardware
    return {
        "mesh": {"a": str(a.mesh), "b": str(b.mesh), "changed": mesh_changed},
        "model_a": a.made_for(),
        "model_b": b.made_for(),
        "unrecorded": sorted(set(unrecorded(a)) | set(unrecorded(b))),
        "same_model": (a.fingerprint.ops_sha, a.fingerprint.params_sha) == (b.fingerprint.ops_sha, b.fingerprint.params_sha),
        "layers": layers,
        "nodes": changed,
        "only_in_a": sorted(set(da) - set(db)),
        "only_in_b": sorted(set(db) - set(da)),
        "params": params,
        "time_a": time_dict(a.time),
        "time_delta": _delta(time_dict(a.time), time_dict(b.time)),
        "memory_a": memory_dict(a.memory),
        "memory_delta": _delta(memory_dict(a.memory), memory_dict(b.memory)),
    }
