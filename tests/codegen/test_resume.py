"""Checkpoint and resume: parameters and optimizer state saved under one plan, training resumed under another.

A run that stops after two AdamW steps and resumes for two more must take the same steps as one
device that never stopped: Adam's moments and step count carry over, split as each parameter is
split, whatever the plans and meshes of the two halves. The checkpoint is torch.distributed.checkpoint's,
so one device's model and optimizer load it with torch alone.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tests.codegen.harness import (EPS, LR, LogRecords, call, check_steps, load_on_one_device, loss_of, parallel_module, reference,
                                   trace_model, train_on_one_device)
from tests.codegen.plans import cpu_mesh, greedy_plan, load_zoo, random_plan

import autopar
from autopar.codegen.shapes import LoweringError
from autopar.runtime.checkpoints import latest_checkpoint
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.state_dict import StateDictError

STEPS, STOP = 4, 2  # the reference trains STEPS steps; the parallel run stops after STOP and resumes


def _gpt2():
    return load_zoo("gpt2").build(batch_size=8, seq_len=16, size="tiny", device="cpu")


def _one_device_after(model, sample, steps: int):
    """One device's model and AdamW after `steps` steps (the reference's optimizer settings)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(call(model, sample)).backward()
        opt.step()
    return model, opt


def _first_half(rank, world, model, sample, traced, plan, ref, path):
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((2, 2)))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    check_steps(pm, opt, ref, range(STOP), "first half (2x2)", [sample] * STOP)
    pm.save_checkpoint(path, opt)


def _second_half(rank, world, model, sample, traced, plans, ref, path, full_model, full_osd):
    """Each plan starts from the untrained model and a fresh AdamW, loads the first half's state (from the
    checkpoint, or from one device's full state dicts) and must take the reference's remaining steps."""
    mesh = ProcessMesh((world,))
    resumed_osd = None
    for how, plan in plans:
        pm = parallel_module(model, sample, traced, plan, mesh)
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
        if how == "checkpoint":
            pm.load_checkpoint(path, opt)
            resumed_osd = pm.optimizer_state_dict(opt)
        else:
            pm.load_state_dict(full_model)
            pm.load_optimizer_state_dict(opt, full_osd)
        check_steps(pm, opt, ref, range(STOP, STEPS), f"resumed from the {how} ({plan.mesh.shape})", [sample] * (STEPS - STOP))
    return resumed_osd


def _assert_same_optimizer_state(got, want):
    assert got["param_groups"] == want["param_groups"]
    assert list(got["state"]) == list(want["state"])
    for fqn, entries in want["state"].items():
        assert list(got["state"][fqn]) == list(entries), fqn
        for name, value in entries.items():
            torch.testing.assert_close(got["state"][fqn][name], value, rtol=1e-4, atol=1e-6, msg=lambda m: f"{fqn} {name}: {m}")


@pytest.mark.timeout(300)
def test_resume_under_another_plan_and_mesh_trains_like_one_device(tmp_path):
    """Two steps under a random 2x2 plan with ZeRO storage, a checkpoint, two more steps on 2 ranks under
    another random plan and under a data-parallel one: losses, gradients and parameters match one device
    that trained four steps. The second half's gathered optimizer state is one device's after two steps,
    and one device's model and optimizer load the checkpoint with torch alone and train on like it."""
    model, sample = _gpt2()
    traced = trace_model(model, sample)
    ref = reference(model, sample, STEPS)
    first = random_plan(traced, cpu_mesh((2, 2)), random.Random(5))
    assert any(p.zero for p in first.params), "the first half's plan should split some optimizer state by ZeRO"
    mesh = cpu_mesh((2,))
    second = [("checkpoint", random_plan(traced, mesh, random.Random(8))),
              ("checkpoint", greedy_plan(traced, mesh, {n: "S(0)" for n in traced.input_names})),
              ("full state dicts", random_plan(traced, mesh, random.Random(9)))]
    one_model, one_opt = _one_device_after(model, sample, STOP)
    one_osd = get_optimizer_state_dict(one_model, one_opt)
    path = str(tmp_path / "ckpt")

    run_ranks(_first_half, 4, model, sample, traced, first, ref, path, timeout_s=240)
    resumed = run_ranks(_second_half, 2, model, sample, traced, second, ref, path, one_model.state_dict(), one_osd,
                        timeout_s=240)
    for osd in resumed:
        _assert_same_optimizer_state(osd, one_osd)

    fresh, opt = load_on_one_device(model, latest_checkpoint(path))
    _assert_same_optimizer_state(get_optimizer_state_dict(fresh, opt), one_osd)
    train_on_one_device(fresh, opt, sample, ref, range(STOP, STEPS), atol=1e-4)


