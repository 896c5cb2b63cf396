"""Communication volume per collective kind, against hand counts on a tiny MLP (2 devices)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from autopar.solver.comm_volume import comm_bytes_by_kind
from autopar.solver.mesh import Mesh, MeshAxis
from autopar.solver.plan import Fingerprint, MemoryBreakdown, NodeDecision, ParamDecision, Plan, SolverReport, TimeBreakdown
from autopar.solver.spec import Partial, Replicate, Spec, Strategy
from autopar.solver.strategies import enumerate_strategies, strategy_inputs
from autopar.tracer import trace

B, D, H = 8, 16, 32
F32 = 4


class TinyMLP(nn.Module):
    """fc0 feeds a Megatron pair (fc1 column-parallel, fc2 row-parallel): fc1's input needs a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(D, D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.fc0(x)))).pow(2).mean()


MESH = Mesh((MeshAxis("d", 2, 1e-5, 1e10),), flops_per_s=1e12, mem_bandwidth_bytes_per_s=1e11, memory_bytes=1e9, hardware="test")


@pytest.fixture(scope="module")
def traced():
    with torch.device("meta"):
        model, x = TinyMLP().train(), torch.randn(B, D)
    return trace(model, (x,))


def _cost(strategy: Strategy, node, chosen) -> tuple[int, int]:
    """(specs needing a collective, inputs not taken as produced): R -> P is local and free."""
    bad = changed = 0
    for spec, (src, k) in zip(strategy.input_specs, strategy_inputs(node)):
        have = chosen[src.name].output_specs[k]
        changed += have != spec
        bad += not all(a == b or (isinstance(a, Replicate) and isinstance(b, Partial)) for a, b in zip(have.placements, spec.placements))
    return bad, changed


def plan_of(traced, pins: dict[str, str], zero: dict[str, str] = {}) -> Plan:
    """Placeholders pinned by FQN or name (others replicated); each op takes the strategy needing fewest collectives."""
    strategies = enumerate_strategies(traced, MESH)
    chosen: dict[str, Strategy] = {}
    for node in traced.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            want = Spec.parse(pins.get(traced.param_fqns.get(node.name, node.name), "R"))
            chosen[node.name] = next(s for s in strategies[node.name] if s.output_specs[0] == want)
        else:
            chosen[node.name] = min(strategies[node.name], key=lambda s: _cost(s, node, chosen))
    nodes = tuple(NodeDecision(n, "", s) for n, s in chosen.items())
    params = tuple(ParamDecision(fqn, ph, chosen[ph].output_specs[0], Spec.parse(zero.get(fqn, str(chosen[ph].output_specs[0]))))
                   for ph, fqn in traced.param_fqns.items())
    return Plan(Fingerprint("", "", "", MESH.shape, "test", None), MESH, nodes, params,
                MemoryBreakdown(0, 0, 0, 0, 0, None), TimeBreakdown(0, 0, 0), SolverReport("test", "fixed", 0.0, 0, 0))


PARAM_BYTES = F32 * (D * D + D + D * H + H + H * D + D)


def test_pure_data_parallel_all_reduces_every_gradient_once(traced):
    x = next(n.name for n in traced.graph.nodes if n.op == "placeholder" and n.name not in traced.param_fqns)
    plan = plan_of(traced, {x: "S(0)"})
    assert all(str(p.use) == "R" for p in plan.params)
    assert dict(comm_bytes_by_kind(traced, plan)) == {"all_reduce": PARAM_BYTES}


def test_zero_gathers_twice_and_reduce_scatters_instead_of_all_reducing(traced):
    x = next(n.name for n in traced.graph.nodes if n.op == "placeholder" and n.name not in traced.param_fqns)
    plan = plan_of(traced, {x: "S(0)"}, zero={"fc1.weight": "S(0)", "fc2.weight": "S(1)"})
    sharded = F32 * (D * H + H * D)
    assert dict(comm_bytes_by_kind(traced, plan)) == {
        "all_reduce": PARAM_BYTES - sharded,
        "reduce_scatter": sharded,
        "all_gather": 2 * sharded,  # the gathered (whole) weight, before forward and before backward
    }


def test_megatron_mlp_all_reduces_the_activation_once_forward_once_backward(traced):
    # fc1 column-parallel (weight rows, bias split), fc2 row-parallel (weight columns split), fc0 replicated
    plan = plan_of(traced, {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"})
    mm2 = [d for d in plan.nodes if "addmm" in str(traced.node(d.node).target)][-1]
    assert str(mm2.strategy.output_specs[0]) == "P"  # the row-parallel product is partial
    activation = F32 * B * D
    # forward: fc2's partial output is all-reduced before pow; backward: fc1's input gradient (Megatron's f)
    assert dict(comm_bytes_by_kind(traced, plan)) == {"all_reduce": 2 * activation}


def test_a_mesh_of_one_rank_moves_nothing(traced):
    # the ZeRO and Megatron plans' specs on an axis of one rank: every reshard and gather is a relabelling
    one = Mesh((MeshAxis("d", 1, 1e-5, 1e10),), flops_per_s=1e12, mem_bandwidth_bytes_per_s=1e11, memory_bytes=1e9, hardware="test")
    x = next(n.name for n in traced.graph.nodes if n.op == "placeholder" and n.name not in traced.param_fqns)
    for plan in (plan_of(traced, {x: "S(0)"}, zero={"fc1.weight": "S(0)", "fc2.weight": "S(1)"}),
                 plan_of(traced, {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"})):
        assert comm_bytes_by_kind(traced, plan)  # on two ranks they move bytes
        assert comm_bytes_by_kind(traced, dataclasses.replace(plan, mesh=one)) == ()
