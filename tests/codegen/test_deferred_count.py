"""A mean loss over the global token count is exact in every use, its division by the
count leaving backward for the gradient sync only when that is exact.

GPT-2 tiny, data parallel on 2 gloo ranks, ignored labels all on rank 0 (the two
ranks' counts differ). Each way a training loop may use the loss (fresh grads,
accumulation, two losses in one backward, `no_sync`, `torch.autograd.grad`, `create_graph`, a gradient hook,
gradient through the logits too) is checked against the single-device gradients of the same global batch,
and the test records what `GradSync.defer_scale` decided, so a case that silently
took the other path fails too.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.codegen.harness import loss_of, reference, trace_model
from tests.codegen.plans import cpu_mesh, greedy_plan, load_zoo

from autopar.codegen import ParallelModule, lower
from autopar.runtime.batch import batch_slice
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.tracer import split_sample_input


def _module(model, traced, plan) -> tuple[ParallelModule, list[bool]]:
    mesh = ProcessMesh((2,))
    pm = ParallelModule(lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False))),
                        traced, mesh, plan)
    decisions: list[bool] = []
    take = pm._sync.defer_scale

    def recorded(count):
        decisions.append(take(count))
        return decisions[-1]

    pm._sync.defer_scale = recorded
    return pm, decisions


def _grads(pm: ParallelModule) -> dict[str, torch.Tensor]:
    return {fqn: p.grad.clone() for fqn, p in pm.named_parameters()}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for fqn, g in want.items():
        torch.testing.assert_close(got[fqn], g, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: grad of {fqn}: {m}")


def _cases(rank, world, model, sample, traced, plan, want):
    pm, decisions = _module(model, traced, plan)
    args, kwargs = batch_slice(split_sample_input(sample), rank, world)

    def step():
        return loss_of(pm(*args, **kwargs))

    step().backward()  # fresh grads, one loss: the sync divides
    assert decisions == [True], decisions
    _close(_grads(pm), want, "fresh")

    step().backward()  # accumulation onto the synced sums: backward divides
    assert decisions == [True, False], decisions
    _close(_grads(pm), {k: 2 * v for k, v in want.items()}, "accumulated")

    pm.zero_grad(set_to_none=True)
    with pm._sync.no_sync():
        step().backward()
    step().backward()  # accumulation onto a local term (no_sync's): it is reduced whole, backward divides
    assert decisions == [True, False, True, False], decisions
    _close(_grads(pm), {k: 2 * v for k, v in want.items()}, "accumulated onto no_sync's")

    pm.zero_grad(set_to_none=True)
    (step() + step()).backward()  # two losses in one backward: each keeps its own division
    assert decisions[-2:] == [False, False], decisions
    _close(_grads(pm), {k: 2 * v for k, v in want.items()}, "two losses")

    # no_sync: each rank's own (unreduced) term, divided by the global count (by the sync's `finish`)
    pm.zero_grad(set_to_none=True)
    with pm._sync.no_sync():
        step().backward()
    local = _grads(pm)
    pm.zero_grad(set_to_none=True)
    with pm._sync.no_sync():
        loss = step()
        pm._sync.forbid_deferral()
        loss.backward()
    assert decisions[-2:] == [True, False], decisions
    _close(local, _grads(pm), "no_sync, either path")
    pm.zero_grad(set_to_none=True)
    step().backward()
    for v in local.values():
        torch.distributed.all_reduce(v)
    _close(local, _grads(pm), "no_sync terms summed")

    # torch.autograd.grad returns each rank's term, accumulating nothing: backward divides
    pm.zero_grad(set_to_none=True)
    names, params = zip(*pm.named_parameters())
    terms = torch.autograd.grad(step(), params)
    for t in terms:
        torch.distributed.all_reduce(t)
    _close(dict(zip(names, terms)), want, "autograd.grad terms summed")
    assert decisions[-1] is False, decisions

    # create_graph=True: the gradients are built as a graph, so backward divides
    pm.zero_grad(set_to_none=True)
    step().backward(create_graph=True)
    _close({k: v.detach() for k, v in _grads(pm).items()}, want, "create_graph")
    assert decisions[-1] is False, decisions

    # a gradient hook of the user's sees this rank's term of the loss's gradient (here it clamps it)
    pm.zero_grad(set_to_none=True)
    first = next(iter(pm.parameters()))
    (term,) = torch.autograd.grad(step(), first)  # this rank's term, unclamped
    bound = term.abs().max().item() / 2
    clamped = term.clamp(-bound, bound)
    torch.distributed.all_reduce(clamped)
    handle = first.register_hook(lambda g: g.clamp(-bound, bound))
    step().backward()
    handle.remove()
    torch.testing.assert_close(first.grad, clamped, rtol=1e-4, atol=1e-6)
    assert decisions[-1] is False, decisions

    # and one that runs after accumulation sees this rank's term as it is, divided
    pm.zero_grad(set_to_none=True)
    seen = []
    handle = first.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    step().backward()
    handle.remove()
    torch.testing.assert_close(seen[0], term, rtol=1e-4, atol=1e-6)
    assert decisions[-1] is False, decisions
    return decisions


@pytest.mark.timeout(120)
def test_the_count_division_moves_to_the_grad_sync_only_when_exact():
    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    sample["labels"][0, :5] = -100  # all on rank 0: the ranks' token counts differ
    traced = trace_model(model, sample)
    plan = greedy_plan(traced, cpu_mesh((2,)), {name: "S(0)" for name in traced.input_names})
    want = reference(model, sample, 1).grads[0]
    results = run_ranks(_cases, 2, model, sample, traced, plan, want, timeout_s=100)
    assert results[0] == results[1]


def _hf_cases(rank, world, model, sample, traced, plan, want, want_aux, w):
    pm, decisions = _module(model, traced, plan)
    args, kwargs = batch_slice(split_sample_input(sample), rank, world)
    out = pm(*args, **kwargs)
    assert out.logits.requires_grad
    out.loss.backward()  # the logits carry no gradient: the division is taken over all the same
    assert decisions == [True], decisions
    _close(_grads(pm), want, "loss with logits returned")
    pm.zero_grad(set_to_none=True)
    out = pm(*args, **kwargs)  # gradient through the logits as well: still exact
    torch.autograd.backward([out.loss, (out.logits * batch_slice(w, rank, world)).sum()])
    _close(_grads(pm), want_aux, "loss and logits")


@pytest.mark.timeout(180)
def test_a_model_returning_logits_stays_exact():
    """A Hugging Face causal LM returns its logits (requiring grad) next to the loss."""
    model, sample = load_zoo("hf_gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    sample["labels"][0, :5] = -100
    traced = trace_model(model, sample)
    plan = greedy_plan(traced, cpu_mesh((2,)), {name: "S(0)" for name in traced.input_names})
    want = reference(model, sample, 1).grads[0]
    ref = copy.deepcopy(model)
    out = ref(**sample)
    w = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(3))
    (out.loss + (out.logits * w).sum()).backward()
    want_aux = {n: p.grad.clone() for n, p in ref.named_parameters()}
    run_ranks(_hf_cases, 2, model, sample, traced, plan, want, want_aux, w, timeout_s=150)
