"""GradSync: bucketed, overlapped all-reduce gives the single-process gradients of the global loss."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from autopar.runtime.deferred_loss import deferred_mean, grads_scaled_by, other_output, start_count
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.mesh import ProcessMesh

GLOBAL_BATCH = 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Sum over this rank's samples divided by the GLOBAL batch: the ranks' losses add up to the global mean.
    return (model(x) - y).square().sum() / GLOBAL_BATCH


def _watched(sync: GradSync, loss: torch.Tensor) -> torch.Tensor:
    sync.watch(loss)  # as the parallel module does with what it returns: where backward enters
    return loss


def _sync_matches_reference(rank: int, world_size: int, mesh_shape: tuple[int, ...], bucket_bytes: int, flat: bool = False,
                            copies: bool = False) -> tuple[int, int, list[int]]:
    """copies: the sync's tensors are copies of `model`'s parameters, in which forward and backward run, their
    grads landing in `model`'s (mixed precision's masters; float32 copies here, so the sums are exact)."""
    mesh = ProcessMesh(mesh_shape)
    masters, ref = _model(), _model()
    model = copy.deepcopy(masters) if copies else masters  # what forward runs in
    named = list(masters.named_parameters())
    # Summed over every axis: one group per axis in turn, or one flattened group over all of them.
    groups = (mesh.flat_group_name(range(len(mesh_shape))),) if flat else mesh.group_names
    sync = GradSync([(n, p, groups) for n, p in model.named_parameters()], bucket_bytes=bucket_bytes,
                    masters=dict(named) if copies else None)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(GLOBAL_BATCH, 8, generator=gen) for _ in range(3)]
    ys = [torch.randn(GLOBAL_BATCH, 4, generator=gen) for _ in range(3)]
    shard = lambda t: t.chunk(world_size)[rank]  # noqa: E731 -- all mesh axes are data-parallel here

    # Step 1: one synced backward. The input's grad is the last thing backward computes: record
    # how many buckets were already in flight by then.
    launched_before_end: list[int] = []
    x = shard(xs[0]).requires_grad_(True)
    x.register_hook(lambda g: launched_before_end.append(sync.launched))
    _watched(sync, _loss(model, x, shard(ys[0]))).backward()
    _loss(ref, xs[0], ys[0]).backward()
    for (n, p), q in zip(named, ref.parameters()):
        assert_close(p.grad, q.grad, msg=lambda m: f"step 1 grad of {n}: {m}")

    # Step 2: gradient accumulation, one local micro-step then a synced one.
    masters.zero_grad()
    ref.zero_grad()
    with sync.no_sync():
        _watched(sync, _loss(model, shard(xs[1]), shard(ys[1]))).backward()
    _watched(sync, _loss(model, shard(xs[2]), shard(ys[2]))).backward()
    (_loss(ref, xs[1], ys[1]) + _loss(ref, xs[2], ys[2])).backward()
    for (n, p), q in zip(named, ref.parameters()):
        assert_close(p.grad, q.grad, msg=lambda m: f"step 2 grad of {n}: {m}")

    # Step 3: accumulation over two SYNCED backwards: each must reduce only its own term (a sum,
    # unlike DDP's mean, would otherwise count the first micro-step once per rank).
    masters.zero_grad()
    ref.zero_grad()
    _watched(sync, _loss(model, shard(xs[1]), shard(ys[1]))).backward()
    _watched(sync, _loss(model, shard(xs[2]), shard(ys[2]))).backward()
    (_loss(ref, xs[1], ys[1]) + _loss(ref, xs[2], ys[2])).backward()
    for (n, p), q in zip(named, ref.parameters()):
        assert_close(p.grad, q.grad, msg=lambda m: f"step 3 grad of {n}: {m}")
    return sync.num_buckets, sync.launched, launched_before_end


@pytest.mark.parametrize("mesh_shape, flat", [((2,), False), ((4,), False), ((2, 2), False), ((2, 2), True)])
def test_bucket_per_param_overlaps_backward(spmd, mesh_shape, flat):
    world = math.prod(mesh_shape)
    results = spmd(_sync_matches_reference, world, mesh_shape, 1, flat)  # 1 byte: every parameter its own bucket
    for num_buckets, launched, before_end in results:
        assert num_buckets == 6 and launched == 6
        # Both weights and biases of the last two layers were launched before the input's grad existed.
        assert before_end[0] >= 4


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_copies_grads_land_in_their_masters(spmd, mesh_shape):
    """Mixed precision's layout: forward and backward on copies of the parameters, the sync writing into the
    masters. The same steps (a synced backward; a `no_sync()` one then a synced one; two synced ones) give the
    masters one process's gradients, and the buckets still launch during backward."""
    results = spmd(_sync_matches_reference, math.prod(mesh_shape), mesh_shape, 1, False, True)
    for num_buckets, launched, before_end in results:
        assert num_buckets == 6 and launched == 6 and before_end[0] >= 4


