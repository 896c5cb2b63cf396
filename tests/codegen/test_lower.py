"""The generated code reads like Megatron: one all-reduce per MLP block, none for pure DP, local shapes."""
from __future__ import annotations

import copy
import random
import re

import pytest
import torch

from tests.codegen.harness import reference, run_plans, trace_model
from tests.codegen.plans import build_plan, cpu_mesh, greedy_plan, load_zoo, random_plan

from autopar.codegen import lower
from autopar.codegen.shapes import LoweringError, local_block
from autopar.runtime import collectives as C
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.strategies import enumerate_strategies

MEGATRON = {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)", "fc2.bias": "R"}


def _mlp():
    model, sample = load_zoo("mlp").build(batch_size=8, size="tiny", device="cpu")
    return model, sample, trace_model(model, sample)


def _megatron_plan(traced):
    pins = {ph: MEGATRON[fqn.split(".", 2)[2]] for ph, fqn in traced.param_fqns.items()}
    return greedy_plan(traced, cpu_mesh((2,)), pins)


def _dp_plan(traced):
    pins = {name: "S(0)" for name in traced.input_names}
    return greedy_plan(traced, cpu_mesh((2,)), pins)


def _forward_collectives(rank, world, traced, plan, input_layout="shard"):
    gm = lower(traced, plan, ProcessMesh((2,)), input_layout=input_layout)
    names = {f: name for name, f in C.COLLECTIVES.items()}
    return [names[n.target] for n in gm.graph.nodes if n.op == "call_function" and n.target in names], gm.code


@pytest.mark.timeout(120)
def test_megatron_mlp_has_one_all_reduce_per_block_and_trains_exactly():
    model, sample, traced = _mlp()
    plan = _megatron_plan(traced)
    (kinds, code), _ = run_ranks(_forward_collectives, 2, traced, plan, "replicate", timeout_s=60)
    n_layers = model.config.n_layers
    assert kinds.count("all_reduce") == n_layers, code  # Megatron's "g": after each row-parallel fc2
    assert kinds.count("grad_all_reduce") == n_layers, code  # Megatron's "f": before each column-parallel fc1
    assert "all_gather" not in kinds, code
    # fed as batch slices (the default), the replicated inputs x and y are first all-gathered, nothing else changes
    (sharded, code), _ = run_ranks(_forward_collectives, 2, traced, plan, timeout_s=60)
    assert sorted(sharded) == sorted(kinds + ["all_gather", "all_gather"]), code
    # local shapes: fc1.weight (64, 32) is split by rows, so this rank holds (32, 32)
    results = run_ranks(run_plans, 2, (2,), [("megatron", model, sample, traced, plan, reference(model, sample, 3), 3)], timeout_s=60)
    assert all(r[0][1]["loss"] < 1e-5 for r in results)


@pytest.mark.timeout(120)
def test_pure_dp_plan_communicates_only_the_loss_in_forward():
    model, sample, traced = _mlp()
    plan = _dp_plan(traced)
    (kinds, code), _ = run_ranks(_forward_collectives, 2, traced, plan, timeout_s=60)
    # forward: one collective, the loss's sum over the ranks (started, waited only when the loss is read);
    # parameter gradients are synced by the bucketed grad sync outside the graph, so no grad_all_reduce
    assert kinds == ["deferred_all_reduce"], code
    assert "grad_all_reduce" not in code


@pytest.mark.timeout(120)
def test_generated_code_shows_local_shapes():
    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    plan = _dp_plan(traced)
    _, code = run_ranks(_forward_collectives, 2, traced, plan, timeout_s=60)[0]
    # global (B*T, C) = (32, 64); each of 2 data-parallel ranks holds 16 rows
    assert "[16, 64]" in code and "[32, 64]" not in code, code
    assert torch.Size([4, 8]) == sample["input_ids"].shape


@pytest.mark.timeout(120)
def test_a_dropout_that_does_nothing_copies_nothing():
    """GPT-2's Dropout(p=0) modules trace as `clone` (eager returns the input): the generated code runs them
    as `contiguous`, no copy and no backward node, as the profiler priced them; gradients stay exact
    (`test_equivalence` trains gpt2 plans against one device)."""
    from autopar.tracer.nodes import is_dropout_clone

    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    dropouts = [n.name for n in traced.graph.nodes if is_dropout_clone(n)]
    assert len(dropouts) == 1 + 2 * model.config.n_layer  # embeddings, and attention and MLP of each block
    _, code = run_ranks(_forward_collectives, 2, traced, _dp_plan(traced), timeout_s=60)[0]
    assert "clone(" not in code, code
    assert all(re.search(rf"\b{name} = \w+\.contiguous\(\)", code) for name in dropouts), code


