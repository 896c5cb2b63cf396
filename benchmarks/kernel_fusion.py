"""Fused vs unfused gradient-bucket packing (kernels.pack / kernels.unpack).

    python benchmarks/kernel_fusion.py                          # 200 bf16 grads -> fp32 bucket, CPU (+ CUDA if present)
    python benchmarks/kernel_fusion.py --tensors 400 --grad-dtype float32 --bucket-dtype bfloat16

Unfused is what a naive runtime writes: per gradient `bucket[o:o+n].copy_(g.view(-1) * scale)`
to pack and `g.add_(bucket[o:o+n].view_as(g) * scale)` to unpack (two kernels and a temporary
per gradient). Fused is one `kernels.pack` / `kernels.unpack` call: the torch fallback on any
device, and the Triton kernels when a CUDA device is present (the interpreter is a correctness
tool, not timed). Warm-up, then the median over --iters runs; the table names the path that ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the `kernels` package, not this file (also named kernels)

from kernels import _dispatch, bucket_offsets, pack, unpack  # noqa: E402


def grad_sizes(n: int, max_numel: int) -> list[int]:
    """n log-uniform sizes in [1, max_numel]: biases and norms next to big matrices, as in a
    transformer; seeded so every run packs the same bucket."""
    gen = torch.Generator().manual_seed(0)
    return torch.exp(torch.rand(n, generator=gen) * torch.log(torch.tensor(float(max_numel)))).long().tolist()


def make_grads(sizes: list[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, generator=gen).to(dtype=dtype, device=device) for n in sizes]


def unfused_pack(grads: list[torch.Tensor], offsets: list[int], flat: torch.Tensor, scale: float) -> None:
    for g, o in zip(grads, offsets):
        flat[o:o + g.numel()].copy_(g.view(-1) * scale)


def unfused_unpack(flat: torch.Tensor, grads: list[torch.Tensor], offsets: list[int], scale: float) -> None:
    for g, o in zip(grads, offsets):
        g.add_(flat[o:o + g.numel()].view_as(g) * scale)


def time_ms(fns: list[Callable[[], None]], device: torch.device, warmup: int, iters: int
            ) -> list[tuple[float, float]]:
    """(median wall ms, median process CPU ms) of each fn. Runs are interleaved (fn0, fn1, ...,
    fn0, ...) so a change in machine load hits every variant alike; CPU time (all threads) is
    the steadier number on a shared machine, wall time the one that matters on a GPU."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns:
        for _ in range(warmup):
            fn()
    sync()
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for i, fn in enumerate(fns):
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[i].append((time.perf_counter() - start_wall) * 1e3)
            cpu[i].append((time.process_time() - start_cpu) * 1e3)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu)]


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def bench_device(device: torch.device, args: argparse.Namespace) -> list[dict]:
    grad_dtype, bucket_dtype = getattr(torch, args.grad_dtype), getattr(torch, args.bucket_dtype)
    grads = make_grads(grad_sizes(args.tensors, args.max_numel), grad_dtype, device)
    offsets = bucket_offsets(grads)
    flat = torch.empty(offsets[-1], dtype=bucket_dtype, device=device)
    scale = 1.0 / args.world
    impls = ["torch"]
    if device.type == "cuda" and _dispatch.triton_importable() and not _dispatch.interpret_requested():
        impls.append("triton")
    cases = [("pack", "unfused", lambda: unfused_pack(grads, offsets, flat, scale))]
    cases += [("pack", impl, lambda impl=impl: pack(grads, out=flat, scale=scale, impl=impl)) for impl in impls]
    cases += [("unpack+=", "unfused", lambda: unfused_unpack(flat, grads, offsets, scale))]
    cases += [("unpack+=", impl, lambda impl=impl: unpack(flat, grads, scale=scale, accumulate=True, impl=impl))
              for impl in impls]
    rows, baseline = [], {}
    timings = time_ms([fn for _, _, fn in cases], device, args.warmup, args.iters)
    for (op, impl, _), (ms, cpu_ms) in zip(cases, timings):
        baseline.setdefault(op, ms)  # the unfused variant comes first
        path = {"unfused": "torch, per tensor", "torch": "torch fallback (foreach)",
                "triton": "triton (compiled)"}[impl]
        rows.append({"device": device.type, "op": op, "impl": impl, "path": path, "ms": ms, "cpu_ms": cpu_ms,
                     "speedup": baseline[op] / ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200, help="gradients per bucket")
    parser.add_argument("--max-numel", type=int, default=1 << 18, help="largest gradient (elements)")
    parser.add_argument("--grad-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--bucket-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--world", type=int, default=8, help="scale = 1 / world (a gradient average)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cpu, and cuda too when present")
    args = parser.parse_args()

    devices = [torch.device("cpu")] if args.device in ("auto", "cpu") else []
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        devices.append(torch.device("cuda"))
    numel = sum(grad_sizes(args.tensors, args.max_numel))
    print(f"{args.tensors} {args.grad_dtype} gradients, {numel:,} elements -> {args.bucket_dtype} bucket, "
          f"scale 1/{args.world}; torch threads {torch.get_num_threads()}")
    if not torch.cuda.is_available():
        print("no CUDA device: Triton kernels not timed (the interpreter is for tests only)")
    rows = [row for device in devices for row in bench_device(device, args)]

    print(f"{'device':<7}{'op':<10}{'path':<27}{'ms':>9}{'vs unfused':>12}{'cpu ms':>9}")
    for r in rows:
        print(f"{r['device']:<7}{r['op']:<10}{r['path']:<27}{r['ms']:>9.2f}{r['speedup']:>11.2f}x"
              f"{r['cpu_ms']:>9.2f}")
    triton_version = None
    if _dispatch.triton_importable():
        import triton

        triton_version = triton.__version__
    print(json.dumps({
        "benchmark": "kernels", "torch": torch.__version__, "triton": triton_version,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "git": git_sha(), "tensors": args.tensors, "numel": numel, "grad_dtype": args.grad_dtype,
        "bucket_dtype": args.bucket_dtype,
        "ms": {f"{r['device']}/{r['op']}/{r['impl']}": round(r["ms"], 3) for r in rows},
        "cpu_ms": {f"{r['device']}/{r['op']}/{r['impl']}": round(r["cpu_ms"], 3) for r in rows},
    }))


if __name__ == "__main__":
    main()
