"""Hand-built and random plans for codegen tests (the solver is not involved).

    plan = greedy_plan(traced, mesh, pins={"p_fc1_weight": "S(0)"})   # follow producers, pinned specs
    plan = random_plan(traced, mesh, rng)                              # any valid strategy per node
"""
from __future__ import annotations

import random
from typing import Callable, Mapping

from autopar.solver.mesh import Mesh, MeshAxis, default_axis_names
from autopar.solver.plan import Fingerprint, MemoryBreakdown, NodeDecision, ParamDecision, Plan, SolverReport, TimeBreakdown
from autopar.solver.spec import Partial, Replicate, Shard, Spec, Strategy
from autopar.solver.strategies import enumerate_strategies, strategy_inputs
from autopar.tracer import TracedGraph
from tests.zoo import load_zoo  # noqa: F401  (re-exported for the codegen tests)



def cpu_mesh(shape: tuple[int, ...]) -> Mesh:
    axes = tuple(MeshAxis(n, s, 1e-5, 1e10) for n, s in zip(default_axis_names(len(shape)), shape))
    return Mesh(axes, flops_per_s=1e11, mem_bandwidth_bytes_per_s=1e10, memory_bytes=1e9, hardware="test")


def build_plan(traced: TracedGraph, mesh: Mesh, choices: Mapping[str, Strategy], recompute: set[str] = frozenset(),
               zero: Mapping[str, Spec] | None = None) -> Plan:
    """A Plan from one strategy per node; `zero`: placeholder -> storage spec for ZeRO parameters."""
    zero = zero or {}
    nodes = tuple(NodeDecision(n.name, "placeholder" if n.op == "placeholder" else str(n.target), choices[n.name], n.name in recompute)
                  for n in traced.graph.nodes if n.op != "output")
    params = tuple(ParamDecision(fqn, ph, choices[ph].output_specs[0], zero.get(ph, choices[ph].output_specs[0]))
                   for ph, fqn in traced.param_fqns.items())
    fp = Fingerprint("", "", "", mesh.shape, mesh.hardware, None)
    return Plan(fp, mesh, nodes, params, MemoryBreakdown(0, 0, 0, 0, 0, None), TimeBreakdown(0, 0, 0),
                SolverReport("test", "fixed", 0.0, 0, 0))


def _mismatches(strategy: Strategy, node, chosen: Mapping[str, Strategy]) -> int:
    bad = 0
    for spec, (src, idx) in zip(strategy.input_specs, strategy_inputs(node)):
        have = chosen[src.name].output_specs[idx]
        if have != spec:
            # R -> P is a free local step; anything else costs a collective
            bad += 0 if all(a == b or (isinstance(b, Partial) and isinstance(a, Replicate))
                            for a, b in zip(have.placements, spec.placements)) else 1
    return bad


def greedy_plan(traced: TracedGraph, mesh: Mesh, pins: Mapping[str, str], prefer: Callable[[str, Strategy], int] | None = None) -> Plan:
    """Placeholders pinned by name (unpinned: replicated); every op takes the strategy needing fewest reshards."""
    strategies = enumerate_strategies(traced, mesh)
    chosen: dict[str, Strategy] = {}
    for node in traced.graph.nodes:
        if node.op == "output":
            continue
        options = strategies[node.name]
        if node.op == "placeholder":
            want = Spec.parse(pins.get(node.name, "R" * len(mesh.shape)))
            chosen[node.name] = next(s for s in options if s.output_specs[0] == want)
            continue
        chosen[node.name] = min(options, key=lambda s: (_mismatches(s, node, chosen), prefer(node.name, s) if prefer else 0))
    return build_plan(traced, mesh, chosen)


def random_plan(traced: TracedGraph, mesh: Mesh, rng: random.Random, strategies=None, recompute_spans: int = 3,
                zero_p: float = 0.5) -> Plan:
    """A uniformly random strategy per node, random recompute spans (a few runs of consecutive ops,
    as a solver picks them) and random ZeRO storage for parameters."""
    strategies = strategies or enumerate_strategies(traced, mesh)
    choices = {name: rng.choice(opts) for name, opts in strategies.items()}
    ops = [n.name for n in traced.graph.nodes if n.op == "call_function"]
    recompute: set[str] = set()
    for _ in range(rng.randint(0, recompute_spans)):
        start = rng.randrange(len(ops))
        recompute.update(ops[start:start + rng.randint(1, max(1, len(ops) // 4))])
    zero = {}
    for ph in traced.param_fqns:
        use = choices[ph].output_specs[0]
        shape = tuple(traced.node(ph).meta["val"].shape)
        if rng.random() < zero_p:
            storage = _zero_storage(use, shape, mesh.shape, rng)
            if storage is not None:
                zero[ph] = storage
    return build_plan(traced, mesh, choices, recompute, zero)


def _zero_storage(use: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...], rng: random.Random) -> Spec | None:
    """Shard some Replicate axis of `use` on a dim that stays even (ZeRO storage), or None."""
    axes = [k for k, p in enumerate(use.placements) if isinstance(p, Replicate)]
    rng.shuffle(axes)
    for k in axes:
        dims = list(range(len(shape)))
        rng.shuffle(dims)
        for d in dims:
            pls = list(use.placements)
            pls[k] = Shard(d)
            cand = Spec(tuple(pls))
            try:
                cand.local_shape(shape, mesh_shape)
            except ValueError:
                continue
            return cand
    return None
