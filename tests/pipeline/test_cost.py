"""The pipeline cost model against the papers' formulas and torch's own schedules.

Bubble fractions for equal stages are Narayanan et al. 2021's (arXiv 2104.04473, 2.2.1 and 2.2.2):
(p - 1) / (m + p - 1) of a step for GPipe and 1F1B, (p - 1) / (v m) of the ideal time interleaved.
The micro-batches in flight per rank are counted in torch's own schedule orders (each forward
holds a micro-batch's activations until its backward), built for stand-in stages.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

from autopar.pipeline.cost import StageCost, bubble_fraction, in_flight, price, send_s
from autopar.solver.mesh import Mesh, MeshAxis


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
