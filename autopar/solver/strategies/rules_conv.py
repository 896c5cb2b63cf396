"""Convolutions split by channels: the tensor parallelism of CNNs.

DTensor's convolution rule only splits the batch. A convolution is a matmul
over its channels, so Megatron's two splits apply (groups=1, not transposed).
Per mesh axis (output; input, weight[, bias]):
  (R; R, R[, R])
  (S(0); S(0), R[, R])      batch split (DTensor's rule)
  (S(1); R, S(0)[, S(0)])   output channels split: column parallel
  (P; S(1), S(1)[, P])      input channels split: row parallel, each rank's term a partial
                            sum (the bias added once, by the Partial convention)
Splitting a spatial dim would need halo exchange between neighbours and is not offered.
The resampling ops of `F.interpolate` are here too (`resample_rules`): split by batch or channels.
"""
from __future__ import annotations

import torch

from autopar.solver.spec import Partial, Replicate, Shard
from autopar.solver.strategies.expand import AxisRule, Rule, expand_over_mesh

aten = torch.ops.aten


def convolution_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    x, weight, bias = args[0], args[1], args[2]
    transposed, groups = args[6], args[8]
    if transposed or groups != 1:
        return None  # leave to DTensor (batch split only)
    has_bias = isinstance(bias, torch.Tensor)

    def rule(out, x_p, w_p, b_p) -> AxisRule:
        return (out, x_p, w_p) + ((b_p,) if has_bias else ())

    one_axis: list[AxisRule] = [
        rule(Replicate(), Replicate(), Replicate(), Replicate()),
        rule(Shard(0), Shard(0), Replicate(), Replicate()),
        rule(Shard(1), Replicate(), Shard(0), Shard(0)),
        rule(Partial(), Shard(1), Shard(1), Partial()),
    ]
    return expand_over_mesh(one_axis, 1, len(mesh_shape))


# Resampling (F.interpolate: a U-Net's or diffusion model's upsampling). Each (sample, channel) plane is
# resampled on its own, and linearly (nearest, linear, bilinear, bicubic, trilinear: a fixed weighted sum
# of input pixels), so per mesh axis: batch or channels split, or a Partial input giving a Partial output.
# DTensor has no rule: without one the op ran replicated, its input gathered.
_RESAMPLE = [getattr(getattr(aten, name), overload)
             for name in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
                          "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
                          "upsample_bicubic2d", "upsample_trilinear3d")
             for overload in ("default", "vec")]


def resample_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    one_axis: list[AxisRule] = [(Replicate(), Replicate()), (Partial(), Partial()), (Shard(0), Shard(0)), (Shard(1), Shard(1))]
    return expand_over_mesh(one_axis, 1, len(mesh_shape))


RULES = {aten.convolution.default: convolution_rules, **{op: resample_rules for op in _RESAMPLE}}
