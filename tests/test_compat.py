"""The supported torch and Triton releases: the range checks the GPU check starts with, and the import-time settling of
autograd's engine (on torch 2.11 and 2.12 ranks forked after the profiler's probes could not run backward)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.api import capture_copy, training_precision
from autopar.compat import SUPPORTED_TORCH, SUPPORTED_TRITON, check_torch, check_triton, release
from autopar.errors import AutoparError
from autopar.profiler import profile
from autopar.runtime.launch import run_ranks
from autopar.tracer import trace


def test_the_supported_range():
    assert release("2.11.0+cu130") == (2, 11) and release("2.13.0") == (2, 13)
    assert SUPPORTED_TORCH == ((2, 11), (2, 13))
    for version in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu"):
        check_torch(version)
    for version in ("2.10.0", "2.14.0", "3.0.0"):
        with pytest.raises(AutoparError, match=rf"torch {version} is outside .* 2\.11 through 2\.13: install"):
            check_torch(version)
    assert SUPPORTED_TRITON == ((3, 6), (3, 9))
    for version in ("3.6.0", "3.9.1"):
        check_triton(version)
    for version in ("3.5.1", "3.10.0"):
        with pytest.raises(AutoparError, match=rf"triton {version} is outside .* 3\.6 through 3\.9: install"):
            check_triton(version)


def _backward(rank: int, world_size: int) -> float:
    x = torch.ones(3, requires_grad=True)
    (2 * x).sum().backward()
    return float(x.grad.sum())


def test_ranks_forked_after_profiling_run_backward():
    model, x = nn.Linear(8, 4), torch.randn(2, 8)
    traced = trace(*capture_copy(model, x, "cpu"))
    profile(traced)  # backward on fake tensors, in this process
    assert run_ranks(_backward, 2, timeout_s=60) == [6.0, 6.0]


def test_the_math_mode_a_preset_is_priced_at():
    x = torch.randn(2, 8)
    fp32 = trace(*capture_copy(nn.Linear(8, 4), x, "cpu"))
    bf16 = trace(*capture_copy(nn.Linear(8, 4).bfloat16(), x.bfloat16(), "cpu"))
    assert training_precision(bf16) == "bf16"
    assert training_precision(fp32) == "fp32"  # torch's default for float32 matmuls: "highest"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert training_precision(fp32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