def _sync_axes(rank, world, traced, plan):
    gm = lower(traced, plan, ProcessMesh((2,)))
    return [n.name for n in gm.graph.nodes if n.target is C.grad_all_reduce], dict(gm.meta["autopar"].grad_sync_axes)


@pytest.mark.timeout(120)
def test_gpt2_pure_dp_syncs_every_grad_outside_the_graph():
    # the position embedding is embedding(wpe, arange): the integer arange carries no gradient, so the
    # wpe grad's all-reduce moves to the parameter like every other one (no synchronous in-graph collective)
    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    (in_graph, sync_axes), _ = run_ranks(_sync_axes, 2, traced, _dp_plan(traced), timeout_s=60)
    assert in_graph == []
    owners = {fqn for fqn, p in model.named_parameters()}  # named_parameters drops the tied lm_head twin
    assert set(sync_axes) == owners and all(a == (0,) for a in sync_axes.values()), sync_axes


def _order(rank, world, traced, plan):
    gm = lower(traced, plan, ProcessMesh((2,)))
    return [(n.op, n.target if n.op != "call_function" else getattr(n.target, "__name__", str(n.target))) for n in gm.graph.nodes]


@pytest.mark.timeout(120)
def test_token_count_is_all_reduced_from_the_start_of_the_forward():
    """The global mean needs the kept-token count over all ranks: its all-reduce starts before any
    model compute, the loss sum's at the end of the forward, and no collective is waited in the forward."""
    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    sample["labels"][0, :5] = -100  # ignored labels, all on rank 0: the count differs between ranks
    traced = trace_model(model, sample)
    plan = greedy_plan(traced, cpu_mesh((2,)), {name: "S(0)" for name in traced.input_names})
    order = [name for _, name in run_ranks(_order, 2, traced, plan, timeout_s=60)[0]]
    names = set(C.COLLECTIVES)
    assert [name for name in order if name in names or name == "wait"] == ["start_count", "deferred_mean"], order
    assert order.index("start_count") < order.index("embedding"), order
    assert order[-2:] == ["deferred_mean", "output"], order
    results = run_ranks(run_plans, 2, (2,), [("dp", model, sample, traced, plan, reference(model, sample, 2), 2)], timeout_s=60)
    assert all(r[0][1]["loss"] < 1e-5 and r[0][1]["grad"] < 1e-4 for r in results), results


@pytest.mark.timeout(120)
def test_gathered_labels_start_before_the_forward_and_are_waited_where_used():
    """Labels a plan needs whole depend only on the input: their all-gather overlaps the forward."""
    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    pins = {name: "S(0)" for name in traced.input_names if name != "labels"}  # labels replicated: gathered
    plan = greedy_plan(traced, cpu_mesh((2,)), pins)
    order = [name for _, name in run_ranks(_order, 2, traced, plan, timeout_s=60)[0]]
    start, wait = order.index("all_gather_start"), order.index("wait_all_gather")
    assert start < order.index("embedding"), order  # before any model compute
    assert wait > max(i for i, name in enumerate(order) if name == "mm"), order  # after the LM head
    results = run_ranks(run_plans, 2, (2,), [("gathered", model, sample, traced, plan, reference(model, sample, 2), 2)], timeout_s=60)
    assert all(r[0][1]["loss"] < 1e-5 for r in results)


def _math_attention(rank, world, model, sample, traced, plan, want_grads):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autopar.codegen import ParallelModule
    from autopar.runtime.batch import batch_slice
    from autopar.tracer import split_sample_input

    mesh = ProcessMesh((2,))
    pm = ParallelModule(lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False))), traced, mesh, plan)
    args, kwargs = batch_slice(split_sample_input(sample), rank, world)
    with sdpa_kernel([SDPBackend.MATH]):  # attention output laid out (B, H, T, D), not as traced
        pm(*args, **kwargs).backward()
    for fqn, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[fqn], rtol=1e-4, atol=1e-5, msg=lambda m: f"grad of {fqn}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("traced_on", ["cpu", "meta"])
