"""Inputs laid out as some ops' kernels need them, whatever layout a rank's local tensor has.

A traced graph holds no copy where the traced tensor already had the layout a kernel needs: the
`.contiguous()` inside `F.group_norm` leaves nothing in the graph when its input was contiguous
at trace time. A rank's local tensor can be laid out otherwise than the traced one: a collective
returns a contiguous tensor where the trace had a transposed view, and the transpose back that
follows is then no longer contiguous (diffusers' attention runs `group_norm(x.transpose(1, 2))`
on a transposed view: on a 2x2 mesh, `native_group_norm` raised "Expected
X.is_contiguous(memory_format)"). Most kernels take any strides; the ops below do not, and
each of their listed inputs is made contiguous first where it is not (no copy where it is).

The list is what `benchmarks/contiguous_kernels.py` finds: every aten call of torch's OpInfo
samples (forward and backward) run again with each tensor input laid out otherwise, the calls
that raise or compute other values kept, less those a traced forward cannot hold (in-place,
`out=` and random ops, backward kernels, which autograd feeds as eager does).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import fx
from torch._prims_common import suggest_memory_format

aten = torch.ops.aten


def in_own_format(x: torch.Tensor) -> torch.Tensor:
    """`x` contiguous in the memory format its strides suggest (a channels-last tensor stays channels-last): what
    group norm's kernels check. torch's own Python twin of `Tensor.suggest_memory_format` decides, as the kernel does:
    a batch of one, whose dim 0 stride any value fits, can be channels-last contiguous and still suggest the plain
    format (a 2x2 mesh feeding diffusers' UNet a batch of 4 raised so)."""
    memory_format = suggest_memory_format(x)
    return x if x.is_contiguous(memory_format=memory_format) else x.contiguous(memory_format=memory_format)


def row_major(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous()


# op -> (positions of the tensor inputs its kernel needs laid out, how)
KERNEL_LAYOUTS: dict[torch._ops.OpOverload, tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]] = {
    # raises on a strided input; computes wrong values from a strided weight
    aten.native_group_norm.default: ((0, 1, 2), in_own_format),
    aten.view_as_complex.default: ((0,), row_major),  # a last dim of stride 1 and even strides elsewhere
    # computes wrong bags from strided indices, offsets or per-sample weights
    aten._embedding_bag.default: ((1, 2, 6), row_major),
    aten._embedding_bag_forward_only.default: ((1, 2, 6), row_major),
    aten._pdist_forward.default: ((0,), row_major),  # raises on a strided input
}


def lay_out_inputs(graph: fx.Graph, target: object, args: tuple) -> tuple:
    """`args` of a call to `target` about to be emitted in `graph`, each input its kernel needs laid out passed
    through the function that lays it out so."""
    if target not in KERNEL_LAYOUTS:
        return args
    positions, lay_out = KERNEL_LAYOUTS[target]
    return tuple(graph.call_function(lay_out, (a,)) if i in positions and isinstance(a, fx.Node) else a
                 for i, a in enumerate(args))
