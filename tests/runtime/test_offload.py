"""The host tier (`runtime.offload`): a step with optimizer state on the host equals one device's.

On 2 gloo ranks, zoo models under random plans (tensor parallel, ZeRO storage, recompute) with every
parameter or a random subset on the host tier: loss, gradients and parameters after three AdamW steps match
the single-device reference (`tests.codegen.harness.check_steps`), the host masters never share storage
with the tensors the graph computes on, a checkpoint of the offloaded run resumes under a plan without
offload (GPT-2's first case), and the plan's device and host bytes are the storages measured in each pool.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from torch.utils import _pytree as pytree

import autopar
from autopar.errors import InfeasibleError, InvalidValueError
from autopar.api import profiled
from autopar.profiler import profile
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.solver import solve
from autopar.solver.mesh import make_mesh
from autopar.solver.offload import offloaded_profile, with_offload
from autopar.solver.plan import Plan
from autopar.solver.pinned import fixed_plan
from autopar.solver.strategies import enumerate_strategies
from tests.codegen.harness import (EPS, LR, check_steps, classifier_case, local_sample, loss_of, parallel_module, reference,
                                   train, zoo_case)
from tests.codegen.mixed import BF16, grad_error, grad_floor, param_error, tolerance, trace_mixed
from tests.codegen.plans import cpu_mesh, greedy_plan, random_plan

STEPS = 3


def _tiers(plan: Plan, host: set[str]) -> Plan:
    return replace(plan, params=tuple(replace(p, tier="host") if p.fqn in host else p for p in plan.params))


def _cases(name: str, seed: int) -> list[tuple[str, Plan]]:
    """Two random plans of zoo model `name` on 2 ranks: every parameter on the host, and a random half."""
    _, _, traced, _ = zoo_case(name)
    mesh, rng = cpu_mesh((2,)), random.Random(seed)
    strategies = enumerate_strategies(traced, mesh)
    fqns = list(traced.param_fqns.values())
    every = _tiers(random_plan(traced, mesh, rng, strategies), set(fqns))
    some = _tiers(random_plan(traced, mesh, rng, strategies), set(rng.sample(fqns, len(fqns) // 2)))
    return [(f"{name} all offloaded", every), (f"{name} half offloaded", some)]


def _check(rank: int, world: int, name: str, cases: list[tuple[str, Plan]], checkpoint: str | None) -> list[str]:
    model, sample, traced, ref = zoo_case(name)
    mesh = ProcessMesh((2,))
    checked = []
    for label, plan in cases:
        torch.manual_seed(0)
        pm = parallel_module(model, sample, traced, plan, mesh)
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
        check_steps(pm, opt, ref, range(STEPS - 1), label, [sample] * (STEPS - 1))
        offload = pm._offload
        hosted = set(plan.offloaded())
        assert set(offload.masters) == hosted, label
        device_storages = {c.untyped_storage().data_ptr() for c in offload.device_of.values()}
        device_storages |= {p.untyped_storage().data_ptr() for fqn, p in pm.named_parameters() if fqn not in hosted}
        for fqn, master in offload.masters.items():
            assert dict(pm.named_parameters())[fqn] is master, f"{label}: pm.parameters() yields {fqn}'s host master"
            assert master.untyped_storage().data_ptr() not in device_storages, f"{label}: {fqn}'s master aliases the device pool"
            for state in opt.state[master].values():
                assert state.untyped_storage().data_ptr() not in device_storages, f"{label}: {fqn}'s state in the device pool"
        if checkpoint is None or label != cases[0][0]:
            check_steps(pm, opt, ref, [STEPS - 1], label, [sample])
            checked.append(label)
            continue
        # the offloaded run saved, resumed under the same layout without offload, and its last step taken there
        pm.save_checkpoint(checkpoint, opt)
        resumed = parallel_module(model, sample, traced, _tiers(plan, set()), mesh)
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=LR, eps=EPS)
        resumed.load_checkpoint(checkpoint, resumed_opt)
        check_steps(resumed, resumed_opt, ref, [STEPS - 1], f"{label}, resumed without offload", [sample])
        checked.append(label)
    return checked


@pytest.mark.parametrize("name, resume", [("gpt2", True), ("llama", False)])
def test_offloaded_steps_match_one_device(name, resume, tmp_path):
    cases = _cases(name, seed=len(name))
    for checked in run_ranks(_check, 2, name, cases, str(tmp_path / "ckpt") if resume else None, timeout_s=200):
        assert checked == [label for label, _ in cases]


def _measure(rank: int, world: int, plan: Plan) -> dict[str, int]:
    model, sample, traced, _ = zoo_case("gpt2")
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((2,)))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    args, kwargs = local_sample(sample, pm)
    loss_of(pm(*args, **kwargs)).backward()
    opt.step()
    masters = set(pm._offload.masters.values())
    device = [*pm._offload.device_of.values(), *(p for p in pm.parameters() if p not in masters)]
    host = [*masters, *(m.grad for m in masters)]
    states = {id(p): [t for t in pytree.tree_leaves(s) if isinstance(t, torch.Tensor)] for p, s in opt.state.items()}
    device += [t for p in pm.parameters() if p not in masters for t in states.get(id(p), [])]
    host += [t for m in masters for t in states.get(id(m), [])]
    return {"device": _unique_bytes(device), "host": _unique_bytes(host)}


def _unique_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_predicted_device_and_host_bytes_are_measured():
    """The plan's device parameters + optimizer state and its host bytes against the storages in each pool, with
    ZeRO storage for half of the parameters and the other half (the blocks' weights among them) on the host."""
    _, _, traced, _ = zoo_case("gpt2")
    mesh = cpu_mesh((2,))
    prof = profile(traced)
    fqns = list(traced.param_fqns.values())
    host = set(fqns[::2])
    choices = {d.node: d.strategy for d in greedy_plan(traced, mesh, {n: "S(0)" for n in traced.input_names}).nodes}
    plan = with_offload(fixed_plan(traced, offloaded_profile(prof, host), mesh, choices, zero_params=frozenset(fqns[1::4])), host)
    assert set(plan.offloaded()) == host and plan.memory.host_bytes > 0
    for measured in run_ranks(_measure, 2, plan, timeout_s=120):
        predicted_device = plan.memory.params_bytes + plan.memory.optimizer_bytes
        assert abs(measured["device"] - predicted_device) <= 0.01 * predicted_device, (measured, plan.memory)
        assert abs(measured["host"] - plan.memory.host_bytes) <= 0.01 * plan.memory.host_bytes, (measured, plan.memory)


def _parallelized(rank: int, world: int, model, sample) -> tuple[tuple[str, ...], list[float], dict[str, torch.Tensor]]:
    pm = autopar.parallelize(model, sample, (2,), hardware="cpu", offload="optimizer", time_limit_s=5)
    assert all(p.device.type == "cpu" and p.is_pinned() == torch.cuda.is_available() for p in pm.parameters())
    losses = train(pm, sample, STEPS)
    return pm.plan.offloaded(), losses, pm.state_dict()


def test_parallelize_offload_optimizer_trains_as_one_device():
    model, sample = classifier_case()[:2]
    ref = reference(model, sample, STEPS)
    for offloaded, losses, state in run_ranks(_parallelized, 2, model, sample, timeout_s=120):
        assert set(offloaded) == {name for name, _ in model.named_parameters()}
        assert losses == pytest.approx(ref.losses, rel=1e-5)
        for name, want in ref.params[-1].items():
            torch.testing.assert_close(state[name], want, rtol=1e-4, atol=1e-5)
    with pytest.raises(InvalidValueError, match="not parameters of the model"):
        autopar.parallelize(model, sample, (1,), offload=["fc1.weight", "fc3.weight"])


def _auto(rank: int, world: int, model, sample, budget: float) -> tuple[tuple[str, ...], list[float], dict[str, torch.Tensor], str]:
    with pytest.raises(InfeasibleError) as device_only:  # the same budget, every optimizer state on the device
        autopar.parallelize(model, sample, (2,), memory_budget=budget, hardware="cpu", time_limit_s=5)
    pm = autopar.parallelize(model, sample, (2,), memory_budget=budget, hardware="cpu", offload="auto",
                             host_memory_bytes=1e9, time_limit_s=5)
    losses = train(pm, sample, STEPS)
    return pm.plan.offloaded(), losses, pm.state_dict(), str(device_only.value).splitlines()[-1]


def _least_bytes(traced, prof, host_budget_bytes: float | None) -> float:
    with pytest.raises(InfeasibleError) as err:
        solve(traced, prof, make_mesh(2, hardware="cpu"), memory_budget_bytes=1, time_limit_s=5,
              host_budget_bytes=host_budget_bytes)
    return err.value.min_memory_bytes


def test_parallelize_offload_auto_under_a_tight_budget_trains_as_one_device():
    """offload="auto" with a budget no device plan fits: the solver puts some parameters on the host tier, and the
    run matches one device. Without offload, the same budget's error names offload='auto' as a fix."""
    model, sample, traced = classifier_case()[:3]
    prof = profile(traced, optimizer="adamw")
    budget = (_least_bytes(traced, prof, 1e9 / 2) + _least_bytes(traced, prof, None)) / 2
    ref = reference(model, sample, STEPS)
    for offloaded, losses, state, fix in run_ranks(_auto, 2, model, sample, budget, timeout_s=120):
        assert "pass memory_budget=" in fix and "pass offload='auto'" in fix
        assert offloaded
        assert losses == pytest.approx(ref.losses, rel=1e-5)
        for name, want in ref.params[-1].items():
            torch.testing.assert_close(state[name], want, rtol=1e-4, atol=1e-5)


def _accumulated(rank: int, world: int, model, sample, traced, plan) -> dict[str, torch.Tensor]:
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((2,)))
    args, kwargs = local_sample(sample, pm)
    with pm.no_sync():  # this rank's term stays on the device, for the synced backward to sum
        loss_of(pm(*args, **kwargs)).backward()
    assert all(m.grad is None for m in pm._offload.masters.values())
    loss_of(pm(*args, **kwargs)).backward()
    return {fqn: p.grad for fqn, p in pm.named_parameters()}, pm.clip_grad_norm_(1e9)


