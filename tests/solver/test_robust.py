"""The robust choice among candidate plans (`solver.robust.simplest_within`), on hand-made candidates."""
from __future__ import annotations

from autopar.solver.robust import Candidate, simplest_within


def test_a_simpler_plan_within_the_margin_is_chosen_over_a_faster_searched_one():
    searched = Candidate("searched", 0.95, (1, 3))
    dp = Candidate("data_parallel", 1.00, (1, 0))
    assert simplest_within([searched, dp], 0.10) == (dp, searched)
    assert simplest_within([searched, dp], 0.01) == (searched, searched)  # outside the margin: the faster one


def test_a_textbook_plan_gives_way_to_a_faster_textbook_plan_on_another_mesh_not_on_its_own():
    # Megatron on a 1-D mesh (one axis: simpler) priced 1.3% slower than Megatron on 8x8, the searched plan on 8x8
    # 4% faster still: within a 10% margin, the answer is the 8x8 Megatron, not the simpler, slower 1-D one
    flat_tp = Candidate("megatron", 9.315, (1, 2))
    tp_dp = Candidate("megatron", 9.194, (2, 2))
    searched = Candidate("searched", 8.924, (2, 3))
    assert simplest_within([flat_tp, tp_dp, searched], 0.10) == (tp_dp, searched)
    # on one mesh the kind decides: data parallel over a Megatron plan priced 1% faster
    dp, tp = Candidate("data_parallel", 1.01, (1, 0)), Candidate("megatron", 1.00, (1, 2))
    assert simplest_within([dp, tp], 0.10) == (dp, tp)
    # no textbook plan at all: the margin alone decides among searched plans
    one_axis = Candidate("searched", 9.3, (1, 3))
    assert simplest_within([one_axis, searched], 0.10) == (one_axis, searched)


def test_a_searched_plan_slower_than_a_textbook_plan_is_never_chosen():
    # a searched plan on a 1-D mesh (simpler by its axes) priced 3.8% slower than ZeRO-3 on 2x4: ZeRO-3, never the
    # slower searched plan, whatever its simplicity
    searched = Candidate("searched", 2.319, (1, 3))
    zero3 = Candidate("zero3", 2.234, (2, 1))
    assert simplest_within([searched, zero3], 0.10) == (zero3, zero3)
    # a faster searched plan on the simpler mesh is chosen as before
    assert simplest_within([Candidate("searched", 2.2, (1, 3)), zero3], 0.10)[0].name == "searched"
