"""The plan's notes: what the report tells the user about the model's shapes (`solver.notes`)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.zoo import load_zoo
from autopar.profiler import profile
from autopar.solver import solve
from autopar.solver.mesh import make_mesh
from autopar.solver.plan_io import plan_from_json, plan_to_json
from autopar.tracer import trace


def _gpt2(vocab_size: int):
    zoo = load_zoo("gpt2")
    with torch.device("meta"):
        model = zoo.GPT(dataclasses.replace(zoo.CONFIGS["tiny"], vocab_size=vocab_size)).train()
        ids = torch.randint(0, vocab_size, (4, 16))
    traced = trace(model, {"input_ids": ids, "labels": ids})
    return traced, profile(traced)


@pytest.mark.parametrize("vocab_size, shape, padded", [(1001, (2, 2), 1024), (1030, (4,), 1152), (1024, (2, 2), None),
                                                       (250, (4,), None)])
def test_a_vocabulary_no_mesh_axis_divides_is_named_with_the_size_that_would_split(vocab_size, shape, padded):
    """GPT-2's 50,257 rows split over no axis, so the embedding, LM head and loss are never vocabulary-parallel;
    the report says so and names the padded size that would split (a multiple of 128 and of the device count).
    A vocabulary that divides, and a table too small to be worth splitting (250 rows on 4), get no note."""
    traced, prof = _gpt2(vocab_size)
    plan = solve(traced, prof, make_mesh(4, shape, "h100"))
    notes = [n for n in plan.notes if "transformer.wte.weight" in n]
    if padded is None:
        assert notes == []
        return
    assert len(notes) == 1 and f"has {vocab_size} rows" in notes[0] and f"padded to {padded} rows" in notes[0]
    assert padded % 128 == 0 and padded % 4 == 0 and padded - 128 < vocab_size <= padded
    assert plan_from_json(plan_to_json(plan)).notes == plan.notes  # saved with the plan, shown by `autopar show`


class NearestCentroid(torch.nn.Module):
    """`torch.cdist` has no sharding rule (ours or DTensor's)."""

    def __init__(self):
        super().__init__()
        self.fc, self.centroids = torch.nn.Linear(8, 8), torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        distances = torch.cdist(self.fc(x), self.centroids)  # the line the note names
        return distances.square().mean()


def test_an_op_without_a_sharding_rule_is_named_with_the_users_line():
    """An op no rule covers runs replicated, its inputs gathered: the log warned once a process (a plan made
    later, or read back with `autopar show`, said nothing); the plan now names the op and the user's line."""
    traced = trace(NearestCentroid(), (torch.randn(16, 8),))
    plan = solve(traced, profile(traced), make_mesh(2, (2,), "cpu"))
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "the line the note names" in text)
    notes = [n for n in plan.notes if "aten._cdist_forward.default" in n]
    assert len(notes) == 1 and f"test_notes.py:{line}" in notes[0] and "runs replicated" in notes[0]
    cdist = next(d for d in plan.nodes if d.op == "aten._cdist_forward.default")
    assert all(s.is_replicate() for s in cdist.strategy.input_specs + cdist.strategy.output_specs)
    assert not [n for n in solve(*_gpt2(1024), make_mesh(4, (4,), "h100")).notes if "runs replicated" in n]
