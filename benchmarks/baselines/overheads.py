"""Framework overheads of the hand-written baselines, measured on the live world for the cost model's prices.

    tp_s = tp_module_overhead_s(tp=2)     # every rank: seconds per DTensor-parallel module per step

The cost model prices a baseline's collectives and compute; what it cannot know
from the graph is what the framework adds per module on top: DTensor's sharding
propagation and redistribute bookkeeping in Python on every op of a
`parallelize_module` layer (forward and backward), which on a contended CPU host
costs far more than the collectives it wraps. Measured here as the difference
between a column-parallel + row-parallel MLP pair on the tp mesh and the same
pair written by hand with plain tensors and the same all-reduces, per module.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from autopar.runtime.calibrate import time_ops

_WIDTH = 64  # tiny-model width: the overhead is per op, not per byte


class _Grad(torch.autograd.Function):
    """Identity forward, all-reduce backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Sum(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def tp_module_overhead_s(world: int, tp: int, tokens: int = 256, reps: int = 5) -> float:
    """Seconds per step that one DTensor-parallel linear adds over a hand-written one (MAX over ranks)."""
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    group = mesh.get_group("tp")
    torch.manual_seed(0)
    dtensor = nn.Sequential(nn.Linear(_WIDTH, 4 * _WIDTH), nn.Linear(4 * _WIDTH, _WIDTH))
    parallelize_module(dtensor, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    col = nn.Linear(_WIDTH, 4 * _WIDTH // tp)
    row = nn.Linear(4 * _WIDTH // tp, _WIDTH, bias=False)
    x = torch.randn(tokens, _WIDTH, requires_grad=True)  # a block input: its grad is all-reduced in backward

    def by_dtensor() -> None:
        dtensor(x).sum().backward()

    def by_hand() -> None:
        _Sum.apply(row(col(_Grad.apply(x, group))), group).sum().backward()

    t_dtensor, t_hand = time_ops([by_dtensor, by_hand], torch.device("cpu"), reps, None)
    return max(t_dtensor - t_hand, 0.0) / 2
