"""Hand-built plans over real traced zoo models, for testing the CLI and plan files before/independently of the solver."""
from __future__ import annotations

from pathlib import Path

from autopar.model_file import load_model_file
from autopar.solver.mesh import Mesh, MeshAxis
from autopar.solver.plan import MemoryBreakdown, NodeDecision, ParamDecision, Plan, PlanSource, SolverReport, TimeBreakdown
from autopar.solver.plan_io import fingerprint
from autopar.solver.spec import Replicate, Shard, Spec, Strategy
from autopar.tracer import TracedGraph, module_path, output_vals, tensor_args, trace
from autopar.tracer.param_layouts import param_layouts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def zoo(name: str, batch_size: int = 2, seq_len: int = 16):
    return load_model_file(EXAMPLES / f"{name}.py", batch_size, seq_len, size="tiny")


def traced_zoo(name: str, batch_size: int = 2, seq_len: int = 16) -> TracedGraph:
    return trace(*zoo(name, batch_size, seq_len))


def two_axis_mesh(dp: int = 2, tp: int = 2, hardware: str = "test") -> Mesh:
    axes = (MeshAxis("dp", dp, 5e-6, 25e9), MeshAxis("tp", tp, 2e-6, 200e9))
    return Mesh(axes, flops_per_s=100e12, mem_bandwidth_bytes_per_s=2e12, memory_bytes=80e9, hardware=hardware)


def hand_plan(
    traced: TracedGraph,
    mesh: Mesh,
    column: tuple[str, ...] = (),
    zero: tuple[str, ...] = (),
    recompute_module: str = "",
    budget_bytes: float | None = None,
    time_s: tuple[float, float, float] = (0.1, 0.02, 0.0),
    source: PlanSource | None = None,
) -> Plan:
    """Every node replicated over tp and batch-split over dp, except: parameters whose FQN ends with one of
    `column` are used S(0) over tp, those in `zero` stored S(0) over dp; nodes under `recompute_module` recomputed.
    (The strategies need not be consistent with each other: this is report input, not something to run. Layouts
    are recorded as the solver records them; no memory timeline is.)"""
    rep = Spec((Replicate(), Replicate()))
    batch = Spec((Shard(0), Replicate()))
    nodes, params = [], []
    layouts = param_layouts(traced)
    for n in traced.graph.nodes:
        if n.name in traced.param_fqns:
            fqn = traced.param_fqns[n.name]
            use = Spec((Replicate(), Shard(0))) if fqn.endswith(column) and column else rep
            storage = Spec((Shard(0), use.placements[1])) if fqn in zero else use
            params.append(ParamDecision(fqn, n.name, use, storage, layouts[fqn]))
            nodes.append(NodeDecision(n.name, "placeholder", Strategy((), (use,))))
            continue
        op = str(n.target) if n.op == "call_function" else n.op
        outs = tuple(batch if v is not None and v.dim() > 0 else rep for v in output_vals(n))
        ins = tuple(rep for _ in tensor_args(n))
        mod = module_path(n)
        nodes.append(NodeDecision(n.name, op, Strategy(ins, outs), bool(recompute_module) and mod.startswith(recompute_module), mod))
    return Plan(
        fingerprint=fingerprint(traced, mesh, budget_bytes),
        mesh=mesh,
        nodes=tuple(nodes),
        params=tuple(params),
        memory=MemoryBreakdown(1e9, 1e9, 2e9, 3e9, 0.5e9, budget_bytes),
        time=TimeBreakdown(*time_s),
        solver=SolverReport("highs", "optimal", 0.5, 1234, 567),
        notes=("aten.foo planned replicate-only",),
        source=source,
        comm_bytes_by_kind=(("all_reduce", 4e8), ("all_gather", 1e8)),
    )
