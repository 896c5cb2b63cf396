"""chunk_to_leading / leading_to_dim against `torch.cat(x.chunk(parts, dim))`-style references,
on both paths, plus simulated collectives (all ranks in one process) that use them."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from kernels import chunk_to_leading, leading_to_dim

# (shape, dim, parts): every dim of a few ranks, odd sizes, size-1 dims, negative dims.
CASES = [
    ((12,), 0, 3),
    ((7, 6), 1, 2),
    ((7, 6), -1, 3),
    ((3, 8, 6), 1, 4),
    ((3, 8, 6), 2, 2),
    ((3, 8, 6), 0, 3),
    ((1, 10, 5), 1, 5),
    ((2, 3, 4, 10), 2, 2),
    ((2, 3, 4, 10), -1, 5),
    ((5, 1, 9), 2, 3),
]
LAYOUTS = ["contiguous", "transposed", "sliced"]


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert_close(actual, expected, rtol=0, atol=0)


def make(shape: tuple[int, ...], layout: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of `shape` stored contiguously, transposed (first and last dims swapped in
    memory) or as every other element of a bigger buffer."""
    gen = torch.Generator().manual_seed(len(shape) * 100 + sum(shape))
    if layout == "contiguous":
        return torch.randn(shape, generator=gen).to(dtype)
    if layout == "transposed":
        return torch.randn(shape[::-1], generator=gen).to(dtype).permute(*reversed(range(len(shape))))
    return torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(dtype)[..., ::2]


def ref_chunk_to_leading(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    return torch.stack(x.chunk(parts, dim))


def ref_leading_to_dim(buf: torch.Tensor, dim: int, parts: int, shape: tuple[int, ...]) -> torch.Tensor:
    chunk_shape = list(shape)
    chunk_shape[dim] //= parts
    return torch.cat(buf.reshape(parts, *chunk_shape).unbind(0), dim)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,dim,parts", CASES)
def test_layouts_torch_match_reference(shape, dim, parts, layout):
    x = make(shape, layout)
    send = chunk_to_leading(x, dim, parts, impl="torch")
    assert send.is_contiguous()
    exact(send, ref_chunk_to_leading(x, dim, parts))
    exact(send.reshape(-1), torch.cat([c.reshape(-1) for c in x.chunk(parts, dim)]))
    exact(leading_to_dim(send, dim, parts, shape, impl="torch"), x)
    flat = make((x.numel(),), layout)
    exact(leading_to_dim(flat, dim, parts, shape, impl="torch"), ref_leading_to_dim(flat, dim, parts, shape))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,dim,parts", CASES)
def test_layouts_triton_match_torch(interpret, shape, dim, parts, layout):
    x = make(shape, layout, torch.bfloat16 if layout == "sliced" else torch.float32)
    send = chunk_to_leading(x, dim, parts, impl="triton")
    exact(send, chunk_to_leading(x, dim, parts, impl="torch"))
    buf = make((x.numel(),), layout, x.dtype)
    exact(leading_to_dim(buf, dim, parts, shape, impl="triton"),
          leading_to_dim(buf, dim, parts, shape, impl="torch"))


def test_out_fuses_a_cast(impl):
    x = make((4, 6, 10), "transposed")
    send = chunk_to_leading(x, 2, 2, out=torch.empty(2 * 4 * 6 * 5, dtype=torch.bfloat16), impl=impl)
    exact(send, ref_chunk_to_leading(x, 2, 2).to(torch.bfloat16).reshape(-1))
    y = leading_to_dim(send, 2, 2, (4, 6, 10), out=torch.empty(4, 6, 10, dtype=torch.float16), impl=impl)
    exact(y, x.to(torch.bfloat16).to(torch.float16))


def test_no_copy_when_chunks_are_already_leading():
    x = torch.randn(6, 5)
    assert chunk_to_leading(x, 0, 3).data_ptr() == x.data_ptr()
    assert chunk_to_leading(x.unsqueeze(0), 1, 2).data_ptr() == x.data_ptr()  # size-1 dims before dim
    assert leading_to_dim(x.reshape(-1), 0, 2, (6, 5)).data_ptr() == x.data_ptr()
    assert chunk_to_leading(x, 1, 5).data_ptr() != x.data_ptr()


def test_layout_errors():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="dim 1 of size 6 does not split into 4 equal parts"):
        chunk_to_leading(x, 1, 4)
    with pytest.raises(ValueError, match="dim 2 out of range"):
        chunk_to_leading(x, 2, 1)
    with pytest.raises(ValueError, match="buf has 24 elements, shape"):
        leading_to_dim(x, 1, 2, (4, 8))
    with pytest.raises(ValueError, match="out must be contiguous with 24 elements"):
        chunk_to_leading(x, 1, 2, out=torch.empty(23))


@pytest.mark.parametrize("world", [2, 3])
def test_simulated_all_to_all_shard1_to_shard2(impl, world):
    full = torch.randn(2, 3 * world, 2 * world)  # (B, S, H)
    shards = full.chunk(world, 1)  # rank r holds Shard(1): (B, S/p, H)
    sends = [chunk_to_leading(x, 2, world, impl=impl) for x in shards]  # (p, B, S/p, H/p)
    for r in range(world):
        recv = torch.stack([sends[src][r] for src in range(world)])  # all_to_all_single
        y = leading_to_dim(recv, 1, world, (2, 3 * world, 2), impl=impl)
        exact(y, full.chunk(world, 2)[r])  # rank r now holds Shard(2): (B, S, H/p)


def test_simulated_all_gather_on_last_dim(impl):
    world, full = 4, torch.randn(3, 5, 8)
    gathered = torch.cat([s.contiguous() for s in full.chunk(world, -1)])  # all_gather_into_tensor
    exact(leading_to_dim(gathered, -1, world, full.shape, impl=impl), full)
