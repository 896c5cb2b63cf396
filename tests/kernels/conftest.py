"""Fixtures for the kernel tests.

`interpret` runs a test under Triton's CPU interpreter: triton.jit reads TRITON_INTERPRET when
it decorates a kernel, and `kernels._dispatch.triton_kernels()` re-decorates the kernels when the
variable changed, so setting it per test (and having monkeypatch restore it) is enough; the rest
of the suite never sees it. Tests without the fixture exercise the torch fallback and never skip.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=["torch", "triton"])
def impl(request: pytest.FixtureRequest) -> str:
    """Both paths: "triton" runs under the interpreter (skipped without triton)."""
    if request.param == "triton":
        request.getfixturevalue("interpret")
    return request.param


@pytest.fixture
def rand() -> Callable[..., torch.Tensor]:
    """rand(*shape, dtype=torch.float32): seeded standard normal values (so failures reproduce)."""
    gen = torch.Generator().manual_seed(0)

    def make(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    return make
