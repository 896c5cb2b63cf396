"""Which path runs: the dispatch rule of `kernels._dispatch`, observed through the launchers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import TritonUnavailableError, _dispatch, bucket, pack


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records which pack implementation ran (and still runs it)."""
    ran: list[str] = []
    for name in ("_pack_torch", "_pack_triton"):
        real = getattr(bucket, name)
        monkeypatch.setattr(bucket, name, lambda *a, _real=real, _name=name: (ran.append(_name), _real(*a)))
    return ran


def test_cpu_without_interpreter_uses_torch(monkeypatch, spy):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pack([torch.randn(3)])
    assert spy == ["_pack_torch"]
    if _dispatch.triton_importable():
        with pytest.raises(TritonUnavailableError, match="tensors are on \\['cpu'\\]: compiled Triton needs cuda"):
            pack([torch.randn(3)], impl="triton")


def test_interpreter_on_cpu_uses_triton(interpret, spy):
    pack([torch.randn(3)])
    pack([torch.randn(3)], impl="torch")
    pack([torch.randn(3, dtype=torch.float64)])  # no float64 kernel: auto falls back
    assert spy == ["_pack_triton", "_pack_torch", "_pack_torch"]
    with pytest.raises(TritonUnavailableError, match="dtype torch.float64 has no Triton kernel"):
        pack([torch.randn(3, dtype=torch.float64)], impl="triton")


def test_missing_triton_falls_back(monkeypatch, spy):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_dispatch, "triton_importable", lambda: False)
    pack([torch.randn(3)])
    assert spy == ["_pack_torch"]
    with pytest.raises(TritonUnavailableError, match="triton is not importable"):
        pack([torch.randn(3)], impl="triton")


def test_kernels_follow_the_interpreter_switch(interpret, monkeypatch):
    # triton.jit decides interpreted vs compiled when it decorates: the module is rebuilt
    # whenever TRITON_INTERPRET changed since it was last built.
    assert _dispatch.triton_kernels().BUILT_INTERPRETED is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _dispatch.triton_kernels().BUILT_INTERPRETED is False
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    assert _dispatch.triton_kernels().BUILT_INTERPRETED is True


def test_import_does_not_import_triton():
    # The runtime imports `kernels` in every process; triton (about a second) only loads on use.
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'triton imported'"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernels_match_torch_on_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytest.importorskip("triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(n, device="cuda", generator=gen).to(dt) for n, dt in
             [(1, torch.bfloat16), (7, torch.float16), (100_003, torch.float32), (3 * 8192 + 1, torch.bfloat16)]]
    grads.append(torch.randn(33, 17, device="cuda", generator=gen).t())
    for dtype in (torch.float32, torch.bfloat16):
        fused = kernels.pack(grads, scale=0.37, dtype=dtype, impl="triton")
        torch.testing.assert_close(fused, kernels.pack(grads, scale=0.37, dtype=dtype, impl="torch"), rtol=0, atol=0)
        a, b = [g.clone() for g in grads], [g.clone() for g in grads]
        kernels.unpack(fused, a, scale=0.5, accumulate=True, impl="triton")
        kernels.unpack(fused, b, scale=0.5, accumulate=True, impl="torch")
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    x = torch.randn(4, 12, 10, device="cuda", generator=gen).transpose(0, 2)
    for dim in range(3):
        send = kernels.chunk_to_leading(x, dim, 2, impl="triton")
        torch.testing.assert_close(send, torch.stack(x.chunk(2, dim)), rtol=0, atol=0)
        torch.testing.assert_close(kernels.leading_to_dim(send, dim, 2, x.shape, impl="triton"), x, rtol=0, atol=0)