def test_default_buckets(spmd):
    results = spmd(_sync_matches_reference, 2, (2,), 25 * 2**20)
    assert [r[:2] for r in results] == [(1, 1)] * 2  # 484 floats fit one 25 MB bucket
    assert results[0][2] == [0]  # one bucket: it can only launch once the first layer's grads exist


def _bucket_layout(rank: int, world_size: int) -> list[list[str]]:
    mesh = ProcessMesh((world_size,))
    model = _model()
    # Reverse order, fp32 bytes: 4.bias 16 + 4.weight 256 + 2.bias 64 = 336; + 2.weight 1024 > 1200 starts
    # bucket 2: 1024 + 0.bias 64 = 1088; + 0.weight 512 > 1200 starts bucket 3.
    sync = GradSync([(n, p, mesh.group_names) for n, p in model.named_parameters()], bucket_bytes=1200)
    return sync.bucket_names()


def test_buckets_fill_in_reverse_order(spmd):
    names = spmd(_bucket_layout, 2)[0]
    assert names == [["4.bias", "4.weight", "2.bias"], ["2.weight", "0.bias"], ["0.weight"]]


def _bucket_storage(rank: int, world_size: int, reduce_dtype: torch.dtype | None) -> tuple[int, float]:
    """Distinct grad storages after a synced backward (one bucket), and the largest error against one process."""
    mesh = ProcessMesh((world_size,))
    model, ref = _model(), _model()
    sync = GradSync([(n, p, mesh.group_names) for n, p in model.named_parameters()], reduce_dtype=reduce_dtype)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)
    _watched(sync, _loss(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank])).backward()
    _loss(ref, x, y).backward()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    error = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return len(storages), error


def test_summed_bucket_becomes_the_grads(spmd):
    # The grads' own dtype on the wire: every grad is a view of the one summed bucket (no copy back).
    storages, error = spmd(_bucket_storage, 2, None)[0]
    assert storages == 1 and error < 1e-6
    # A bf16 wire: the bucket is unpacked into each fp32 grad, within bf16 rounding of the reference.
    storages, error = spmd(_bucket_storage, 2, torch.bfloat16)[0]
    assert storages == 6 and 0 < error < 1e-2


def _gradient_through_another_output(rank: int, world_size: int, loss_first: bool) -> tuple[list[bool], float]:
    """A mean loss plus gradient entering through another output, in one backward. `loss_first`: the
    mean's backward runs before the other output's (it was created later): the division is taken
    over and what enters elsewhere is scaled back; else the other output runs first and keeps it.
    Returns the decisions and the largest error of the synced grads against one process."""
    mesh = ProcessMesh((world_size,))
    model, ref = _model(), _model()
    sync = GradSync([(n, p, mesh.group_names) for n, p in model.named_parameters()], scaled=model.parameters())
    decisions = []
    take = sync.defer_scale
    sync.defer_scale = lambda count: decisions.append(take(count)) or decisions[-1]
    gen = torch.Generator().manual_seed(1)
    x, y, w = (torch.randn(GLOBAL_BATCH, n, generator=gen) for n in (8, 4, 4))
    kept = torch.arange(GLOBAL_BATCH) % 3 != 0  # a mean over the kept rows only: counts differ per rank
    shard = lambda t: t.chunk(world_size)[rank]  # noqa: E731

    def terms(out, y, w, kept):
        return ((out - y).square().sum(1) * kept).sum(), kept.sum(), (out * w).sum()

    group = mesh.group_names[0]
    with grads_scaled_by(sync):
        count = start_count(shard(kept).sum(), group)
        out = model(shard(x))
        other = other_output(out, sync) if loss_first else None
        total, _, _ = terms(out, shard(y), shard(w), shard(kept))
        loss = deferred_mean(total, count, group)
        if not loss_first:
            other = other_output(out, sync)
    torch.autograd.backward([_watched(sync, loss), (_watched(sync, other) * shard(w)).sum()])
    total, count, aux = terms(ref(x), y, w, kept)
    (total / count + aux).backward()
    error = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return decisions, error


