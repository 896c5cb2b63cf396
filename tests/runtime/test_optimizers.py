"""Optimizers that read whole parameters: refused on a rank's blocks, planned for with their parameters whole.

Adafactor's row and column statistics and Muon's orthogonalised matrix, computed on a
rank's block of a tensor-parallel weight, are not one device's: the parameters would
drift without an error. `runtime.optimizers` refuses such a step before it changes
anything; `parallelize(..., optimizer="adafactor")` (or "muon") plans every parameter
whole, and then training matches one device's.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.profiler.profile import profile
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.optimizers import OptimizerError
from autopar.solver.mesh import make_mesh
from autopar.solver import baseline_plan, baseline_plans, solve
from tests.codegen.harness import LogRecords, classifier_case, local_sample, loss_of, parallel_module, step, trace_model
from tests.codegen.plans import cpu_mesh, load_zoo


def _gpt2():
    return load_zoo("gpt2").build(batch_size=4, seq_len=16, size="tiny", device="cpu")


def _split_params(plan) -> int:
    return sum(not (p.use.is_replicate() and p.storage.is_replicate()) for p in plan.params)


def test_whole_parameter_optimizers_plan_every_parameter_whole():
    """On the CPU preset's 2 ranks, AdamW's plan splits a parameter (and more under a tighter budget);
    Adafactor's and Muon's keep every one whole at each budget."""
    model, sample = _gpt2()
    traced = trace_model(model, sample)
    mesh = make_mesh(2, (2,), "cpu")
    for budget in (None, 2.5e6):
        # the cost model's fastest plan (margin 0: not the simplest within its error, `solver.robust`)
        assert _split_params(solve(traced, profile(traced, optimizer="adamw"), mesh, memory_budget_bytes=budget,
                                   margin=0.0)) > 0
        for name in ("adafactor", "muon"):
            plan = solve(traced, profile(traced, optimizer=name), mesh, memory_budget_bytes=budget)
            assert _split_params(plan) == 0, (name, budget)
    # of the textbook plans `autopar plan` compares with, the one such an optimizer can step
    assert [b.name for b in baseline_plans(traced, profile(traced, optimizer="adafactor"), mesh)] == ["data_parallel"]


def _one_device(model, sample, make_opt, steps: int):
    ref = copy.deepcopy(model)
    opts = make_opt(ref)
    losses = []
    for _ in range(steps):
        loss = loss_of(ref(**sample))
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _adafactor(model):
    return [torch.optim.Adafactor(model.parameters(), lr=1e-3, foreach=False)]


def _muon_and_adamw(model):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, make_opt", [("adafactor", _adafactor), ("muon", _muon_and_adamw)])
def test_whole_parameter_plans_train_like_one_device(name, make_opt):
    """`parallelize(optimizer=name)` on 2 ranks under a budget where AdamW's plan splits 2 parameters:
    three steps of torch's optimizer give one device's losses and parameters. Muon orthogonalises in
    bfloat16, where the gradients' last-bit differences (their sum over ranks) round apart: its parameters
    agree to 1e-4, against steps of about 3e-3 per element (what a rank's block would get wrong)."""
    model, sample = _gpt2()
    want_losses, want_params = _one_device(model, sample, make_opt, 3)

    def body(rank, world):
        pm = autopar.parallelize(model, sample, (world,), memory_budget=2.5e6, optimizer=name)
        opts = make_opt(pm)
        args, kwargs = local_sample(sample, pm)
        losses = []
        for _ in range(3):
            loss = loss_of(pm(*args, **kwargs))
            loss.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        return _split_params(pm.plan), losses, {n: p.detach().clone() for n, p in pm.named_parameters()}

    for split, losses, params in run_ranks(body, 2, timeout_s=200):
        assert split == 0
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
        for fqn, p in params.items():
            torch.testing.assert_close(p, want_params[fqn], rtol=1e-4, atol=1e-4 if name == "muon" else 1e-5,
                                       msg=lambda m: f"{name}: {fqn}: {m}")


class _PlainSGD(torch.optim.Optimizer):
    """A class the check does not know (elementwise, as it happens)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-2})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.timeout(120)
def test_whole_parameter_optimizer_on_blocks_is_refused_before_stepping():
    """Under Megatron's plan (weights split over the 2 ranks), Adafactor's and Muon's steps raise, naming
    the optimizer, a split weight and the plan to make, and leave every parameter as it was; AdamW steps;
    an optimizer class of the user's steps with one warning naming the concern, however many steps."""
    model, sample = _gpt2()
    traced = trace_model(model, sample)
    plan = baseline_plan(traced, profile(traced), cpu_mesh((2,)), "megatron")
    assert _split_params(plan) > 0

    def body(rank, world):
        pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
        args, kwargs = local_sample(sample, pm)
        loss_of(pm(*args, **kwargs)).backward()
        before = {n: p.detach().clone() for n, p in pm.named_parameters()}
        errors = []
        for opt in (torch.optim.Adafactor(pm.parameters()), torch.optim.Muon([p for p in pm.parameters() if p.ndim == 2])):
            with pytest.raises(OptimizerError) as err:
                opt.step()
            errors.append(str(err.value))
        unchanged = all(torch.equal(p, before[n]) for n, p in pm.named_parameters())
        torch.optim.AdamW(pm.parameters()).step()
        moved = not all(torch.equal(p, before[n]) for n, p in pm.named_parameters())
        log = LogRecords("autopar.runtime.optimizers")
        mine = _PlainSGD(pm.parameters())
        mine.step()
        mine.step()
        return errors, unchanged, moved, log.messages

    errors, unchanged, moved, warnings = run_ranks(body, 2, timeout_s=100)[0]
    assert "Adafactor reads row and column means" in errors[0] and "optimizer='adafactor'" in errors[0]
    assert "Muon reads the whole matrix" in errors[1] and "optimizer='muon'" in errors[1]
    assert all("split on dim" in e and "Nothing was stepped" in e for e in errors)
    assert unchanged and moved
    assert len(warnings) == 1 and "_PlainSGD steps" in warnings[0]


def _made_before(rank, world, model, sample):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # DDP's order: the optimizer first, then the wrapper
    pm = autopar.parallelize(model, sample, (world,))
    args, kwargs = local_sample(sample, pm)
    loss_of(pm(*args, **kwargs)).backward()
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    with pytest.raises(OptimizerError) as err:
        opt.step()
    eager = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the model trained on its own, beside: its business
    loss_of(model(**sample)).backward()
    eager.step()
    torch.optim.AdamW(pm.parameters(), lr=1e-2).step()
    return str(err.value), sum(not torch.equal(p, before[n]) for n, p in pm.named_parameters())


@pytest.mark.timeout(120)
def test_an_optimizer_of_the_models_parameters_is_refused():
    """An optimizer made from the model's parameters before `parallelize` held tensors the parallel module
    does not train: no gradients reached them, and its steps changed nothing, silently. Its first step is
    refused; the model trained eagerly beside the module steps; the module's own optimizer moves every
    parameter."""
    model, sample = _gpt2()
    message, moved = run_ranks(_made_before, 2, model, sample, timeout_s=100)[0]
    assert "holds 28 parameters of the model given to parallelize" in message and "pm.parameters()" in message
    assert moved == len(list(model.parameters()))


def _resumed(rank, world, model, sample, traced, plan, from_rank_0):
    """Two Adam steps, the optimizer's own state_dict() kept (each rank its own, or rank 0's on every rank, as a
    DDP loop saves it on rank 0), two more steps; then the same two steps of a module and optimizer loaded
    from what was kept."""
    mesh = ProcessMesh((world,))
    pm = parallel_module(model, sample, traced, plan, mesh)
    opt = torch.optim.Adam(pm.parameters(), lr=0.01)
    for _ in range(2):
        step(pm, opt, sample)
    saved = [pm.state_dict(), copy.deepcopy(opt.state_dict())]  # deep: the state dict holds the live tensors
    if from_rank_0:
        torch.distributed.broadcast_object_list(saved, src=0)
    for _ in range(2):
        step(pm, opt, sample)
    resumed = parallel_module(model, sample, traced, plan, mesh)
    resumed.load_state_dict(saved[0])
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    resumed_opt.load_state_dict(saved[1])
    for _ in range(2):
        step(resumed, resumed_opt, sample)
    return {fqn: torch.equal(p, dict(resumed.named_parameters())[fqn]) for fqn, p in pm.named_parameters()}


def test_an_optimizer_state_saved_by_one_rank_is_refused_on_the_others():
    """fc1's weight stored split over 2 ranks: an optimizer's state_dict() holds each rank's block of Adam's
    moments. Loaded by the rank that saved it, training resumes exactly; rank 0's loaded on rank 1 (same
    shapes) resumed with rank 0's rows' moments and drifted by 3e-2 in two steps, silently: now refused."""
    model, sample, traced, _, split_weight, _ = classifier_case()
    for same in run_ranks(_resumed, 2, model, sample, traced, split_weight, False, timeout_s=60):
        assert all(same.values()), same
    with pytest.raises(Exception) as refused:
        run_ranks(_resumed, 2, model, sample, traced, split_weight, True, timeout_s=60)
    assert "rank 1 raised OptimizerError" in str(refused.value)
    assert "for fc1.weight (split on dim 0 over dp) this rank holds block 1, and the loaded state is block 0's" in str(refused.value)
    assert "pm.optimizer_state_dict(optimizer) on every rank" in refused.value.remote_traceback


def _zero_redundancy(rank, world, model, sample, traced, plan):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = ZeroRedundancyOptimizer(pm.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    before = {fqn: p.detach().clone() for fqn, p in pm.named_parameters()}
    try:
        step(pm, opt, sample)
    except OptimizerError as err:
        return str(err), all(torch.equal(p, before[fqn]) for fqn, p in pm.named_parameters())
    reference = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    step(reference, torch.optim.Adam(reference.parameters(), lr=0.01), sample)
    return None, all(torch.equal(p, dict(reference.named_parameters())[fqn]) for fqn, p in pm.named_parameters())


def test_zero_redundancy_optimizer_is_refused_on_split_parameters():
    """torch's ZeRO-1 optimizer broadcasts each parameter from the rank that steps it: under a plan storing fc1's
    weight split, rank 1's block became rank 0's (0.65 off after two steps), with only the unknown-optimizer
    warning. Now refused before stepping; under a data-parallel plan it steps as Adam does."""
    model, sample, traced, data_parallel, split_weight, _ = classifier_case()
    for message, untouched in run_ranks(_zero_redundancy, 2, model, sample, traced, split_weight, timeout_s=60):
        assert "ZeroRedundancyOptimizer steps each parameter on one rank" in message and "fc1.weight" in message
        assert untouched
    for message, same in run_ranks(_zero_redundancy, 2, model, sample, traced, data_parallel, timeout_s=60):
        assert message is None and same


def _scaled(rank, world, model, sample, traced, plan, sharded):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = torch.optim.Adam(pm.parameters(), lr=0.01)
    scaler = ShardedGradScaler("cpu", process_group=torch.distributed.group.WORLD) if sharded else torch.amp.GradScaler("cpu")
    before = {fqn: p.detach().clone() for fqn, p in pm.named_parameters()}
    args, kwargs = local_sample(sample, pm)
    scaler.scale(pm(*args, **kwargs)).backward()
    try:
        scaler.step(opt)
    except OptimizerError as err:
        return str(err), all(torch.equal(p, before[fqn]) for fqn, p in pm.named_parameters())
    return None, all(torch.equal(p, before[fqn]) for fqn, p in pm.named_parameters())


def test_a_plain_grad_scaler_is_refused_on_split_parameters():
    """GradScaler skips a step when this rank's gradients overflow; a split parameter's gradient is a different
    block on each rank, so ranks could skip apart and part for good. Refused before stepping, naming
    ShardedGradScaler, which steps (it agrees on overflows across ranks); under a plan splitting nothing, the
    plain scaler steps."""
    model, sample, traced, data_parallel, split_weight, _ = classifier_case()
    for message, untouched in run_ranks(_scaled, 2, model, sample, traced, split_weight, False, timeout_s=60):
        assert message.startswith("GradScaler skips a step") and "ShardedGradScaler(process_group=" in message
        assert untouched
    for plan, sharded in ((split_weight, True), (data_parallel, False)):
        for message, untouched in run_ranks(_scaled, 2, model, sample, traced, plan, sharded, timeout_s=60):
            assert message is None and not untouched
