"""Cost model against hand counts."""
from __future__ import annotations

import pytest

from autopar.profiler.types import NodeCost
from autopar.solver.cost import collective_time_s, strategy_cost
from autopar.solver.mesh import MeshAxis, make_mesh
from autopar.solver.spec import Spec, Strategy

AX = MeshAxis("tp", 4, alpha_s=1e-5, beta_bytes_per_s=1e9)


def test_ring_formulas_by_hand():
    assert collective_time_s("all_reduce", 4e6, AX) == pytest.approx(2 * 0.75 * 4e6 / 1e9 + 6e-5)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time_s(kind, 4e6, AX) == pytest.approx(0.75 * 4e6 / 1e9 + 3e-5)
    assert collective_time_s("all_reduce", 4e6, MeshAxis("x", 1, 1e-5, 1e9)) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time_s("broadcast", 1.0, AX)


def test_strategy_cost_splits_flops_and_charges_replicated_input_grads():
    mesh = make_mesh(4, (2, 2), "h100")
    # mm (64x128) @ (128x256): 2*64*128*256 forward flops, twice that backward
    fwd = 2 * 64 * 128 * 256
    node = NodeCost("mm", "aten.mm.default", fwd, 2 * fwd, (64 * 256 * 4,), (True,), 0.0, 0.0)
    rep = Strategy((Spec.parse("RR"), Spec.parse("RR")), (Spec.parse("RR"),))
    col = Strategy((Spec.parse("S(0)R"), Spec.parse("RS(1)")), (Spec.parse("S(0)S(1)"),))
    c_rep, m_rep = strategy_cost(node, rep, [(64, 256)], mesh, in_bytes=[64 * 128 * 4, 128 * 256 * 4])
    c_col, m_col = strategy_cost(node, col, [(64, 256)], mesh, in_bytes=[64 * 128 * 4, 128 * 256 * 4])
    rate = mesh.flops_per_s
    bw = mesh.mem_bandwidth_bytes_per_s
    assert c_rep == pytest.approx(max(fwd / rate, 65536 / bw) + max(2 * fwd / rate, 2 * 65536 / bw))
    assert c_col == pytest.approx(max(fwd / 4 / rate, 16384 / bw) + max(2 * fwd / 4 / rate, 2 * 16384 / bw))
    assert m_rep == 0.0
    # x is R on axis 1 (tp) where the op is split: its grad is Partial there -> all-reduce of local x (S(0) on dp)
    # w is R on axis 0 (dp): all-reduce of the local w shard (S(1) on tp) over dp
    expect = collective_time_s("all_reduce", 64 * 128 * 4 / 2, mesh.axes[1]) + collective_time_s(
        "all_reduce", 128 * 256 * 4 / 2, mesh.axes[0])
    assert m_col == pytest.approx(expect)
