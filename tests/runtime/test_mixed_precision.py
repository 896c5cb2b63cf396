"""`autopar.MixedPrecision` at run time: bf16 compute copies of float32 masters, the kernels on the path, fp16.

The kernels' call sites are watched in a real `parallelize` training step: `kernels.bucket`'s torch and Triton
bodies are wrapped (every `pack` and `unpack` runs one of them), and each call records who called it. Under
TRITON_INTERPRET=1 the same step runs the Triton kernels on CPU tensors (Triton's interpreter) and must give
the torch fallback's gradients bit for bit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
import sys

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import autopar
import kernels.bucket
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.state_dict import gather_full
from autopar.solver.plan_io import fingerprint
from tests.codegen.harness import local_sample, parallel_module
from tests.codegen.mixed import BF16, trace_mixed
from tests.codegen.plans import cpu_mesh, greedy_plan, load_zoo, random_plan

_BODIES = ("_pack_torch", "_pack_triton", "_unpack_torch", "_unpack_triton")


def _gpt2():
    torch.manual_seed(0)
    return load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")


def _watch_kernels(calls: list, unpack_scales: list) -> None:
    """Record (body, calling function, source dtypes, bucket dtype) for every pack and unpack from now on, and the
    scale of every unpack."""
    for name in _BODIES:
        body = getattr(kernels.bucket, name)

        def watched(*args, _body=body, _name=name):
            frame = sys._getframe(1)
            while frame.f_globals["__name__"].startswith("kernels"):
                frame = frame.f_back
            caller = f"{frame.f_globals['__name__'].rsplit('.', 1)[-1]}.{frame.f_code.co_name}"
            tensors, bucket = (args[0], args[2]) if "pack" == _name.split("_")[1] else (args[1], args[0])
            calls.append((_name, caller, sorted({str(t.dtype) for t in tensors}), str(bucket.dtype)))
            if "unpack" in _name:
                unpack_scales.append(args[3])
            return _body(*args)

        setattr(kernels.bucket, name, watched)


def _spied_steps(rank, world, runs):
    """Per (plan, policy, interpret) of `runs`, one training step of GPT-2 tiny through `parallelize` with the kernels
    watched: the calls, this rank's gathered gradients and the unpacks' scales. One world for all: its start and
    imports are most of a run's time. `interpret` sets TRITON_INTERPRET for this run, or unsets it."""
    calls: list = []
    unpack_scales: list = []
    _watch_kernels(calls, unpack_scales)
    out = []
    for plan, policy, interpret in runs:
        if interpret:
            os.environ["TRITON_INTERPRET"] = "1"  # the Triton kernels on CPU tensors (`kernels._dispatch`)
        else:  # the torch fallback, also where the suite runs under the interpreter (benchmarks/compat.sh)
            os.environ.pop("TRITON_INTERPRET", None)
        calls.clear()
        unpack_scales.clear()
        model, sample = _gpt2()
        pm = autopar.parallelize(model, sample, (world,), plan=plan, mixed_precision=policy)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        pm(**pm.local_batch(sample)).backward()
        grads = {fqn: gather_full(p.grad, pm.info.param_storage[fqn], pm.mesh) for fqn, p in pm.named_parameters()}
        opt.step()
        out.append((list(calls), grads, list(unpack_scales)))
    return out


def _plans():
    """A data-parallel and a random plan (with ZeRO storage) of GPT-2 tiny traced under bf16, on 2 ranks, each with the
    fingerprint `parallelize(plan=...)` checks."""
    model, sample = _gpt2()
    traced = trace_mixed(model, sample)
    mesh = cpu_mesh((2,))
    data_parallel = greedy_plan(traced, mesh, {n: "S(0)" for n in traced.input_names})
    zero = random_plan(traced, mesh, random.Random(2))
    assert not any(p.zero for p in data_parallel.params) and any(p.zero for p in zero.params)
    return tuple(dataclasses.replace(p, fingerprint=fingerprint(traced, mesh, None)) for p in (data_parallel, zero))


