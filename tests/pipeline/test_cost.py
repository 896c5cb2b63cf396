"""The pipeline cost model against the papers' formulas and torch's own schedules.

Bubble fractions for equal stages are Narayanan et al. 2021's (arXiv 2104.04473, 2.2.1 and 2.2.2):
(p - 1) / (m + p - 1) of a step for GPipe and 1F1B, (p - 1) / (v m) of the ideal time interleaved.
The micro-batches in flight per rank are counted in torch's own schedule orders (each forward
holds a micro-batch's activations until its backward), built for stand-in stages.
"""
from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

from autopar.api import trace_copy
from autopar.pipeline.cost import StageCost, bubble_fraction, in_flight, price, send_s, stage_cost
from autopar.pipeline.cut import cut, find_layers
from autopar.pipeline.search import Config, Topology, _estimates, balanced_cuts
from autopar.profiler import profile
from autopar.solver import solve
from autopar.solver.mesh import PRESETS, Mesh, MeshAxis
from autopar.solver.spec import Replicate, Shard, Spec
from tests.zoo import load_zoo


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 8), (4, 16)])
def test_bubbles_are_the_papers(pp, m):
    assert bubble_fraction("1f1b", pp, 1, m) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble_fraction("gpipe", pp, 1, m) == pytest.approx((pp - 1) / (m + pp - 1))
    for v in (2, 4):
        f = bubble_fraction("interleaved_1f1b", pp, v, m)
        assert f / (1 - f) == pytest.approx((pp - 1) / (v * m))  # bubble over the ideal time
    assert bubble_fraction("zero_bubble", pp, 1, m) < bubble_fraction("1f1b", pp, 1, m) / 2


def _stand_ins(pp: int, virtual: int) -> list[SimpleNamespace]:
    """What torch's multi-stage schedules read of rank 0's stages to compute every rank's order."""
    n = pp * virtual
    return [SimpleNamespace(num_stages=n, group_size=pp, group_rank=0, stage_index=k * pp, is_first=k == 0,
                            is_last=k * pp == n - 1, submod=None) for k in range(virtual)]