def test_no_sync_micro_batches_add_up_on_the_host():
    """Two backward calls, the first under no_sync(), on a data-parallel plan with every parameter on the host: each
    master's gradient is twice one device's (the gradient sync's buckets carry them all), and so is their norm."""
    model, sample, traced, data_parallel = classifier_case()[:4]
    plan = _tiers(data_parallel, {name for name, _ in model.named_parameters()})
    ref = reference(model, sample, 1)
    norm = torch.linalg.vector_norm(torch.cat([2 * g.reshape(-1) for g in ref.grads[0].values()]))
    for grads, clipped_by in run_ranks(_accumulated, 2, model, sample, traced, plan, timeout_s=120):
        torch.testing.assert_close(clipped_by, norm, rtol=1e-5, atol=0)  # the host gradients' norm, as one device's
        assert set(grads) == set(ref.grads[0])
        for fqn, want in ref.grads[0].items():
            torch.testing.assert_close(grads[fqn], 2 * want, rtol=1e-4, atol=1e-6)


def _mixed_steps(rank: int, world: int, model, sample, traced, plans: list[Plan]) -> list[tuple[list[float], dict]]:
    """Each plan's losses and this rank's gradients and parameters after two AdamW steps under bf16 mixed precision, the
    first of two backward calls (one under no_sync())."""
    out = []
    for plan in plans:
        pm = parallel_module(model, sample, traced, plan, ProcessMesh((2,)), mixed_precision=BF16)
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
        args, kwargs = local_sample(sample, pm)
        losses, grads = [], []
        for step in range(2):
            opt.zero_grad()
            if step == 0:  # a micro-batch first: accumulated in float32 on the masters, wherever they are
                with pm.no_sync():
                    loss_of(pm(*args, **kwargs)).backward()
            loss = loss_of(pm(*args, **kwargs))
            loss.backward()
            grads.append({fqn: p.grad.clone() for fqn, p in pm.named_parameters() if p.grad is not None})
            opt.step()
            losses.append(loss.item())
        hosted = set(plan.offloaded())
        assert all(p.dtype == torch.float32 and (fqn not in hosted or p.device.type == "cpu")
                   for fqn, p in pm.named_parameters())
        if hosted:  # ZeRO-Offload's layout: a copied parameter keeps its bf16 copy alone on the device, no gradient
            lean = pm._offload.lean
            assert set(lean) == set(pm.info.compute_copies) & hosted and lean, "the copied parameters are lean"
            assert all(pm._offload.device_of[fqn].dtype == torch.bfloat16 and pm._offload.device_of[fqn].grad is None
                       for fqn in lean)
            assert pm._copies is None or not set(pm._copies.names) & set(lean)
        out.append((losses, grads, {fqn: p.detach().clone() for fqn, p in pm.named_parameters()}))
    return out