@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_bf16_training_step_packs_and_unpacks_through_the_kernels(spmd):
    """Under bf16 on 2 ranks: the copies of the masters are made by one `pack` (float32 -> bf16); the gradient sync
    packs the copies' bf16 gradients into float32 buckets and unpacks the sums into the float32 `.grad` of the
    masters; a ZeRO parameter's shard is packed to bf16 for its all-gather. With a bf16 reduce dtype the buckets
    are bf16 and their unpack casts. Under TRITON_INTERPRET=1 the same calls run the Triton kernels, with the
    fallback's gradients bit for bit."""
    data_parallel, zero = _plans()
    bf16_sums = autopar.MixedPrecision(torch.bfloat16, torch.bfloat16)
    # the last two under Triton's interpreter: triton is a test dependency (the `kernels` extra the suite installs)
    runs = [(data_parallel, BF16, False), (data_parallel, bf16_sums, False), (zero, BF16, False),
            (data_parallel, BF16, True), (zero, BF16, True)]
    results = spmd(_spied_steps, 2, runs, timeout_s=200)[0]

    calls, grads, unpack_scales = results[0]
    sites = {(name, caller, tuple(src), dst) for name, caller, src, dst in calls}
    # the mean loss's division by its global count (the batch's 4 x 8 labels) is the unpack's scale, a tensor it reads
    assert unpack_scales and all(isinstance(s, torch.Tensor) and s.item() == pytest.approx(1 / 32) for s in unpack_scales)
    assert sites == {("_pack_torch", "compute_copies.refresh", ("torch.float32",), "torch.bfloat16"),
                     ("_pack_torch", "grad_sync._launch", ("torch.bfloat16",), "torch.float32"),
                     ("_unpack_torch", "master_grads.unpack_into", ("torch.float32",), "torch.float32")}, sites
    assert sum(c[1] == "compute_copies.refresh" for c in calls) == 1  # once for the step, all parameters in one pack

    calls = results[1][0]
    assert ("_pack_torch", "grad_sync._launch", ["torch.bfloat16"], "torch.bfloat16") in calls
    assert ("_unpack_torch", "master_grads.unpack_into", ["torch.float32"], "torch.bfloat16") in calls

    calls, zero_grads, _ = results[2]
    assert ("_pack_torch", "collectives._gather", ["torch.float32"], "torch.bfloat16") in calls

    for (calls, got, _), want in zip(results[3:], (grads, zero_grads)):
        assert {c[0] for c in calls} == {"_pack_triton", "_unpack_triton"}
        for fqn, g in want.items():
            torch.testing.assert_close(got[fqn], g, rtol=0, atol=0, msg=lambda m: f"{fqn}: {m}")


@functools.lru_cache(maxsize=1)
def _traced_gpt2():
    """GPT-2 tiny traced under bf16, once a process (every `_module` of a rank lowers the same graph)."""
    return trace_mixed(*_gpt2())


def _module(plan, world):
    model, sample = _gpt2()
    pm = parallel_module(model, sample, _traced_gpt2(), plan, ProcessMesh((world,)), mixed_precision=BF16)
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), local_sample(sample, pm)


def _copies_per_step(rank, world, plan):
    """Two steps of two micro-batches each (the first under no_sync): whether each forward made the copies, and
    whether after each step the copies the next forward reads are the stepped masters in bf16."""
    pm, opt, (args, kwargs) = _module(plan, world)
    refreshes, same = [], []
    refresh = pm._copies.refresh
    pm._copies.refresh = lambda: refreshes.append(refresh()) or refreshes[-1]
    for _ in range(2):
        with pm.no_sync():
            pm(*args, **kwargs).backward()
        pm(*args, **kwargs).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            pm(*args, **kwargs)
        same.append(all(torch.equal(pm._copies.by_name[fqn], p.detach().to(torch.bfloat16))
                        for fqn, p in pm.named_parameters() if fqn in pm._copies.by_name))
    return refreshes, same


def _accumulated_grads(rank, world, plan):
    """The masters' gradients of one micro-batch (doubled), and of two (the same batch) accumulated over a `no_sync()`
    backward and a synced one, and over two synced ones, each on a module of its own."""
    out = []
    for kind in ("one", "no_sync", "synced twice"):
        pm, _, (args, kwargs) = _module(plan, world)
        with pm.no_sync() if kind == "no_sync" else contextlib.nullcontext():
            pm(*args, **kwargs).backward()
        if kind != "one":
            pm(*args, **kwargs).backward()
        out.append({fqn: p.grad * (2 if kind == "one" else 1) for fqn, p in pm.named_parameters()})
    return out


