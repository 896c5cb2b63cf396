"""The reduce-scatter epilogue: add a bias and/or a residual to a collective's output.

In sequence-parallel blocks the row-parallel linear's partial output is reduce-scattered and
then `+ bias` and `+ residual` are applied, two more full passes over the activation (and two
more in backward's recompute). Fused, the result is written once: out = (x + bias) + residual,
added in float32 and rounded once to the output dtype, so bf16 activations lose nothing to
intermediate roundings. (The torch fallback follows the same order and precision.)
"""

from __future__ import annotations

import torch

from kernels._dispatch import Impl, use_triton
from kernels._strided import launch_strided


def add_epilogue(
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """(x + bias) + residual with float32 math. `bias` is 1-D over x's last dim, `residual` has
    x's shape; any strides. Writes `out` (may be `x` itself, for in place) or a new tensor in x's
    dtype. Not differentiable: it runs inside the runtime's autograd-aware collectives."""
    if bias is not None and (bias.dim() != 1 or x.dim() == 0 or bias.shape[0] != x.shape[-1]):
        raise ValueError(f"add_epilogue: bias must be 1-D of size {x.shape[-1] if x.dim() else '?'} "
                         f"(x's last dim), got shape {tuple(bias.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_epilogue: residual has shape {tuple(residual.shape)}, x has {tuple(x.shape)}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape:
        raise ValueError(f"add_epilogue: out has shape {tuple(out.shape)}, x has {tuple(x.shape)}")
    operands = [t for t in (out, x, bias, residual) if t is not None]
    if len({t.device for t in operands}) > 1:
        raise ValueError(f"add_epilogue: tensors on several devices: {sorted({str(t.device) for t in operands})}")
    with torch.no_grad():
        if use_triton(impl, operands, "add_epilogue"):
            b = None if bias is None else bias.expand(x.shape)  # stride 0 over the rows
            launch_strided(out, x, b=b, r=residual)
        else:
            _add_epilogue_torch(x, bias, residual, out)
    return out


def _add_epilogue_torch(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                        out: torch.Tensor) -> None:
    # Operands are converted (exactly) before adding: on CPU a mixed-dtype add takes torch's
    # slow scalar casting path.
    compute = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64
    acc = x.to(compute)  # an alias when x is already float32: never written below
    if bias is not None:
        acc = acc + bias.to(compute)  # a new tensor
    if residual is not None:
        acc = acc + residual.to(compute) if acc is x else acc.add_(residual.to(compute))
    out.copy_(acc)
