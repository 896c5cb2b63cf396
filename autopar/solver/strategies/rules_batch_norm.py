"""Training-mode batch norm: split the channels (independent), or split the batch with synchronised statistics;
and group norm where DTensor has no rule for it (torch 2.11 and 2.12).

`_native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var,
training=True, momentum, eps)` returns (out, mean, rstd, new running mean, new
running var). DTensor only splits the channel dim; a data-parallel plan then had
to gather every batch-norm input. Per mesh axis (outputs; inputs, weight and bias
only when present):
  (R, R, R, R, R; R, R, R, R, R)                       replicated
  (S(1), S(0), S(0), S(0), S(0); S(1), S(0), ...)      channels split: every statistic is per channel
  (S(d), R, R, R, R; S(d), R, R, R, R)   d != 1        batch or spatial dim split: statistics of the
                                                       global batch, exchanged inside the node
                                                       (`autopar.runtime.sync_batch_norm`, SyncBatchNorm's math)
"""
from __future__ import annotations

import torch

from autopar.compat import TORCH_RELEASE
from autopar.solver.spec import Replicate, Shard
from autopar.solver.strategies.expand import AxisRule, Rule, expand_over_mesh

aten = torch.ops.aten


def batch_norm_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    x = args[0]
    training = args[5] if len(args) > 5 else kwargs.get("training", True)
    if not training or x.dim() < 2:
        return None
    present = [isinstance(a, torch.Tensor) for a in args[1:5]]  # weight, bias, running_mean, running_var
    if not all(present[2:]):
        return None

    def rule(x_p, stat_p) -> AxisRule:
        return (x_p, stat_p, stat_p, stat_p, stat_p, x_p) + tuple(stat_p for p in present if p)

    one_axis: list[AxisRule] = [rule(Replicate(), Replicate()), rule(Shard(1), Shard(0))]
    one_axis += [rule(Shard(d), Replicate()) for d in range(x.dim()) if d != 1]
    return expand_over_mesh(one_axis, 5, len(mesh_shape))


def group_norm_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    """`native_group_norm(x, weight, bias, N, C, HxW, group, eps)` -> (out, mean, rstd), the statistics (N, group):
    each sample's statistics are its own, so the batch splits with them (`localize` makes N this rank's), as
    torch 2.13's DTensor rule has it. Nothing else splits: a group spans channels and every position."""
    present = [isinstance(a, torch.Tensor) for a in args[1:3]]  # weight, bias

    def rule(p) -> AxisRule:
        return (p, p, p, p) + tuple(Replicate() for here in present if here)

    return expand_over_mesh([rule(Replicate()), rule(Shard(0))], 3, len(mesh_shape))


RULES = {aten._native_batch_norm_legit_functional.default: batch_norm_rules}
if TORCH_RELEASE < (2, 13):  # torch 2.11 and 2.12: DTensor has no rule for group norm (2.13's splits the batch)
    RULES[aten.native_group_norm.default] = group_norm_rules