def test_the_generated_module_runs_whatever_attention_backend_lays_out_its_output(traced_on):
    """Traced on CPU tensors, export sees SDPA's flash kernel, whose output is contiguous once permuted
    back, and drops the model's `.contiguous()` before merging the heads; the math backend (and GPU
    backends that fall back to it) lay the output out otherwise, where a `view` cannot merge them.
    Traced on meta, the `.contiguous()` stays (as a clone) and must still run as one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autopar.tracer import trace

    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    traced = trace(copy.deepcopy(model), sample) if traced_on == "cpu" else trace_model(model, sample)
    with sdpa_kernel([SDPBackend.MATH]):
        want = reference(model, sample, 1).grads[0]
    run_ranks(_math_attention, 2, model, sample, traced, _dp_plan(traced), want, timeout_s=100)


def _lower_without(rank, world, traced, plan, model, missing):
    params = {k: v for k, v in model.named_parameters(remove_duplicate=False) if k != missing}
    with pytest.raises(LoweringError, match=re.escape(repr(missing))):
        lower(traced, plan, ProcessMesh((2,)), params=params, buffers=dict(model.named_buffers()))


@pytest.mark.timeout(120)
def test_a_tensor_missing_from_those_passed_is_an_error_not_zeros():
    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    run_ranks(_lower_without, 2, traced, _dp_plan(traced), model, "transformer.h.0.mlp.c_fc.weight", timeout_s=60)


def _loss_after_reassigning(rank, world, model, sample, traced, plan):
    from autopar.codegen import ParallelModule
    from autopar.runtime.batch import batch_slice
    from autopar.tracer import split_sample_input

    mesh = ProcessMesh((2,))
    pm = ParallelModule(lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False))), traced, mesh, plan)
    for fqn, p in list(pm.named_parameters()):  # new Parameter objects on their modules
        owner, _, name = fqn.rpartition(".")
        setattr(pm.get_submodule(owner), name, torch.nn.Parameter(p.detach() * 0.5))
    args, kwargs = batch_slice(split_sample_input(sample), rank, world)
    loss = pm(*args, **kwargs)
    loss.backward()
    grads = {fqn: p.grad for fqn, p in pm.named_parameters()}
    specs = pm.info.param_storage
    return loss.item(), grads, {fqn: (specs[fqn], mesh.shape, mesh.coordinate) for fqn in grads}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan_of", [_megatron_plan, _dp_plan], ids=["megatron", "data-parallel"])
def test_the_graph_reads_parameters_assigned_after_it_was_built(plan_of):
    """Parameters are the graph's arguments, fetched from their modules at each call: not a copy taken at
    build. The new ones' grads are those of one device, synced where the plan syncs them."""
    model, sample, traced = _mlp()
    halved = copy.deepcopy(model)
    with torch.no_grad():
        for p in halved.parameters():
            p.mul_(0.5)
    ref = reference(halved, sample, 1)
    for loss, grads, blocks in run_ranks(_loss_after_reassigning, 2, model, sample, traced, plan_of(traced), timeout_s=60):
        assert loss == pytest.approx(ref.losses[0], rel=1e-5)
        for fqn, grad in grads.items():
            torch.testing.assert_close(grad, local_block(ref.grads[0][fqn], *blocks[fqn]), rtol=1e-4, atol=1e-6, msg=lambda m: f"{fqn}: {m}")


def _graph_targets(rank, world, traced, plans):
    return [[str(n.target) for n in lower(traced, plan, ProcessMesh((1,))).graph.nodes] for plan in plans]


@pytest.mark.timeout(120)
def test_a_one_device_plan_lowers_to_the_replicated_code_whatever_its_specs():
    """On a mesh axis of one device a Shard is the whole tensor and a Partial sums one term. The solver prices
    them as Replicate and may pick them (GPT-2's cross-entropy vocabulary-parallel on one device ran 27%
    slower): they lower as Replicate, with no collective or sharded kernel, and train exactly."""
    model, sample = load_zoo("gpt2").build(batch_size=2, seq_len=8, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    mesh = cpu_mesh((1,))
    strategies = enumerate_strategies(traced, mesh)
    replicated = build_plan(traced, mesh, {name: next(s for s in options if all(
        x is None or x.is_replicate() for x in s.input_specs + s.output_specs)) for name, options in strategies.items()})
    rng = random.Random(0)
    plans = [random_plan(traced, mesh, rng, strategies, recompute_spans=0, zero_p=1.0) for _ in range(3)]
    for plan in plans:  # each splits something, and stores some parameter as ZeRO would
        assert any(not s.is_replicate() for d in plan.nodes for s in d.strategy.output_specs)
        assert any(p.zero for p in plan.params)
    replicated_targets, *others = run_ranks(_graph_targets, 1, traced, [replicated, *plans], timeout_s=60)[0]
    assert any("_log_softmax" in t for t in replicated_targets)  # cross-entropy's own, not vocabulary-parallel
    for targets in others:
        assert targets == replicated_targets
    ref = reference(model, sample, 2)
    run_ranks(run_plans, 1, (1,), [(f"random plan {i} on one device", model, sample, traced, plan, ref, 2)
                                   for i, plan in enumerate(plans)], timeout_s=60)
