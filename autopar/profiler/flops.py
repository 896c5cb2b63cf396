"""FLOP counting on top of `torch.utils.flop_counter`'s formula registry.

torch's registry (`flop_registry`, keyed by OpOverloadPacket) has formulas for
mm/addmm/bmm/baddbmm/conv and the CUDA attention kernels, but not for the CPU
flash-attention kernel that `scaled_dot_product_attention` dispatches to on CPU
(`_scaled_dot_product_flash_attention_for_cpu` and its backward), so
`FlopCounterMode` silently counts 0 for attention on CPU. `register_flop_formulas()`
registers torch's own `sdpa_flop` / `sdpa_backward_flop` formulas for those two
kernels (same argument layout as the CUDA flash kernels), one for `torch._grouped_mm` (which
torch counts as 0; eager transformers runs its mixtures of experts with it), and formulas for the
custom ops transformers runs a mixture of experts with, where they are loaded
(`transformers::grouped_mm_fallback` and its backward: one matmul per expert over
its tokens). The profiler calls it, and so does the reference measurement
(`autopar.profiler.measure`), so both sides count the same way.
"""
from __future__ import annotations

import math
import sys

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.compat import TORCH_RELEASE

aten = torch.ops.aten

_CPU_SDPA_FWD = aten._scaled_dot_product_flash_attention_for_cpu
_CPU_SDPA_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward


def _counted_with_query_heads(count):
    """`count(..., query_shape, key_shape, value_shape)` with the key and value taken at the query's head count."""
    def counted(*shapes):
        heads = shapes[-3][1]
        return count(*shapes[:-2], *((s[0], heads, *s[2:]) for s in shapes[-2:]))
    counted.gqa = True
    return counted


def _count_grouped_query_attention() -> None:
    """torch 2.11 and 2.12: FlopCounterMode's attention formulas assert that the key and value have the query's
    heads, so grouped-query attention (Llama's, Mistral's: fewer key/value heads) raised inside the profiler and the
    reference measurement. Each query head multiplies against its group's key and value as against its own, so
    2.13 counts with the query's heads; these releases are given the same count (the formulas look the two
    functions up in their module when called)."""
    if TORCH_RELEASE >= (2, 13) or getattr(flop_counter.sdpa_flop_count, "gqa", False):
        return
    flop_counter.sdpa_flop_count = _counted_with_query_heads(flop_counter.sdpa_flop_count)
    flop_counter.sdpa_backward_flop_count = _counted_with_query_heads(flop_counter.sdpa_backward_flop_count)


def register_flop_formulas() -> None:
    """Register the CPU flash-attention and the MoE formulas in torch's global flop registry (idempotent)."""
    _count_grouped_query_attention()
    if _CPU_SDPA_FWD not in flop_counter.flop_registry:
        # get_raw: sdpa_flop is already wrapped by torch's shape_wrapper.
        flop_counter.register_flop_formula(_CPU_SDPA_FWD, get_raw=True)(flop_counter.sdpa_flop)
    if _CPU_SDPA_BWD not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(_CPU_SDPA_BWD, get_raw=True)(flop_counter.sdpa_backward_flop)
    if aten._grouped_mm not in flop_counter.flop_registry:  # torch 2.13 has no formula for it and counts 0
        flop_counter.register_flop_formula(aten._grouped_mm)(aten_grouped_mm_flop)
    if "transformers.integrations.moe" not in sys.modules:  # what registers the MoE ops, on import
        return
    # transformers 5.17 (the GPU machines' release) differentiates the op in Python: it has no backward op
    for name, formula in (("grouped_mm_fallback", grouped_mm_flop), ("grouped_mm_fallback_backward", grouped_mm_backward_flop)):
        op = getattr(torch.ops.transformers, name, None)
        if op is not None and op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op)(formula)


def grouped_mm_flop(input_shape, weight_shape, offs_shape, out_shape=None, **kwargs) -> int:
    """(tokens, d_in) sorted by expert times each expert's (d_in, d_out): every token goes through one matmul."""
    tokens, d_in = input_shape
    return 2 * tokens * d_in * weight_shape[2]


def grouped_mm_backward_flop(input_shape, weight_shape, offs_shape, grad_shape, out_shape=None, **kwargs) -> int:
    """The gradients of the input and of the weights: two matmuls of the forward's size."""
    return 2 * grouped_mm_flop(input_shape, weight_shape, offs_shape)


def aten_grouped_mm_flop(a_shape, b_shape, offs_shape=None, bias_shape=None, out_dtype=None, out_shape=None,
                         **kwargs) -> int:
    """`torch._grouped_mm(a, b, offs)`, what transformers' eager mixture of experts runs: one matmul per group. The
    ragged dimension (`offs` splits it) is counted once in all: the rows of a 2-D `a` times a 3-D `b` (G, K, N),
    the shared K of two 2-D operands (the weights' gradient), the columns of a 2-D `b` after a 3-D `a` (G, M, K);
    two 3-D operands are G plain matmuls."""
    flops = 2 * math.prod(a_shape) * b_shape[-1]
    return flops // a_shape[0] if len(a_shape) == 3 and len(b_shape) == 2 else flops


def op_flops(func, args: tuple, kwargs: dict, out) -> object:
    """FLOPs of one aten call by torch's registered formula (0 when it has none).

    Works on real, fake and symbolic tensors: the formulas only read shapes, so a
    SymInt shape gives a SymInt count.
    """
    packet = getattr(func, "overloadpacket", func)
    formula = flop_counter.flop_registry.get(packet)
    if formula is None:
        return 0
    return formula(*args, **kwargs, out_val=out)


class CountFlops(TorchDispatchMode):
    """A lighter FlopCounterMode for fake-tensor probes: one total, no module tracking."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.total = self.total + op_flops(func, args, kwargs, out)
        return out
