"""The kernels compile for real GPUs (sm_80, sm_90) on this GPU-less machine: triton lowers
them through TTIR, LLVM and PTX to a cubin with its bundled ptxas. The interpreter checks the
numerics but is lenient about what the compiler rejects; this checks the other half."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
compiler = pytest.importorskip("triton.compiler")
backends = pytest.importorskip("triton.backends.compiler")


@pytest.fixture
def compiled_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path):
    from kernels._dispatch import triton_kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from a cache
    mod = triton_kernels()
    assert not mod.BUILT_INTERPRETED
    return mod


def compile_for(fn, signature: dict[str, str], constexprs: dict[str, object], arch: int):
    full = {**signature, **{name: "constexpr" for name in constexprs}}
    source = compiler.ASTSource(fn, full, constexprs=constexprs)
    kernel = triton.compile(source, target=backends.GPUTarget("cuda", arch, 32),
                            options={"enable_fp_fusion": False})
    assert kernel.asm["cubin"], "no cubin"
    return kernel


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_to_cubin(compiled_kernels, arch):
    k = compiled_kernels
    tables = {"table_ptr": "*i64", "scale": "fp32"}
    compile_for(k.multi_tensor_pack_kernel, {**tables, "out_ptr": "*fp32"},
                {"SRC_DTYPE": tl.bfloat16, "CHUNK": 8192, "BLOCK": 1024}, arch)
    compile_for(k.multi_tensor_pack_kernel, {**tables, "out_ptr": "*bf16"},
                {"SRC_DTYPE": tl.float32, "CHUNK": 8192, "BLOCK": 1024}, arch)
    for in_memory in (False, True):  # a number's scale, and a 0-d tensor's the kernel loads
        compile_for(k.multi_tensor_unpack_kernel, {**tables, "bucket_ptr": "*fp32", "scale_ptr": "*fp32"},
                    {"DST_DTYPE": tl.float16, "ACCUMULATE": True, "SCALE_IN_MEMORY": in_memory, "CHUNK": 8192,
                     "BLOCK": 1024}, arch)
    strided = {"out_ptr": "*bf16", "x_ptr": "*fp32", "r_ptr": "*bf16", "scale": "fp32",
               "ROWS": "i32", "S1": "i32", "S2": "i32", "S3": "i64"}
    strided.update({f"{op}{i}": "i64" for op in ("so", "sx", "sr") for i in range(4)})
    kernel = compile_for(k.strided_ew_kernel, strided, {"HAS_R": True, "BLOCK_R": 16, "BLOCK_C": 256}, arch)
    assert "fma.rn.f32" not in kernel.asm["ptx"]  # enable_fp_fusion=False: same roundings as torch