@pytest.mark.timeout(120)
def test_copies_are_made_once_per_step_and_micro_batches_sum_in_float32(spmd):
    """The copies are made once per optimizer step (the second micro-batch of a step finds the
    masters unchanged, the first forward after the step does not) and equal the stepped masters in bf16. Gradients of
    two micro-batches (the same batch twice) are twice one's to float32 rounding, whether the first was a `no_sync()`
    backward (its bf16 gradients moved into the float32 masters when it ended, reduced with the second's) or synced
    (the second's sum added onto the first's by the unpack)."""
    data_parallel, _ = _plans()
    for refreshes, same in spmd(_copies_per_step, 2, data_parallel, timeout_s=100):
        assert refreshes == [True, False, True, False, False, True] and same == [True, True]
    for one, *accumulated in spmd(_accumulated_grads, 2, data_parallel, timeout_s=100):
        for grads in accumulated:
            for fqn, g in one.items():
                torch.testing.assert_close(grads[fqn], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{fqn}: {m}")


def _frozen_after_a_step(rank, world, plan):
    """A step with every parameter trained, then one with a weight frozen since: which masters got a gradient."""
    pm, opt, (args, kwargs) = _module(plan, world)
    pm(*args, **kwargs).backward()
    opt.step()
    opt.zero_grad()
    pm.get_parameter("transformer.h.0.attn.c_attn.weight").requires_grad_(False)
    pm(*args, **kwargs).backward()
    return {fqn for fqn, p in pm.named_parameters() if p.grad is not None}


@pytest.mark.timeout(120)
def test_a_master_frozen_after_parallelize_gets_no_gradient(spmd):
    """Freezing a master freezes its copy: the next backward gives it no gradient, the others theirs."""
    data_parallel, _ = _plans()
    model, _ = _gpt2()
    for trained in spmd(_frozen_after_a_step, 2, data_parallel, timeout_s=100):
        assert trained == {n for n, _ in model.named_parameters()} - {"transformer.h.0.attn.c_attn.weight"}


def _fp16_steps(rank, world, plan, overflow):
    """fp16 compute with torch's ShardedGradScaler: an overflow put in rank 0's block of a split gradient, or none.
    The scale after the step, whether the masters moved, and the loss."""
    model, sample = _gpt2()
    policy = autopar.MixedPrecision(torch.float16)
    traced = trace_mixed(model, sample, policy)
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)), mixed_precision=policy)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0, process_group=torch.distributed.group.WORLD)
    before = [p.detach().clone() for p in pm.parameters()]
    args, kwargs = local_sample(sample, pm)
    loss = pm(*args, **kwargs)
    scaler.scale(loss).backward()
    if overflow and rank == 0:
        split = next(fqn for fqn, spec in pm.info.param_storage.items() if not spec.is_replicate())
        pm.get_parameter(split).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale(), any(not torch.equal(a, p) for a, p in zip(before, pm.parameters())), loss.item()


@pytest.mark.timeout(120)
def test_fp16_compute_with_a_sharded_grad_scaler(spmd):
    """`MixedPrecision(torch.float16)` with ShardedGradScaler (fp16's range needs the loss scaled): a step moves the
    float32 masters; an overflow in one rank's block of a split gradient skips the step on every rank and halves
    the scale (the scaler unscales and checks the float32 gradients the sync wrote)."""
    _, zero = _plans()
    model, sample = _gpt2()
    with torch.no_grad():
        want = model(**sample).item()
    for scale, moved, loss in spmd(_fp16_steps, 2, zero, False, timeout_s=100):
        assert scale == 1024.0 and moved and loss == pytest.approx(want, rel=1e-2)
    for scale, moved, _ in spmd(_fp16_steps, 2, zero, True, timeout_s=100):
        assert scale == 512.0 and not moved


def test_the_policy_names_its_bad_dtypes():
    with pytest.raises(ValueError, match="torch.bfloat16 or torch.float16"):
        autopar.MixedPrecision(torch.float32)
    with pytest.raises(ValueError, match="reduce_dtype=torch.int8"):
        autopar.MixedPrecision(torch.bfloat16, torch.int8)
