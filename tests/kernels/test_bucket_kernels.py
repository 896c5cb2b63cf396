"""pack / unpack: the torch fallback against plain references, the Triton kernels (interpreted)
against the fallback, on mixed dtypes, odd sizes, non-contiguous tensors, scale and accumulate."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from kernels import bucket_offsets, pack, unpack
from kernels.bucket import _CHUNK

BUCKET_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALES = [1.0, 0.37]


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def gradients(seed: int = 0) -> list[torch.Tensor]:
    """A bucket's worth of awkward gradients: odd sizes, three dtypes, strided views, empties.
    The same seed gives equal tensors with equal strides (clone() would densify the views)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    return [
        rand(1, dtype=torch.bfloat16),
        rand(7, dtype=torch.float16),
        rand(1023),
        rand(9, 5, dtype=torch.bfloat16).t(),  # transposed
        rand(20, 6)[::3, 1:4],  # sliced rows and columns
        rand(0),
        rand(dtype=torch.float16),  # 0-d
        rand(3, 1, 11),
    ]


def bf16_edge_values() -> torch.Tensor:
    """float32 values whose bfloat16 rounding is delicate: exact ties (to even, both ways),
    just above a tie, overflow to inf, subnormals, signed zero, inf, nan."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0xBF808000, 0x7F7FFFFF, 0x00000001,
                         0x007FFFFF, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000], dtype=torch.int64)
    return bits.to(torch.int32).view(torch.float32)


def ref_pack(tensors: list[torch.Tensor], dtype: torch.dtype, scale: float) -> torch.Tensor:
    return torch.cat([(t.float() * scale).to(dtype).reshape(-1) for t in tensors])


def ref_unpack(bucket: torch.Tensor, tensors: list[torch.Tensor], scale: float, accumulate: bool
               ) -> list[torch.Tensor]:
    offsets, out = bucket_offsets(tensors), []
    for t, o in zip(tensors, offsets):
        value = bucket[o:o + t.numel()].view(t.shape).float() * scale
        out.append((t.float() + value if accumulate else value).to(t.dtype))
    return out


# ----- torch fallback (never skipped) -----

@pytest.mark.parametrize("dtype", BUCKET_DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_pack_torch_matches_reference(rand, dtype, scale):
    tensors = gradients()
    exact(pack(tensors, scale=scale, dtype=dtype, impl="torch"), ref_pack(tensors, dtype, scale))


@pytest.mark.parametrize("dtype", BUCKET_DTYPES)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_unpack_torch_matches_reference(rand, dtype, scale, accumulate):
    tensors = gradients()
    bucket = rand(bucket_offsets(tensors)[-1], dtype=dtype)
    expected = ref_unpack(bucket, tensors, scale, accumulate)
    unpack(bucket, tensors, scale=scale, accumulate=accumulate, impl="torch")
    for t, e in zip(tensors, expected):
        exact(t, e)


def test_pack_writes_into_out_and_keeps_padding(rand):
    tensors = gradients()
    total = bucket_offsets(tensors)[-1]
    out = torch.full((total + 5,), 42.0)
    assert pack(tensors, out=out, scale=0.5, impl="torch") is out
    exact(out[:total], ref_pack(tensors, torch.float32, 0.5))
    exact(out[total:], torch.full((5,), 42.0))


def test_pack_default_dtype_promotes(rand):
    bucket = pack([rand(3, dtype=torch.bfloat16), rand(2, dtype=torch.float16)], impl="torch")
    assert bucket.dtype == torch.float32 and bucket.shape == (5,)
    assert pack([rand(4, dtype=torch.bfloat16)], impl="torch").dtype == torch.bfloat16
    assert pack([], impl="torch").shape == (0,)


def test_pack_bf16_rounds_to_nearest_even():
    x = bf16_edge_values()
    exact(pack([x], dtype=torch.bfloat16, impl="torch"), x.to(torch.bfloat16))


def test_roundtrip_and_float64_on_torch_path(rand):
    tensors = gradients() + [rand(5, dtype=torch.float64)]
    bucket = pack(tensors, scale=0.25)  # auto: float64 has no kernel, so this is the torch path
    assert bucket.dtype == torch.float64
    copies = [torch.zeros_like(t) for t in tensors]
    unpack(bucket, copies, scale=4.0)
    for c, t in zip(copies, tensors):
        exact(c, t)


def test_bucket_errors(rand):
    tensors = [rand(4), rand(3)]
    with pytest.raises(ValueError, match="holds 6 elements but the tensors need 7"):
        pack(tensors, out=torch.empty(6))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        pack(tensors, out=torch.empty(4, 2))
    with pytest.raises(ValueError, match="dtype=torch.float16 but out has dtype torch.float32"):
        pack(tensors, out=torch.empty(7), dtype=torch.float16)
    with pytest.raises(ValueError, match="is on meta"):
        unpack(torch.empty(7, device="meta"), tensors)
    with pytest.raises(ValueError, match="impl must be"):
        pack(tensors, impl="cuda")  # type: ignore[arg-type]


# ----- Triton kernels under the interpreter, against the fallback -----

@pytest.mark.parametrize("dtype", BUCKET_DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_pack_triton_matches_torch(interpret, rand, dtype, scale):
    tensors = gradients()
    exact(pack(tensors, scale=scale, dtype=dtype, impl="triton"),
          pack(tensors, scale=scale, dtype=dtype, impl="torch"))


@pytest.mark.parametrize("dtype", BUCKET_DTYPES)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_unpack_triton_matches_torch(interpret, rand, dtype, scale, accumulate):
    tensors, by_triton = gradients(), gradients()
    bucket = rand(bucket_offsets(tensors)[-1], dtype=dtype)
    unpack(bucket, by_triton, scale=scale, accumulate=accumulate, impl="triton")
    unpack(bucket, tensors, scale=scale, accumulate=accumulate, impl="torch")
    assert not tensors[3].is_contiguous() and not tensors[4].is_contiguous()
    for a, b in zip(by_triton, tensors):
        exact(a, b)


def test_pack_triton_splits_big_tensors_into_chunks(interpret, rand):
    tensors = [rand(2 * _CHUNK + 5, dtype=torch.bfloat16), rand(3), rand(_CHUNK)]
    out = torch.full((bucket_offsets(tensors)[-1] + 3,), -1.0)
    pack(tensors, out=out, scale=0.5, impl="triton")
    exact(out, torch.cat([ref_pack(tensors, torch.float32, 0.5), torch.full((3,), -1.0)]))
    back = [torch.zeros_like(t) for t in tensors]
    unpack(out, back, scale=2.0, impl="triton")
    for b, t in zip(back, tensors):
        exact(b, t)


def test_pack_triton_bf16_rounds_to_nearest_even(interpret):
    # Triton 3.9's interpreter truncates `x.to(tl.bfloat16)`; the kernels round explicitly.
    x = bf16_edge_values()
    exact(pack([x], dtype=torch.bfloat16, impl="triton"), x.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", BUCKET_DTYPES)
def test_unpack_reads_a_tensor_scale_as_its_value(impl, rand, dtype):
    """A 0-d float64 scale (a mean's 1 / global count, as the gradient sync holds it) gives the bits its value as a
    number gives: torch's ops and the kernel read it in float32, on the device, with the host never reading it."""
    tensors, by_tensor = gradients(), gradients()
    bucket = rand(bucket_offsets(tensors)[-1], dtype=dtype)
    scale = 1.0 / torch.tensor(3.0, dtype=torch.float64)
    unpack(bucket, tensors, scale=scale.item(), accumulate=True, impl=impl)
    unpack(bucket, by_tensor, scale=scale, accumulate=True, impl=impl)
    assert not by_tensor[3].is_contiguous()  # the kernel's strided members take the tensor too
    for a, b in zip(by_tensor, tensors):
        exact(a, b)
    with pytest.raises(ValueError, match=r"0-d tensor, got shape \(2,\)"):
        unpack(bucket, tensors, scale=torch.ones(2))
