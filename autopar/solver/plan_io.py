"""Plans on disk: JSON in and out (never pickle), the fingerprint, and the mismatch check.

    save_plan(plan, "plan.json"); plan = load_plan("plan.json")
    check_plan(plan, traced, mesh, budget_bytes)   # raises PlanMismatchError listing what differs

Specs are stored as their compact strings ("S(0)R") and parsed back with
`Spec.parse`; nodes are stored by fx name and op, never by list index. Reading
a plan only parses JSON into frozen dataclasses: nothing in the file is
imported, unpickled or executed. A corrupt file raises `PlanFormatError`
naming the field ("plan.json: missing field 'nodes[3].strategy'").
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, get_args

import torch

from autopar.errors import PlanFormatError, PlanMismatchError
from autopar.solver.mesh import PRECISIONS, AxisGroup, LinkCost, Mesh, MeshAxis, device_fields_from_json
from autopar.solver.plan import (
    SCHEMA_VERSION,
    TIERS,
    BaselineResult,
    Fingerprint,
    MemoryBreakdown,
    NodeDecision,
    ParamDecision,
    Plan,
    PlanSource,
    SolverReport,
    TimeBreakdown,
    Tier,
)
from autopar.solver.spec import Shard, Spec, Strategy
from autopar.tracer import TracedGraph, output_vals
from autopar.tracer.param_layouts import Layout

_MAX_EXAMPLES = 3  # concrete differences named per category in a mismatch message


# ---------------------------------------------------------------- to JSON
def _mesh_dict(mesh: Mesh) -> dict:
    return mesh.to_json()  # one schema for plan files and calibrated mesh files


def _memory_dict(m: MemoryBreakdown) -> dict:
    return {k: getattr(m, k) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temp_bytes", "budget_bytes",
                                       "host_params_bytes", "host_grads_bytes", "host_optimizer_bytes")}


def _time_dict(t: TimeBreakdown) -> dict:
    return {"compute_s": t.compute_s, "comm_s": t.comm_s, "recompute_s": t.recompute_s, "update_s": t.update_s,
            "offload_s": t.offload_s}


def _spec_str(spec: Spec | None) -> str | None:
    return None if spec is None else str(spec)


def plan_to_dict(plan: Plan) -> dict:
    fp = plan.fingerprint
    src = plan.source
    return {
        "schema_version": plan.schema_version,
        "fingerprint": {
            "ops_sha": fp.ops_sha,
            "shapes_sha": fp.shapes_sha,
            "params_sha": fp.params_sha,
            "mesh_shape": list(fp.mesh_shape),
            "hardware": fp.hardware,
            "budget_bytes": fp.budget_bytes,
            "param_shapes": {fqn: list(shape) for fqn, shape in fp.param_shapes},
            "model": fp.model,
        },
        "mesh": _mesh_dict(plan.mesh),
        "nodes": [
            {
                "node": d.node,
                "op": d.op,
                "strategy": {"inputs": [_spec_str(s) for s in d.strategy.input_specs], "outputs": [_spec_str(s) for s in d.strategy.output_specs]},
                "recompute": d.recompute,
                "module": d.module,
            }
            for d in plan.nodes
        ],
        "params": [{"fqn": p.fqn, "node": p.node, "use": str(p.use), "storage": str(p.storage), "layout": p.layout, "tier": p.tier}
                   for p in plan.params],
        "memory": _memory_dict(plan.memory),
        "time": _time_dict(plan.time),
        "solver": {k: getattr(plan.solver, k) for k in ("backend", "status", "solve_s", "num_variables", "num_constraints", "gap")},
        "notes": list(plan.notes),
        "source": None if src is None else {k: getattr(src, k) for k in ("model_file", "hf_config", "batch_size", "seq_len", "size", "optimizer", "precision")},
        "comm_bytes_by_kind": {kind: b for kind, b in plan.comm_bytes_by_kind},
        "baselines": [
            {
                "name": b.name,
                "time": None if b.time is None else _time_dict(b.time),
                "memory": None if b.memory is None else _memory_dict(b.memory),
                "fits": b.fits,
            }
            for b in plan.baselines
        ],
        "memory_timeline": [[where, nbytes] for where, nbytes in plan.memory_timeline],
    }


def plan_to_json(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), indent=1)


# ---------------------------------------------------------------- from JSON
class JsonField:
    """A JSON value plus its path, so every format error names the exact field."""

    def __init__(self, value: Any, path: str, source: str):
        self.value, self.path, self.source = value, path, source

    def fail(self, what: str) -> PlanFormatError:
        return PlanFormatError(f"{self.source}: {what}")

    def __getitem__(self, key: str | int) -> "JsonField":
        path = f"{self.path}[{key}]" if isinstance(key, int) else (f"{self.path}.{key}" if self.path else key)
        if isinstance(key, int):
            if len(self.of(list)) <= key:
                raise self.fail(f"field '{self.path}' should have at least {key + 1} items, got {len(self.value)}")
            return JsonField(self.value[key], path, self.source)
        if not isinstance(self.value, dict):
            raise self.fail(f"field '{self.path}' should be an object, got {type(self.value).__name__}")
        if key not in self.value:
            raise self.fail(f"missing field '{path}'")
        return JsonField(self.value[key], path, self.source)

    def get(self, key: str, default: Any) -> "JsonField":
        return self[key] if isinstance(self.value, dict) and key in self.value else JsonField(default, key, self.source)

    def of(self, *types: type) -> Any:
        # bool is an int in Python; a count or size must not be accepted as true/false (or vice versa).
        ok = isinstance(self.value, types) and not (isinstance(self.value, bool) and bool not in types)
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise self.fail(f"field '{self.path}' should be {names}, got {json.dumps(self.value)[:40]}")
        return self.value

    def num(self, positive: bool = False, infinite: bool = False) -> float:
        """A number of bytes, seconds or a rate: never NaN nor below zero (nor zero, when `positive`); infinite only
        where that means something (`infinite`: a solver's gap with no bound)."""
        value = float(self.of(int, float))
        if math.isnan(value) or (math.isinf(value) and not infinite) or value < 0 or (positive and value == 0):
            wanted = "a number above zero" if positive else "a number of at least zero"
            raise self.fail(f"field '{self.path}' should be {wanted}{'' if infinite else ', finite'}, got {json.dumps(self.value)}")
        return value

    def opt_num(self, positive: bool = False, infinite: bool = False) -> float | None:
        return None if self.value is None else self.num(positive, infinite)

    def count(self, least: int = 0) -> int:
        """A whole number of at least `least` (a size, a count)."""
        value = self.of(int)
        if value < least:
            raise self.fail(f"field '{self.path}' should be a whole number of at least {least}, got {value}")
        return value

    def items(self) -> list["JsonField"]:
        return [self[i] for i in range(len(self.of(list)))]

    def entries(self) -> list[tuple[str, "JsonField"]]:
        """An object's keys and values."""
        return [(key, self[key]) for key in self.of(dict)]

    def spec(self) -> Spec:
        try:
            return Spec.parse(self.of(str))
        except ValueError as err:
            raise self.fail(f"field '{self.path}': {err}") from None

    def opt_spec(self) -> Spec | None:
        return None if self.value is None else self.spec()


def _axis_from(a: JsonField) -> MeshAxis:
    # an infinite bandwidth is a link of no cost (a mesh that prices compute alone, as the baselines' benchmark does)
    return MeshAxis(a["name"].of(str), a["size"].count(1), a["alpha_s"].num(),
                    a["beta_bytes_per_s"].num(positive=True, infinite=True),
                    tuple(LinkCost(c["kind"].of(str), c["alpha_s"].num(), c["beta_bytes_per_s"].num(positive=True, infinite=True))
                          for c in a.get("per_kind", []).items()),
                    a.get("scalar_alpha_s", None).opt_num())


def mesh_from(f: JsonField) -> Mesh:
    try:
        axes = tuple(_axis_from(a) for a in f["axes"].items())
        groups = tuple(AxisGroup(tuple(i.count() for i in g["axes"].items()), _axis_from(g))
                       for g in f.get("groups", []).items())
        # the overheads and groups are optional: plan files written before they existed price without them
        return Mesh(axes, f["flops_per_s"].num(positive=True), f["mem_bandwidth_bytes_per_s"].num(positive=True),
                    f["memory_bytes"].num(positive=True), f["hardware"].of(str), f.get("op_overhead_s", 0.0).num(),
                    f.get("recompute_op_overhead_s", 0.0).num(), groups, f.get("recompute_region_s", 0.0).num(),
                    **_device_fields_from(f))
    except (ValueError, KeyError, TypeError) as err:
        raise f.fail(f"field '{f.path}': {err}") from None


def _device_fields_from(f: JsonField) -> dict:
    """A mesh's GPU preset fields (`device_fields_from_json`), each checked first: rates above zero, overheads
    at least zero."""
    rates = f.get("rates", None)
    if rates.value is not None:
        for precision in PRECISIONS:
            rates[precision].num(positive=True)
    precision = f.get("precision", "")
    if precision.of(str) not in ("", *PRECISIONS):
        raise precision.fail(f"field '{precision.path}' should be one of {', '.join(map(repr, PRECISIONS))}, got {precision.value!r}")
    overheads = f.get("overheads", None)
    if overheads.value is not None:
        for _, nbytes in overheads.entries():
            nbytes.num()
    f.get("optimizer_foreach", False).of(bool)
    f.get("microbatches", 1).count(least=1)
    return device_fields_from_json(f.value)


def _memory_from(f: JsonField) -> MemoryBreakdown:
    return MemoryBreakdown(*(f[k].num() for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temp_bytes")),
                           f["budget_bytes"].opt_num(positive=True),  # the host tier's: 0 when nothing is offloaded
                           *(f.get(k, 0.0).num() for k in ("host_params_bytes", "host_grads_bytes", "host_optimizer_bytes")))


def _time_from(f: JsonField) -> TimeBreakdown:
    # files written before the optimizer's step was priced have no update_s: none of their compute was
    return TimeBreakdown(f["compute_s"].num(), f["comm_s"].num(), f["recompute_s"].num(), f.get("update_s", 0.0).num(),
                         f.get("offload_s", 0.0).num())  # 0: nothing offloaded


def _optional(f: JsonField, read: Callable[[JsonField], Any]) -> Any:
    return None if f.value is None else read(f)


def _node_from(f: JsonField) -> NodeDecision:
    s = f["strategy"]
    strategy = Strategy(tuple(x.opt_spec() for x in s["inputs"].items()), tuple(x.opt_spec() for x in s["outputs"].items()))
    return NodeDecision(f["node"].of(str), f["op"].of(str), strategy, f.get("recompute", False).of(bool), f.get("module", "").of(str))


def _layout_from(f: JsonField) -> Layout:
    """A parameter's layout; "" (unknown) in files written before layouts were recorded."""
    layout = f.of(str)
    if layout not in get_args(Layout):
        raise f.fail(f"field '{f.path}' should be one of {', '.join(map(repr, get_args(Layout)))}, got {layout!r}")
    return layout  # type: ignore[return-value]


def _tier_from(f: JsonField) -> Tier:
    """Where a parameter's optimizer state lives; "device" in files written before tiers were recorded."""
    tier = f.of(str)
    if tier not in TIERS:
        raise f.fail(f"field '{f.path}' should be one of {', '.join(map(repr, TIERS))}, got {tier!r}")
    return tier  # type: ignore[return-value]


def source_from(f: JsonField) -> PlanSource:
    return PlanSource(
        model_file=f.get("model_file", "").of(str),
        hf_config=f.get("hf_config", "").of(str),
        batch_size=None if f.get("batch_size", None).value is None else f["batch_size"].count(1),
        seq_len=None if f.get("seq_len", None).value is None else f["seq_len"].count(1),
        size=f.get("size", None).of(str, type(None)),
        optimizer=f.get("optimizer", "adamw").of(str),
        precision=f.get("precision", "").of(str),
    )


def plan_from_dict(obj: Any, source: str = "plan") -> Plan:
    root = JsonField(obj, "", source)
    root.of(dict)
    version = root["schema_version"].of(int)
    if version != SCHEMA_VERSION:
        raise root.fail(f"field 'schema_version' is {version}, a version not supported (this autopar reads version {SCHEMA_VERSION}); re-plan with this version")
    fp = root["fingerprint"]
    fingerprint = Fingerprint(
        ops_sha=fp["ops_sha"].of(str),
        shapes_sha=fp["shapes_sha"].of(str),
        params_sha=fp["params_sha"].of(str),
        mesh_shape=tuple(x.count(1) for x in fp["mesh_shape"].items()),
        hardware=fp["hardware"].of(str),
        budget_bytes=fp["budget_bytes"].opt_num(positive=True),
        param_shapes=tuple((k, tuple(d.count() for d in v.items())) for k, v in fp.get("param_shapes", {}).entries()),
        model=fp.get("model", "").of(str),  # "" in files written before it was recorded
    )
    sv = root["solver"]
    solver = SolverReport(sv["backend"].of(str), sv["status"].of(str), sv["solve_s"].num(), sv["num_variables"].count(),
                          sv["num_constraints"].count(), sv.get("gap", None).opt_num(infinite=True))
    params = tuple(ParamDecision(p["fqn"].of(str), p["node"].of(str), p["use"].spec(), p["storage"].spec(), _layout_from(p.get("layout", "")),
                                 _tier_from(p.get("tier", "device")))
                   for p in root["params"].items())
    baselines = tuple(
        BaselineResult(b["name"].of(str), _optional(b["time"], _time_from), _optional(b["memory"], _memory_from), b["fits"].of(bool))
        for b in root.get("baselines", []).items()
    )
    return Plan(
        fingerprint=fingerprint,
        mesh=mesh_from(root["mesh"]),
        nodes=tuple(_node_from(n) for n in root["nodes"].items()),
        params=params,
        memory=_memory_from(root["memory"]),
        time=_time_from(root["time"]),
        solver=solver,
        schema_version=version,
        notes=tuple(n.of(str) for n in root.get("notes", []).items()),
        source=_optional(root.get("source", None), source_from),
        comm_bytes_by_kind=tuple((k, v.num()) for k, v in root.get("comm_bytes_by_kind", {}).entries()),
        baselines=baselines,
        memory_timeline=tuple((pt[0].of(str), pt[1].num()) for pt in root.get("memory_timeline", []).items()),
    )


def plan_from_json(text: str, source: str = "plan") -> Plan:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanFormatError(f"{source}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    return plan_from_dict(obj, source)


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(plan_to_json(plan) + "\n")


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    if not p.is_file():
        raise PlanFormatError(f"plan file {str(p)!r} does not exist\n  fix: write one with `autopar plan MODEL.py --gpus N "
                              f"--save {p}` or `autopar.save_plan(pm.plan, {str(p)!r})` after a parallelize that solved it")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise PlanFormatError(f"{p.name}: not a plan file: it is not text (a pickle or another binary file?), and "
                              "plans are JSON, never unpickled\n  fix: write the plan with `autopar plan MODEL.py --gpus N "
                              f"--save {p}` or `autopar.save_plan(plan, {str(p)!r})`") from None
    return plan_from_json(text, source=p.name)


# ---------------------------------------------------------------- fingerprint
def op_name(node) -> str:
    """What a plan records as a node's op: its target, or its kind for placeholders and the output."""
    return str(node.target) if node.op == "call_function" else node.op


def _sha(lines) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def _param_shapes(traced: TracedGraph) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out = []
    for n in traced.graph.nodes:
        if n.op == "placeholder" and n.name in traced.param_fqns:
            val = n.meta.get("val")
            shape = tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else ()
            out.append((traced.param_fqns[n.name], shape))
    return tuple(out)


def fingerprint(traced: TracedGraph, mesh: Mesh, budget_bytes: float | None) -> Fingerprint:
    """What a plan is made for: graph ops, shapes and dtypes, parameters, mesh shape, hardware, budget."""
    nodes = list(traced.graph.nodes)
    shapes = (f"{n.name}:" + ";".join(f"{tuple(str(d) for d in v.shape)}{v.dtype}" for v in output_vals(n) if v is not None) for n in nodes)
    param_shapes = _param_shapes(traced)
    return Fingerprint(
        ops_sha=_sha(f"{n.name}:{op_name(n)}" for n in nodes),
        shapes_sha=_sha(shapes),
        params_sha=_sha(f"{fqn}:{shape}" for fqn, shape in param_shapes),
        mesh_shape=mesh.shape,
        hardware=mesh.hardware,
        budget_bytes=budget_bytes,
        param_shapes=param_shapes,
        model=traced.model_name,
    )


def _some(items: list[str]) -> list[str]:
    return items[:_MAX_EXAMPLES] + ([f"... and {len(items) - _MAX_EXAMPLES} more"] if len(items) > _MAX_EXAMPLES else [])


def _op_differences(plan: Plan, traced: TracedGraph) -> list[str]:
    model_ops = {n.name: op_name(n) for n in traced.graph.nodes}
    out = []
    for d in plan.nodes:
        if d.node not in model_ops:
            out.append(f"node '{d.node}' ({d.op}) is in the plan but not in the model")
        elif model_ops[d.node] != d.op:
            out.append(f"node '{d.node}' is {d.op} in the plan but {model_ops[d.node]} in the model")
    planned = {d.node for d in plan.nodes}
    if planned:  # a plan may omit placeholders/outputs: only compare the computing nodes
        out += [f"node '{n}' ({op}) is in the model but not in the plan" for n, op in model_ops.items() if n not in planned and op not in ("placeholder", "output")]
    if out:
        return _some(out)
    model_order, plan_order = [n.name for n in traced.graph.nodes], [d.node for d in plan.nodes]
    if sorted(model_order) == sorted(plan_order):
        return ["the graph's ops differ (same node names, different order)"]
    return ["the graph's ops differ (the plan's fingerprint records other ops than its nodes name; it was edited)"]


def _param_differences(plan: Plan, fp: Fingerprint) -> list[str]:
    planned = dict(plan.fingerprint.param_shapes) or {p.fqn: None for p in plan.params}
    model = dict(fp.param_shapes)
    out = [f"parameter '{f}' is in the model but not in the plan" for f in model if f not in planned]
    out += [f"parameter '{f}' is in the plan but not in the model" for f in planned if f not in model]
    out += [f"parameter '{f}' has shape {model[f]} in the model but {planned[f]} in the plan" for f in model if planned.get(f) not in (None, model[f])]
    return _some(out) or ["parameter shapes differ"]


def _fmt_budget(b: float | None) -> str:
    return "none" if b is None else f"{b / 1e9:.3g} GB"


def plan_differences(plan: Plan, traced: TracedGraph, mesh: Mesh, budget_bytes: float | None) -> tuple[str, ...]:
    """Every way `plan` was made for something other than this model, mesh and budget (empty: it matches)."""
    fp, old = fingerprint(traced, mesh, budget_bytes), plan.fingerprint
    out: list[str] = []
    if fp.ops_sha != old.ops_sha:
        out += _op_differences(plan, traced)
    if fp.params_sha != old.params_sha:
        out += _param_differences(plan, fp)
    if fp.shapes_sha != old.shapes_sha and fp.ops_sha == old.ops_sha and fp.params_sha == old.params_sha:
        out.append("activation shapes or dtypes differ (a different batch size or sequence length?)")
    if fp.mesh_shape != old.mesh_shape:
        out.append(f"mesh shape is {old.mesh_shape} in the plan but {fp.mesh_shape} here")
    if fp.hardware != old.hardware:
        out.append(f"hardware is '{old.hardware}' in the plan but '{fp.hardware}' here")
    same_budget = (fp.budget_bytes is None) == (old.budget_bytes is None) and (fp.budget_bytes is None or math.isclose(fp.budget_bytes, old.budget_bytes, rel_tol=1e-9))
    if not same_budget:
        out.append(f"memory budget is {_fmt_budget(old.budget_bytes)} in the plan but {_fmt_budget(fp.budget_bytes)} here")
    return tuple(out)


def _spec_problem(spec: Spec | None, val: Any, ndim_mesh: int, storage: bool = False) -> str | None:
    """What is wrong with `spec` as the layout of tensor `val` on a mesh of `ndim_mesh` axes, if anything."""
    if spec is None:
        return None if not isinstance(val, torch.Tensor) else "no spec for a tensor"
    if not isinstance(val, torch.Tensor):
        return f"{spec} for a value that is not a tensor"
    if len(spec.placements) != ndim_mesh:
        return f"{spec} has {len(spec.placements)} placements for a {ndim_mesh}-axis mesh"
    if storage and spec.has_partial():
        return f"{spec} stores a partial sum: parameters are stored Replicate or Shard"
    bad = [p.dim for p in spec.placements if isinstance(p, Shard) and not -val.dim() <= p.dim < val.dim()]
    if bad:
        return f"{spec} shards dim {bad[0]} of a tensor of {val.dim()} dims {tuple(val.shape)}"
    return None


def edit_differences(plan: Plan, traced: TracedGraph, ndim_mesh: int) -> list[str]:
    """What in `plan` cannot be a plan of the model its fingerprint matches (a plan edited by hand), each named by
    field and node: a node the model lacks or of another op, a node without a decision, a spec of the wrong
    length or sharding a dim the tensor lacks."""
    from autopar.solver.strategies import strategy_inputs  # (strategies import this module's package)

    nodes = {n.name: n for n in traced.graph.nodes}
    out = []
    decided = {d.node for d in plan.nodes}
    out += [f"node '{n.name}' ({op_name(n)}) of the model has no decision in the plan's nodes" for n in nodes.values()
            if plan.nodes and n.name not in decided and n.op not in ("placeholder", "output")]
    for i, d in enumerate(plan.nodes):
        node = nodes.get(d.node)
        if node is None:
            out.append(f"nodes[{i}].node: '{d.node}' is not a node of the model")
            continue
        if op_name(node) != d.op:
            out.append(f"nodes[{i}].op: '{d.op}' for node '{d.node}', which is {op_name(node)} in the model")
            continue
        if node.op == "output":
            continue
        inputs = [output_vals(src)[idx] if idx < len(output_vals(src)) else None for src, idx in strategy_inputs(node)]
        outputs = list(output_vals(node))
        for side, specs, vals in (("inputs", d.strategy.input_specs, inputs), ("outputs", d.strategy.output_specs, outputs)):
            if len(specs) != len(vals):
                out.append(f"nodes[{i}].strategy.{side}: {len(specs)} specs for node '{d.node}', which has {len(vals)} {side}")
                continue
            out += [f"nodes[{i}].strategy.{side}[{k}] of node '{d.node}': {problem}" for k, (spec, val) in enumerate(zip(specs, vals))
                    if (problem := _spec_problem(spec, val, ndim_mesh)) is not None]
    for i, p in enumerate(plan.params):
        node = nodes.get(p.node)
        val = node.meta.get("val") if node is not None else None
        if node is None or node.op != "placeholder":
            out.append(f"params[{i}].node: '{p.node}' ({p.fqn}) is not a placeholder of the model")
            continue
        out += [f"params[{i}].{field} of {p.fqn}: {problem}" for field, spec in (("use", p.use), ("storage", p.storage))
                if (problem := _spec_problem(spec, val, ndim_mesh, storage=field == "storage")) is not None]
    return out


def check_plan(plan: Plan, traced: TracedGraph, mesh: Mesh, budget_bytes: float | None) -> None:
    """Raise PlanMismatchError (with `.differences`) unless `plan` was made for exactly this model, mesh and budget,
    and its specs are layouts of the model's tensors. A plan made for a model of another class says which it was
    made for, with the first difference only."""
    diffs = plan_differences(plan, traced, mesh, budget_bytes)
    if diffs and plan.fingerprint.model and traced.model_name and plan.fingerprint.model != traced.model_name:
        what = f"the plan was made for {plan.made_for()}, not this {traced.model_name} (first difference: {diffs[0]})"
    else:
        diffs = diffs or tuple(_some(edit_differences(plan, traced, len(mesh.shape))))
        what = f"the plan does not match this model and mesh: {'; '.join(diffs)}"
    if diffs:
        raise PlanMismatchError(
            f"{what}\n  fix: plan again for this model (drop --load / plan=...), or load it with the mesh, hardware and budget it was made for",
            differences=diffs,
        )


def with_fingerprint(plan: Plan, traced: TracedGraph, mesh: Mesh, budget_bytes: float | None) -> Plan:
    """`plan` stamped with this model's fingerprint (for plans built by hand or by a solver that leaves it empty)."""
    return replace(plan, fingerprint=fingerprint(traced, mesh, budget_bytes))


# ---------------------------------------------------------------- meshes (calibrated hardware files)
def mesh_to_json(mesh: Mesh) -> str:
    return json.dumps(_mesh_dict(mesh), indent=1)


def load_mesh(path: str | Path) -> Mesh:
    """A mesh written by `autopar calibrate --save` (the same object as a plan's "mesh" field)."""
    p = Path(path)
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise PlanFormatError(f"{p.name}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    root = JsonField(obj, "", p.name)
    return mesh_from(root["mesh"] if isinstance(obj, dict) and "mesh" in obj else root)
