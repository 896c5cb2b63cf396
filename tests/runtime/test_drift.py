"""Replicated parameters compared across ranks: a change made on one rank alone is named (parameter, ranks, how far
apart) within `drift_check_every` steps and before any save, and copies that agree, or blocks that differ because
they are different blocks, raise nothing."""
from __future__ import annotations

import pytest
import torch

from tests.codegen.harness import classifier_case, parallel_module, step

from autopar.errors import DriftError
from autopar.runtime.checkpoints import latest_checkpoint
from autopar.runtime.drift import check_replicas
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.spec import Spec


def _hook_on_rank_1(rank, world, model, sample, traced, plan, root):
    """Rank 1 scales fc2's weight gradient before each optimizer step; the loop trains, then saves."""
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    pm.drift_check_every = 3
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    if rank == 1:
        def scale(optimizer, args, kwargs):
            pm.fc2.weight.grad.mul_(1.5)
        opt.register_step_pre_hook(scale)
    steps = 0
    try:
        for _ in range(5):
            step(pm, opt, sample)
            steps += 1
    except DriftError as err:
        trained = (steps, str(err))
    pm.drift_check_every = 0  # now only the save checks
    try:
        pm.save_checkpoint(root, opt)
    except DriftError as err:
        return trained, str(err)
    return trained, None


@pytest.mark.timeout(120)
def test_a_change_on_one_rank_is_named_within_the_check_interval_and_before_a_save(tmp_path):
    model, sample, traced, data_parallel, _, _ = classifier_case()
    root = tmp_path / "ckpt"
    results = run_ranks(_hook_on_rank_1, 2, model, sample, traced, data_parallel, str(root), timeout_s=60)
    assert results[0] == results[1]  # every rank raises the same
    (steps, error), at_save = results[0]
    assert steps == 3  # three steps taken; the fourth's forward compares and refuses
    assert error.startswith("the copies of replicated parameter fc2.weight differ across ranks after 3 training steps: "
                            "ranks [0] against ranks [1] hold different values, up to ")
    assert "more drifted" not in error  # fc2's bias and fc1 stayed equal
    assert at_save is not None and "before saving a checkpoint" in at_save and "fc2.weight" in at_save
    assert latest_checkpoint(root) is None  # nothing was written


def _checks(rank, world):
    """A (2, 2) mesh: 'a' split over axis 0 and replicated over axis 1 (ranks 0 and 1 hold block 0, ranks 2 and 3
    block 1, different values), 'b' replicated everywhere, 'c' split over both axes. Rank 3's copy of 'a' is then
    changed."""
    mesh = ProcessMesh((2, 2))
    specs = {"a": Spec.parse("S(0)R"), "b": Spec.parse("RR"), "c": Spec.parse("S(0)S(1)")}
    row = mesh.coordinate[0]
    params = {"a": torch.full((2, 3), float(row)), "b": torch.arange(6.0), "c": torch.full((2,), float(rank))}
    check_replicas(params.items(), specs, mesh, "at first", 0)  # different blocks, equal copies: nothing raised
    if rank == 3:
        params["a"][1, 2] += 1e-3
    try:
        check_replicas(params.items(), specs, mesh, "after an edit", 0)
    except DriftError as err:
        return str(err)
    return None


def test_only_copies_of_one_block_are_compared(spmd):
    errors = spmd(_checks, 4)
    assert len(set(errors)) == 1 and errors[0] is not None
    assert errors[0].startswith("the copies of replicated parameter a differ across ranks after an edit: ranks [2] "
                                "against ranks [3] hold different values, up to 0.001 apart.")


def _agreeing(rank, world, model, sample, traced, plan):
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    pm.drift_check_every = 1
    opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
    for _ in range(4):
        step(pm, opt, sample)
    return pm._forwards_since_check


def test_copies_kept_in_step_raise_nothing(spmd):
    """fc1's weight split, the rest replicated, checked before every step: training goes on."""
    model, sample, traced, _, split_weight, _ = classifier_case()
    assert spmd(_agreeing, 2, model, sample, traced, split_weight) == [1, 1]