def test_mixed_precision_masters_on_the_host_step_as_on_the_device():
    """bf16 compute on float32 masters, a random plan with ZeRO and tensor-parallel parameters: with every master
    and its AdamW state on the host, the device keeps only the bf16 copies and the gradients leave it in bf16, and
    the run (its first step accumulating two backward calls, one under no_sync()) is the same plan's without offload (whose match with one device `tests/codegen/test_mixed_precision`
    checks) within the bf16 recipe's measured spread (`tests.codegen.mixed.tolerance`): the summed gradients are
    rounded to bf16 on their way to the host, as ZeRO-Offload sends them."""
    model, sample, _, _ = zoo_case("gpt2")
    traced = trace_mixed(model, sample)
    plan = random_plan(traced, cpu_mesh((2,)), random.Random(5))
    hosted = _tiers(plan, set(traced.param_fqns.values()))
    allowed = tolerance("gpt2")
    for (losses, grads, params), (losses_h, grads_h, params_h) in run_ranks(_mixed_steps, 2, model, sample, traced,
                                                                             [plan, hosted], timeout_s=120):
        assert losses_h[0] == pytest.approx(losses[0], rel=1e-6)  # the same values before any step
        assert losses_h[1] == pytest.approx(losses[1], rel=allowed["loss"])
        assert params_h.keys() == params.keys()
        for got, want in zip(grads_h, grads):  # each step's: the first's the sum of two backward calls
            assert got.keys() == want.keys()
            floor = grad_floor(want)
            assert max(grad_error(got[fqn], want[fqn], floor) for fqn in want) <= allowed["grad"]
        assert max(param_error(params_h[fqn], params[fqn], 2) for fqn in params) <= allowed["param"]