def _load_mismatched(rank, world, model, sample, traced, plan, path, other_path):
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    pm.save_checkpoint(path)  # no optimizer state
    errors = []
    for where in (path, other_path):
        try:
            pm.load_checkpoint(where, opt)
        except StateDictError as e:
            errors.append(str(e))
    return errors


@pytest.mark.timeout(120)
def test_a_checkpoint_that_does_not_match_says_why(tmp_path):
    """Loading optimizer state from a checkpoint saved without it, or a checkpoint of a wider model, raises
    a StateDictError naming the checkpoint and what is missing or mismatched (the tensor, both shapes)."""
    zoo = load_zoo("mlp")
    model, sample = zoo.build(batch_size=8, size="tiny", device="cpu")
    wider = zoo.MLP(zoo.MLPConfig(n_layers=3, dim=32, hidden=128))
    other_path = str(tmp_path / "wider")
    torch.distributed.checkpoint.save({"model": wider.state_dict()}, checkpoint_id=other_path, no_dist=True)
    traced = trace_model(model, sample)
    plan = greedy_plan(traced, cpu_mesh((2,)), {n: "S(0)" for n in traced.input_names})
    errors = run_ranks(_load_mismatched, 2, model, sample, traced, plan, str(tmp_path / "ckpt"), other_path, timeout_s=100)[0]
    assert len(errors) == 2, errors
    assert "ckpt" in errors[0] and "saved without one" in errors[0], errors[0]
    assert "wider" in errors[1] and "saved torch.Size([128, 32]) and current: torch.Size([64, 32]) for model.layers.0.fc1.weight" in errors[1], errors[1]


def _from_meta(rank, world, meta_model, sample, path, buffers, ref):
    records = LogRecords("autopar.codegen.module")
    pm = autopar.parallelize(meta_model, sample, (world,), memory_budget=1.5e6)  # tight: some ZeRO storage
    with pytest.raises(LoweringError, match="on the meta device"):
        pm(**sample)
    with pytest.raises(LoweringError, match=r"on the meta device .* pm.to_empty\(device=...\) first, then pm.apply"):
        pm.apply(lambda module: None)  # (it gathered meta tensors, and the ranks hung until the timeout)
    pm.to_empty(device="cpu")
    pm.load_checkpoint(path)
    pm.load_state_dict(buffers, strict=False)  # the non-persistent ones the log names
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    check_steps(pm, opt, ref, range(2), "built on meta", [sample] * 2)
    return sum(p.zero for p in pm.plan.params), records.messages


@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_model_built_on_meta_trains_from_a_checkpoint(tmp_path):
    """The flow for a model larger than one device: HF Llama built on meta, parallelized on 4 ranks under a tight
    budget (its shards stay on meta; calling it says what to do), `to_empty`, a checkpoint one device wrote
    with torch alone, and the non-persistent rotary buffers the log names loaded as full tensors: two steps
    match one device's."""
    zoo = load_zoo("hf_llama")
    model, sample = zoo.build(batch_size=8, seq_len=16, size="tiny", device="cpu")
    meta_model, _ = zoo.build(batch_size=8, seq_len=16, size="tiny", device="meta")
    path = str(tmp_path / "one_device")
    dcp.save({"model": model.state_dict()}, checkpoint_id=path, no_dist=True)
    unsaved = {n: b for n, b in model.named_buffers() if n not in model.state_dict()}
    assert unsaved, "the test wants buffers a checkpoint does not hold"
    ref = reference(model, sample, 2)
    results = run_ranks(_from_meta, 4, meta_model, sample, path, unsaved, ref, timeout_s=220)
    assert results[0][0] > 0, "the tight budget should store some parameters as ZeRO shards"
    warned = [m for m in results[0][1] if "off the meta device" in m]
    assert len(warned) == 1 and all(n in warned[0] for n in unsaved), results[0][1]


