"""The shared strided kernel's host side: dim collapsing, and layouts too fragmented for 4 dims."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from kernels._strided import collapse_dims, launch_strided


def test_collapse_dims_merges_what_every_operand_allows():
    x = torch.empty(2, 3, 4, 5)
    assert collapse_dims(x.shape, x.stride()) == ([120], [[1]])
    t = x.transpose(1, 2)  # (2, 4, 3, 5): dims 0 and 3 stay separate from the swapped pair
    assert collapse_dims(t.shape, t.stride()) == ([2, 4, 3, 5], [[60, 5, 20, 1]])
    assert collapse_dims(t.shape, t.stride(), torch.empty(t.shape).stride()) == (
        [2, 4, 3, 5], [[60, 5, 20, 1], [60, 15, 5, 1]])
    bias = torch.empty(5).expand(2, 3, 4, 5)  # broadcast: rows merge, the last dim cannot
    assert collapse_dims(bias.shape, bias.stride(), x.stride()) == ([24, 5], [[0, 1], [5, 1]])
    assert collapse_dims((1, 7, 1), (7, 1, 1)) == ([7], [[1]])


def fragmented(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of `shape` whose dims all have non-mergeable strides (stored reversed, every
    other element), so it cannot be described by 4 (size, stride) pairs."""
    gen = torch.Generator().manual_seed(sum(shape))
    n = len(shape)
    base = torch.randn(*shape[::-1][:-1], 2 * shape[0], generator=gen).to(dtype)[..., ::2]
    return base.permute(*reversed(range(n)))


def test_fragmented_input_is_made_dense_first(interpret):
    shape = (2, 3, 2, 3, 2, 3)
    x, out = fragmented(shape), torch.empty(shape, dtype=torch.bfloat16)
    assert len(collapse_dims(x.shape, x.stride(), out.stride())[0]) > 4
    launch_strided(out, x, scale=0.5)
    assert_close(out, (x * 0.5).to(torch.bfloat16), rtol=0, atol=0)


def test_fragmented_output_goes_through_a_dense_buffer(interpret):
    shape = (3, 2, 3, 2, 3, 2)
    out, x = fragmented(shape), torch.randn(shape)
    expected = x * 0.25 + out  # accumulate: r is out itself
    launch_strided(out, x, scale=0.25, r=out)
    assert_close(out, expected, rtol=0, atol=0)