def _measure_lean(rank: int, world: int, model, sample, traced, plan: Plan) -> dict[str, int]:
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((2,)), mixed_precision=BF16)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    args, kwargs = local_sample(sample, pm)
    loss_of(pm(*args, **kwargs)).backward()
    masters = set(pm._offload.masters.values())
    on_device = [p for p in pm.parameters() if p not in masters]
    lean = [pm._offload.device_of[fqn] for fqn in pm._offload.lean]
    grads = {"device": _unique_bytes([p.grad for p in on_device if p.grad is not None] + [c.grad for c in lean if c.grad is not None]),
             "host": _unique_bytes([m.grad for m in masters])}
    opt.step()
    states = {id(p): [t for t in pytree.tree_leaves(s) if isinstance(t, torch.Tensor)] for p, s in opt.state.items()}
    copies = [] if pm._copies is None else [pm._copies.flat]
    device = [*pm._offload.device_of.values(), *on_device, *copies, *(t for p in on_device for t in states[id(p)])]
    host = [*masters, *(m.grad for m in masters), *(t for m in masters for t in states[id(m)])]
    return {"device": _unique_bytes(device), "host": _unique_bytes(host), "grads": grads, "lean": len(lean)}


def test_bf16_host_tier_keeps_only_the_copies_on_the_device():
    """ZeRO-Offload's layout, priced and measured: GPT-2 under bf16 on 2 ranks, data parallel, half of the parameters
    on the host tier. On the device: their bf16 copies alone (no float32 value, no gradient once backward ended);
    the plan's device parameters and optimizer state, its gradients less the bound it puts on those in flight, and its
    host bytes are the storages measured in each pool."""
    model, sample, _, _ = zoo_case("gpt2")
    traced = trace_mixed(model, sample)
    prof = profiled(traced, "adamw", model, BF16)
    mesh = cpu_mesh((2,))
    fqns = list(traced.param_fqns.values())
    host = set(fqns[::2])
    choices = {d.node: d.strategy for d in greedy_plan(traced, mesh, {n: "S(0)" for n in traced.input_names}).nodes}
    before = fixed_plan(traced, prof, mesh, choices)  # every parameter on the device
    plan = with_offload(fixed_plan(traced, offloaded_profile(prof, host), mesh, choices), host)
    copies = {fqn: p.copy_bytes for fqn, p in prof.params.items() if fqn in host and p.copy_bytes}
    in_flight = plan.memory.grads_bytes - (before.memory.grads_bytes - plan.memory.host_grads_bytes)
    # (every lean gradient at once, a tiny model's all fitting one bucket: the copies' bf16 and their float32 sums)
    assert in_flight == pytest.approx(sum(3 * p.copy_bytes for fqn, p in prof.params.items() if fqn in host))
    assert plan.memory.params_bytes == pytest.approx(before.memory.params_bytes - plan.memory.host_params_bytes)
    for measured in run_ranks(_measure_lean, 2, model, sample, traced, plan, timeout_s=120):
        assert measured["lean"] == len(copies) > 0
        assert measured["device"] == pytest.approx(plan.memory.params_bytes + plan.memory.optimizer_bytes, rel=1e-3)
        assert measured["host"] == pytest.approx(plan.memory.host_bytes, rel=1e-3)
        assert measured["grads"]["device"] == pytest.approx(plan.memory.grads_bytes - in_flight, rel=1e-3)
        assert measured["grads"]["host"] == pytest.approx(plan.memory.host_grads_bytes, rel=1e-3)