def _from_pretrained(rank, world, meta_model, sample, traced, plans, path, ref):
    for label, plan in plans:
        pm = parallel_module(meta_model, sample, traced, plan, ProcessMesh((2, 2)))
        pm.to_empty(device="cpu")
        pm.load_checkpoint(path)  # a save_pretrained directory: each rank reads its blocks of the safetensors
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
        check_steps(pm, opt, ref, range(2), label, [sample] * 2)
    with pytest.raises(StateDictError, match="holds weights only"):
        pm.load_checkpoint(path, opt)


@pytest.mark.timeout(240)
def test_a_hugging_face_directory_loads_into_a_model_built_on_meta(tmp_path):
    """HF GPT-2 (its LM head tied to the token embedding, which `save_pretrained` writes once) built on meta, under
    a data-parallel and a random 2x2 plan (tensor splits, ZeRO), `to_empty`, then `load_checkpoint` of the directory
    `save_pretrained` wrote: two steps match one device's. Optimizer state from such a directory is refused."""
    zoo = load_zoo("hf_gpt2")
    model, sample = zoo.build(batch_size=8, seq_len=16, size="tiny", device="cpu")
    meta_model, _ = zoo.build(batch_size=8, seq_len=16, size="tiny", device="meta")
    model.save_pretrained(tmp_path / "pretrained")
    traced = trace_model(model, sample)
    ref = reference(model, sample, 2)
    mesh = cpu_mesh((2, 2))
    plans = [("data parallel", greedy_plan(traced, mesh, {n: "S(0)S(0)" for n in traced.input_names})),
             ("random", random_plan(traced, mesh, random.Random(17)))]
    run_ranks(_from_pretrained, 4, meta_model, sample, traced, plans, str(tmp_path / "pretrained"), ref, timeout_s=220)


def _copies_train_apart(rank, world, model, sample, traced, plans, ref):
    for label, plan in plans:
        pm = parallel_module(model, sample, traced, plan, ProcessMesh((2, 2)))
        twin = copy.deepcopy(pm)  # an EMA's or an eval copy's way
        for module in (twin, pm):  # the copy first: training it must leave the original as it was
            opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
            check_steps(module, opt, ref, range(2), f"{label}, {'copy' if module is twin else 'original'}", [sample] * 2)


@pytest.mark.timeout(240)
def test_a_deep_copy_trains_apart_from_its_original():
    """`copy.deepcopy(pm)` (it raised: process groups cannot be pickled) gives a module with its own parameters
    and its own gradient sync on the same mesh: under a data-parallel and a random 2x2 plan the copy trains
    like one device, and the original, untouched by that, then trains like one device too."""
    model, sample = _gpt2()
    traced = trace_model(model, sample)
    ref = reference(model, sample, 2)
    mesh = cpu_mesh((2, 2))
    plans = [("data parallel", greedy_plan(traced, mesh, {n: "S(0)S(0)" for n in traced.input_names})),
             ("random", random_plan(traced, mesh, random.Random(21)))]
    run_ranks(_copies_train_apart, 4, model, sample, traced, plans, ref, timeout_s=220)


def _save_in_background(rank, world, model, sample, traced, plan, path, ref):
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    check_steps(pm, opt, ref, range(1), "before the save", [sample])
    pm.save_checkpoint(path, opt, background=True)
    check_steps(pm, opt, ref, range(1, 3), "while it writes", [sample] * 2)  # training goes on, collectives and all
    resumed = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = torch.optim.AdamW(resumed.parameters(), lr=LR, eps=EPS)
    resumed.load_checkpoint(path, opt)
    check_steps(resumed, opt, ref, range(1, 3), "from the background save", [sample] * 2)


@pytest.mark.timeout(120)
def test_a_background_save_holds_the_state_of_its_call(tmp_path):
    """`save_checkpoint(background=True)` after one step, two more steps while it writes: the checkpoint holds the
    state after the first step (a module loading it takes the same two steps again, like one device), not
    parameters the later steps changed under the writer. The load waits for the write, unasked."""
    model, sample = _gpt2()
    traced = trace_model(model, sample)
    ref = reference(model, sample, 3)
    plan = random_plan(traced, cpu_mesh((2,)), random.Random(8))
    run_ranks(_save_in_background, 2, model, sample, traced, plan, str(tmp_path / "ckpt"), ref, timeout_s=100)
