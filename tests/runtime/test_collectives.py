"""Every collective's forward value and backward gradient against a single-process reference.

Each rank builds the same global tensors from one seed. For each collective the
reference is the global function's gradient, read through the contract in
`autopar.runtime.collectives`: a Shard's grad is this rank's chunk, a Replicate's
grad is complete, a Partial term's grad is the grad of the sum. Where the consumer
is sharded over the axis, each rank's loss is one term `(y * W[r]).sum()` of the
global loss `sum_r`, so the reference gradient is built from `W.sum(0)`.
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from autopar.runtime.collectives import (
    COLLECTIVES,
    all_gather,
    all_gather_rs,
    all_reduce,
    all_gather_start,
    all_reduce_start,
    deferred_all_reduce,
    deferred_mean,
    start_count,
    all_to_all,
    grad_all_reduce,
    local_slice,
    reduce_scatter,
    replicate_to_partial,
    wait,
    wait_all_gather,
)
from autopar.runtime.deferred_loss import DeferredSum
from autopar.runtime.mesh import ProcessMesh

SHAPE = (4, 8, 12)  # every dim divides by 4


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def _check(what: str, y, y_ref, x, grad_ref) -> None:
    assert_close(y, y_ref, rtol=0, atol=1e-12, msg=lambda m: f"{what} forward: {m}")
    assert_close(x.grad, grad_ref, rtol=0, atol=1e-12, msg=lambda m: f"{what} backward: {m}")


def _all_collectives(rank: int, world_size: int, mesh_shape: tuple[int, ...], axis: int) -> list[str]:
    mesh = ProcessMesh(mesh_shape)
    g, n, r = mesh.group_name(axis), mesh.axis_size(axis), mesh.axis_rank(axis)
    gen = torch.Generator().manual_seed(0)  # same global tensors on every rank
    X = torch.randn(SHAPE, dtype=torch.float64, generator=gen)
    T = torch.randn((n, *SHAPE), dtype=torch.float64, generator=gen)  # partial terms: T[r] on axis rank r
    W = torch.randn((n, *SHAPE), dtype=torch.float64, generator=gen)  # per-rank loss weights
    chunk = lambda t, d: t.chunk(n, d)[r]  # noqa: E731
    checked = []
    for d in (0, 1, 2, -1):
        # S(d) -> R, consumer replicated: one complete loss on every rank.
        x = _leaf(chunk(X, d))
        y = all_gather(x, d, g)
        (y * W[0]).sum().backward()
        _check(f"all_gather(dim={d})", y, X, x, chunk(W[0], d))

        # S(d) -> R, consumer sharded: rank r computes term r of the loss.
        x = _leaf(chunk(X, d))
        y = all_gather_rs(x, d, g)
        (y * W[r]).sum().backward()
        _check(f"all_gather_rs(dim={d})", y, X, x, chunk(W.sum(0), d))

        # P -> S(d): global loss (sum_r T[r] * W[0]).sum() split by shard.
        x = _leaf(T[r])
        y = reduce_scatter(x, d, g)
        (y * chunk(W[0], d)).sum().backward()
        _check(f"reduce_scatter(dim={d})", y, chunk(T.sum(0), d), x, W[0])

        # R -> S(d)
        x = _leaf(X)
        y = local_slice(x, d, g)
        (y * chunk(W[0], d)).sum().backward()
        _check(f"local_slice(dim={d})", y, chunk(X, d), x, W[0])
        # its own storage, whatever the dim: a view of x would keep all of x alive wherever y is saved
        assert y.untyped_storage().nbytes() == y.numel() * y.element_size(), f"local_slice(dim={d}) shares its input's storage"
        checked += ["all_gather", "all_gather_rs", "reduce_scatter", "local_slice"]

    for src, dst in ((0, 1), (1, 0), (2, 0), (1, 2), (-1, 1)):
        x = _leaf(chunk(X, src))
        y = all_to_all(x, src, dst, g)
        (y * chunk(W[0], dst)).sum().backward()
        _check(f"all_to_all({src}->{dst})", y, chunk(X, dst), x, chunk(W[0], src))
    checked.append("all_to_all")

    x = _leaf(T[r])
    y = all_reduce(x, g)
    (y * W[0]).sum().backward()
    _check("all_reduce", y, T.sum(0), x, W[0])

    # P -> R, waited when read (the loss): backward seeds without the sum, reading the value waits
    x = _leaf(T[r].sum())
    y = deferred_all_reduce(x, g)
    assert isinstance(y, DeferredSum), type(y)
    y.backward()
    assert_close(x.grad, torch.ones_like(x), rtol=0, atol=0)
    assert_close(y.item(), T.sum().item(), rtol=1e-12, atol=1e-12)
    x = _leaf(T[r])
    y = deferred_all_reduce(x, g)
    (y * W[0]).sum().backward()  # an op on the value before backward waits, then differentiates through it
    _check("deferred_all_reduce", y, T.sum(0), x, W[0])
    # (sum P, count P) -> sum / count R: the count started first; backward scales by the global count
    counts = torch.arange(1, len(T) + 1, dtype=torch.int64)  # rank r kept r + 1 tokens
    x = _leaf(T[r].sum())
    y = deferred_mean(x, start_count(counts[r], g), g)
    assert isinstance(y, DeferredSum), type(y)
    y.backward()
    assert_close(x.grad, 1 / counts.sum().to(x.dtype), rtol=1e-12, atol=0)
    assert_close(y.item(), (T.sum() / counts.sum()).item(), rtol=1e-12, atol=0)
    checked += ["all_reduce", "deferred_all_reduce", "deferred_mean", "start_count"]

    x = _leaf(X)
    y = grad_all_reduce(x, g)
    (y * W[r]).sum().backward()
    _check("grad_all_reduce", y, X, x, W.sum(0))

    # R -> P: the terms sum to X; every term's grad is the grad of the sum.
    x = _leaf(X)
    y = replicate_to_partial(x, g)
    (y * W[0]).sum().backward()
    _check("replicate_to_partial", y, X if r == 0 else torch.zeros_like(X), x, W[0])
    assert_close(all_reduce(y.detach(), g), X, rtol=0, atol=1e-12)

    # P -> R without gradient, issued early and waited for later (a token count)
    pending = all_reduce_start(T[r], g)
    assert_close(wait(pending), T.sum(0), rtol=0, atol=1e-12)
    for d in range(len(SHAPE)):  # S(d) -> R without gradient, started early (labels a plan gathers)
        x = chunk(X, d)
        assert_close(wait_all_gather(all_gather_start(x, g), x, d, g), X, rtol=0, atol=0)
    checked += ["all_reduce", "grad_all_reduce", "replicate_to_partial", "all_reduce_start", "all_gather_start"]
    return sorted(set(checked))


@pytest.mark.parametrize("mesh_shape, axis", [((2,), 0), ((4,), 0), ((2, 2), 0), ((2, 2), 1)])
def test_collectives_match_single_process(spmd, mesh_shape, axis):
    world = 1
    for n in mesh_shape:
        world *= n
    results = spmd(_all_collectives, world, mesh_shape, axis)
    assert results == [sorted(COLLECTIVES)] * world


def _chain(rank: int, world_size: int) -> float:
    """A Megatron MLP (float64): column-parallel W1 (f), row-parallel W2 (g), vs the unsharded MLP."""
    mesh = ProcessMesh((world_size,))
    g, r = mesh.group_name(0), mesh.coordinate[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    w1 = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    w2 = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    xr, w1r, w2r = _leaf(x), _leaf(w1), _leaf(w2)
    ref = (torch.relu(xr @ w1r.t()) @ w2r.t()).square().sum()
    ref.backward()
    xs, w1s, w2s = _leaf(x), _leaf(w1.chunk(world_size, 0)[r]), _leaf(w2.chunk(world_size, 1)[r])
    h = torch.relu(grad_all_reduce(xs, g) @ w1s.t())  # (6, 16/n) column-parallel
    out = all_reduce(h @ w2s.t(), g)  # partial sums -> (6, 8) replicated
    loss = out.square().sum()
    loss.backward()
    assert_close(loss, ref)
    assert_close(xs.grad, xr.grad)
    assert_close(w1s.grad, w1r.grad.chunk(world_size, 0)[r])
    assert_close(w2s.grad, w2r.grad.chunk(world_size, 1)[r])
    return loss.item()


def test_megatron_mlp_chain(spmd):
    losses = spmd(_chain, 2)
    assert losses[0] == losses[1]  # the replicated loss is bitwise identical on both ranks
