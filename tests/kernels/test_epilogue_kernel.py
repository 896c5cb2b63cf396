"""add_epilogue on both paths against (x + bias) + residual computed in float32."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from kernels import add_epilogue

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert_close(actual, expected, rtol=0, atol=0)


def reference(x, bias, residual):
    acc = x.float()
    if bias is not None:
        acc = acc + bias.float()
    if residual is not None:
        acc = acc + residual.float()
    return acc.to(x.dtype)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 7, 1023])
@pytest.mark.parametrize("terms", ["bias", "residual", "both", "neither"])
def test_epilogue_matches_float32_reference(impl, rand, x_dtype, hidden, terms):
    x = rand(3, hidden, dtype=x_dtype)
    bias = rand(hidden, dtype=torch.float32 if x_dtype == torch.float16 else x_dtype) \
        if terms in ("bias", "both") else None
    residual = rand(hidden, 3, dtype=torch.bfloat16).t() if terms in ("residual", "both") else None
    out = add_epilogue(x, bias, residual, impl=impl)
    assert out.dtype == x_dtype and out.data_ptr() != x.data_ptr()
    exact(out, reference(x, bias, residual))


def test_epilogue_in_place_on_strided_3d(impl, rand):
    base = rand(2, 5, 2 * 9, dtype=torch.bfloat16)
    x = base[..., ::2]  # (2, 5, 9), every other element
    bias, residual = rand(9), rand(9, 5, 2).permute(2, 1, 0)
    expected, others = reference(x, bias, residual), base[..., 1::2].clone()
    assert add_epilogue(x, bias, residual, out=x, impl=impl) is x
    exact(x, expected)
    exact(base[..., 1::2], others)  # the elements between x's are untouched


def test_epilogue_out_dtype_and_errors(rand):
    x, bias = rand(4, 6, dtype=torch.bfloat16), rand(6)
    out = add_epilogue(x, bias, out=torch.empty(4, 6))
    exact(out, x.float() + bias)  # float32 out: no rounding at all
    with pytest.raises(ValueError, match="bias must be 1-D of size 6"):
        add_epilogue(x, rand(4))
    with pytest.raises(ValueError, match="residual has shape"):
        add_epilogue(x, residual=rand(6, 4))
    with pytest.raises(ValueError, match="out has shape"):
        add_epilogue(x, bias, out=torch.empty(6))