@pytest.mark.parametrize("loss_first", [True, False])
def test_gradient_entering_through_another_output_stays_exact(spmd, loss_first):
    decisions, error = spmd(_gradient_through_another_output, 2, loss_first)[0]
    assert decisions == [loss_first]  # which of the two paths ran
    assert error < 1e-5, error


def _synced_pair(world_size: int, batches: int) -> tuple[nn.Module, nn.Module, GradSync, list, list]:
    """A model synced over all ranks, its one-process reference, and `batches` global inputs and targets."""
    mesh = ProcessMesh((world_size,))
    model, ref = _model(), _model()
    sync = GradSync([(n, p, mesh.group_names) for n, p in model.named_parameters()])
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(GLOBAL_BATCH, 8, generator=gen) for _ in range(batches)]
    ys = [torch.randn(GLOBAL_BATCH, 4, generator=gen) for _ in range(batches)]
    return model, ref, sync, xs, ys


def _partial_backwards(rank: int, world_size: int) -> None:
    """Synced sums survive backwards that do not reach their parameters: a backward limited to some
    parameters (`inputs=`) keeps the others' sums as they were, `torch.autograd.grad` changes none, and
    a `no_sync()` backward may accumulate onto them."""
    model, ref, sync, xs, ys = _synced_pair(world_size, 3)
    named = list(model.named_parameters())
    shard = lambda t: t.chunk(world_size)[rank]  # noqa: E731
    last = [model[4].weight, model[4].bias]
    _watched(sync, _loss(model, shard(xs[0]), shard(ys[0]))).backward()
    _watched(sync, _loss(model, shard(xs[1]), shard(ys[1]))).backward(inputs=last)
    before = [p.grad.clone() for _, p in named]
    torch.autograd.grad(_watched(sync, _loss(model, shard(xs[2]), shard(ys[2]))), last[0])
    _loss(ref, xs[0], ys[0]).backward()
    _loss(ref, xs[1], ys[1]).backward(inputs=[ref[4].weight, ref[4].bias])
    for (n, p), q, b in zip(named, ref.parameters(), before):
        assert_close(b, q.grad, msg=lambda m: f"grad of {n} after a backward limited to the last layer: {m}")
        assert_close(p.grad, b, rtol=0, atol=0, msg=lambda m: f"grad of {n} after autograd.grad: {m}")
    # a no_sync() backward onto the synced sums, then a synced one: the sums are counted once
    with sync.no_sync():
        _watched(sync, _loss(model, shard(xs[2]), shard(ys[2]))).backward()
    _watched(sync, _loss(model, shard(xs[0]), shard(ys[0]))).backward()
    (_loss(ref, xs[2], ys[2]) + _loss(ref, xs[0], ys[0])).backward()
    for (n, p), q in zip(named, ref.parameters()):
        assert_close(p.grad, q.grad, msg=lambda m: f"grad of {n} after no_sync() onto synced sums: {m}")


def test_synced_sums_survive_backwards_that_skip_them(spmd):
    spmd(_partial_backwards, 2)


def _accumulate_after_in_place_changes(rank: int, world_size: int) -> None:
    """Accumulating onto synced grads that were changed in place (one scaled, one zeroed) gives the single
    process's grads: each sum, changed or not, enters the next reduction once (the grads of a bucket are
    views of one buffer sharing its version counter: a change to one must not make the others look unsynced)."""
    model, ref, sync, xs, ys = _synced_pair(world_size, 2)
    named = list(model.named_parameters())
    shard = lambda t: t.chunk(world_size)[rank]  # noqa: E731
    for step, (x, y) in enumerate(zip(xs, ys)):
        _watched(sync, _loss(model, shard(x), shard(y))).backward()
        _loss(ref, x, y).backward()
        if step == 0:
            for m in (model, ref):
                m[0].weight.grad.mul_(0.5)
                m[2].bias.grad.zero_()
    for (n, p), q in zip(named, ref.parameters()):
        assert_close(p.grad, q.grad, msg=lambda m: f"grad of {n}: {m}")


def test_accumulating_onto_grads_changed_in_place(spmd):
    spmd(_accumulate_after_in_place_changes, 2)