def _peak_in_flight(actions) -> int:
    """Forwards whose backward (full, or of the inputs) has not run yet, at most."""
    live = peak = 0
    for a in actions:
        kind = "" if a is None else str(a.computation_type).rsplit(".", 1)[-1]
        live += {"FORWARD": 1, "F": 1, "FULL_BACKWARD": -1, "B": -1, "BACKWARD_INPUT": -1, "I": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("schedule,cls", [("interleaved_1f1b", ScheduleInterleaved1F1B), ("zero_bubble", ScheduleInterleavedZeroBubble)])
@pytest.mark.parametrize("pp,virtual,m", [(2, 2, 4), (4, 2, 8), (4, 2, 4), (4, 1, 8), (4, 3, 12), (2, 2, 2)])
def test_micro_batches_in_flight_are_torchs(schedule, cls, pp, virtual, m):
    order = cls(_stand_ins(pp, virtual), m).pipeline_order
    assert [_peak_in_flight(order[r]) for r in range(pp)] == [in_flight(schedule, pp, virtual, m, r) * virtual for r in range(pp)]


def test_price_of_uneven_stages_memory_and_sends():
    link = MeshAxis("pp", 2, 1e-5, 1e9)
    mesh = Mesh((link, MeshAxis("dp", 2, 1e-5, 1e10)), 1e12, 1e12, 80e9)
    slow = StageCost(micro_s=3.0, sync_s=0.5, update_s=0.25, static_bytes=10.0, activation_bytes=2.0, send_bytes=1e6, receive_bytes=0.0)
    fast = StageCost(micro_s=1.0, sync_s=0.0, update_s=0.25, static_bytes=20.0, activation_bytes=4.0, send_bytes=0.0, receive_bytes=1e6)
    time, memory = price([slow, fast], "1f1b", mesh, microbatches=4)
    hop = send_s(1e6, link)
    assert hop == pytest.approx(1e-5 + 1e-3)
    # the first micro-batch through both stages, then three more through the slower one; then its sync and step
    assert time.step_s == pytest.approx(3 * (3.0 + hop) + (3.0 + hop) + (1.0 + hop) + 0.75)
    assert time.bubble_s == pytest.approx(1.0 + hop)
    # rank 0 holds 2 micro-batches in flight, rank 1 one; torch's receive buffers for all 4
    assert memory == pytest.approx((10.0 + 2 * 2.0 + 4 * 1e6, 20.0 + 1 * 4.0 + 4 * 1e6))


def test_two_stages_a_rank_are_cut_within_the_budget_their_micro_batches_in_flight_need():
    # 4 equal units on pp=2 ranks of 2 stages each (interleaved 1F1B, 4 micro-batches): torch's warm-up runs 5
    # forward chunks on rank 0 before its first backward (2 rounds of 2 micro-batches, and 1 more; counted in
    # torch's order by test_micro_batches_in_flight_are_torchs), 3 on rank 1. Rank 0 holds its two stages' static
    # bytes and 5 chunks' activations: 2 * 10 + 5 * 1 = 25
    unit = StageCost(micro_s=1.0, sync_s=0.0, update_s=0.0, static_bytes=10.0, activation_bytes=1.0, send_bytes=0.0,
                     receive_bytes=0.0)
    units = [unit] * 4
    assert balanced_cuts(units, 4, 2, "interleaved_1f1b", 4, budget_bytes=25.0) == (1, 2, 3)
    assert balanced_cuts(units, 4, 2, "interleaved_1f1b", 4, budget_bytes=24.0) is None
    mesh = Mesh((MeshAxis("pp", 2, 0.0, 1e9),), 1e12, 1e12, 80e9)
    _, memory = price(units, "interleaved_1f1b", mesh, microbatches=4)
    assert memory == pytest.approx((2 * 10.0 + 5 * 1.0, 2 * 10.0 + 3 * 1.0))
    # one stage a rank (1F1B: rank 0 holds pp = 2 micro-batches) is held to the whole budget: 2 units' static bytes
    # and 2 micro-batches of 2 units' activations, 2 * 10 + 2 * 2 = 24
    assert balanced_cuts(units, 2, 2, "1f1b", 4, budget_bytes=24.0) == (2,)
    assert balanced_cuts(units, 2, 2, "1f1b", 4, budget_bytes=23.0) is None


def test_units_that_fit_only_recomputed_are_estimated_recomputed():
    # 4 equal layers on pp=2 ranks, 1F1B, 4 micro-batches, a link of no cost: a layer keeps 8 bytes a micro-batch,
    # recomputed only the 1 byte it receives. Rank 0 (2 layers, 2 micro-batches in flight) needs 20 + 2 * 16 bytes
    # as solved, 20 + 2 * 2 recomputed, beside torch's receive buffers (4 micro-batches of 1 byte sent)
    layer = StageCost(micro_s=1.0, sync_s=0.0, update_s=0.0, static_bytes=10.0, activation_bytes=8.0, send_bytes=1.0,
                      receive_bytes=1.0)
    cache = SimpleNamespace(unit_costs=lambda microbatches, mesh, budget: [layer] * 4)
    free = MeshAxis("link", 1, 0.0, math.inf)
    topology = Topology(free, free, 8, Mesh((free,), 1e12, 1e12, 80e9))
    config = Config(2, (1,), 4)
    [solved] = _estimates(config, cache, topology, 60.0, ("1f1b",))
    assert (solved.starts, solved.step_s) == ((2,), (4 - 1) * 2.0 + 2 * 2.0)  # 2 layers of 1 s a stage
    [recomputed] = _estimates(config, cache, topology, 40.0, ("1f1b",))
    assert (recomputed.starts, recomputed.step_s) == ((2,), pytest.approx(5 * 2 * 4 / 3))  # forward run twice: 4/3
    assert _estimates(config, cache, topology, 27.0, ("1f1b",)) == []  # 20 + 2 * 2 + 4 receive buffers = 28


def test_a_stage_of_many_micro_batches_pays_its_gradient_sync_once_a_step():
    # the tiny MLP (12 parameters, 50,304 bytes of float32) on 2 ranks of a link of 1 MB/s and no latency, computing
    # at 1 GFLOP/s: syncing every gradient each pass (50.3 ms) costs more than data parallelism saves of the compute,
    # so a plan of one pass a step keeps every rank on the whole batch; a stage that runs 64 micro-batches a step
    # syncs once for all of them (1/64 of it a pass) and splits the batch. The stage's price takes the sync whole:
    # a ring all-reduce of B bytes over 2 ranks sends B / 1 MB/s
    model, sample = load_zoo("mlp").build(batch_size=8, seq_len=8, size="tiny", device="cpu")
    traced = trace_copy(model, sample, "cpu")
    cpu = PRESETS["cpu"]
    hardware = replace(cpu, axes=tuple(replace(a, alpha_s=0.0, beta_bytes_per_s=1e6) for a in cpu.axes),
                       flops_per_s=1e9, mem_bandwidth_bytes_per_s=1e9, op_overhead_s=0.0)
    costs = profile(traced)
    [whole] = cut(traced, (), find_layers(traced))
    one = solve(traced, costs, hardware.with_shape((2,)), time_limit_s=5)
    assert one.comm_bytes_by_kind == (("all_gather", 1024.0),) and all(p.use == Spec((Replicate(),)) for p in one.params)
    assert stage_cost(one, whole, None).sync_s == 0.0
    many = solve(traced, costs, replace(hardware.with_shape((2,)), microbatches=64), time_limit_s=5)
    grad_bytes = sum(traced.node(p.node).meta["val"].numel() * 4 for p in many.params)
    assert grad_bytes == 50304 and dict(many.comm_bytes_by_kind) == {"all_reduce": grad_bytes}
    assert many.node("x").strategy.output_specs[0] == Spec((Shard(0),))
    assert stage_cost(many, whole, None).sync_s == pytest.approx(grad_bytes / 1e6)
    assert many.time.comm_s == pytest.approx(grad_bytes / 1e6 / 64)
    assert Mesh.from_json(many.mesh.to_json()) == many.mesh  # a stage plan's file keeps its micro-batches
