"""Fused vs unfused packing of the buckets a bf16 training step fills (kernels.pack / kernels.unpack).

    python benchmarks/kernel_fusion.py                              # GPT-2 small, bf16 on float32 masters, CPU
    python benchmarks/kernel_fusion.py --reduce-dtype bfloat16 --device cuda

A `parallelize` step of GPT-2 under `MixedPrecision(torch.bfloat16, reduce_dtype)` on a world of one rank is
watched where the runtime calls the kernels, and each call's tensors are kept: the compute copies made from the
float32 masters (`runtime.compute_copies`), each gradient bucket packed from the copies' bf16 gradients into the
reduce dtype, and each summed bucket unpacked into the masters' float32 gradients (`runtime.grad_sync`). Those
exact tensors are then packed and unpacked again, timed: fused, the one call the runtime makes (the torch
fallback on CPU, Triton on CUDA); unfused, what a runtime without the kernels writes, a cast and copy (or add)
per tensor. Warm-up, then the median over --iters runs, interleaved; ratios against unfused in the same run.
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

import autopar  # noqa: E402
from autopar.model_file import load_model_file  # noqa: E402
from autopar.runtime import compute_copies, grad_sync, master_grads  # noqa: E402
from autopar.runtime.launch import run_ranks  # noqa: E402
from kernels import _dispatch, bucket_offsets, pack, unpack  # noqa: E402


def captured_calls(args: argparse.Namespace, device: torch.device) -> list[tuple[str, list[torch.Tensor], torch.Tensor]]:
    """(what, tensors, bucket) of every pack and unpack one training step makes, as the runtime made them."""
    calls: list[tuple[str, list[torch.Tensor], torch.Tensor]] = []

    def watch(module, name: str, what: str) -> None:
        fn = getattr(module, name)

        def watched(*a, **kw):
            out = fn(*a, **kw)
            tensors, bucket = (a[0], out if out is not None else kw["out"]) if name == "pack" else (a[1], a[0])
            calls.append((what, [t.detach().clone() for t in tensors], bucket.detach().clone()))
            return out

        setattr(module, name, watched)

    watch(compute_copies, "pack", "copies from masters")
    watch(grad_sync, "pack", "bucket from grads")
    watch(master_grads, "unpack", "bucket into masters")
    model, sample = load_model_file(str(ROOT / "examples" / "gpt2.py"), batch_size=args.batch_size, seq_len=args.seq_len,
                                    size=args.size, device=str(device))
    policy = autopar.MixedPrecision(torch.bfloat16, getattr(torch, args.reduce_dtype))
    pm = autopar.parallelize(model, sample, (1,), mixed_precision=policy, hardware="cpu" if device.type == "cpu" else None)
    pm(**sample).backward()
    return calls


def unfused(what: str, tensors: list[torch.Tensor], bucket: torch.Tensor) -> Callable[[], None]:
    """The same data movement, a cast and copy (or add) per tensor."""
    offsets = bucket_offsets(tensors)
    if what == "bucket into masters":
        return lambda: [t.add_(bucket[o:o + t.numel()].view_as(t).to(t.dtype)) for t, o in zip(tensors, offsets)]
    return lambda: [bucket[o:o + t.numel()].copy_(t.view(-1)) for t, o in zip(tensors, offsets)]


def fused(what: str, tensors: list[torch.Tensor], bucket: torch.Tensor) -> Callable[[], None]:
    """The runtime's call: one pack (copies, buckets) or one unpack adding into the masters' gradients."""
    if what == "bucket into masters":
        return lambda: unpack(bucket, tensors, accumulate=True)
    return lambda: pack(tensors, out=bucket)


def time_ms(fns: list[Callable[[], None]], device: torch.device, warmup: int, iters: int) -> list[tuple[float, float]]:
    """(median wall ms, median process CPU ms) of each fn, interleaved so a change in machine load hits each alike;
    CPU time (all threads) is the steadier number on a shared machine, wall time the one that matters on a GPU."""
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


def bench(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    rows = []
    for what, tensors, bucket in captured_calls(args, device):
        (base_ms, base_cpu), (ms, cpu_ms) = time_ms([unfused(what, tensors, bucket), fused(what, tensors, bucket)],
                                                    device, args.warmup, args.iters)
        path = "triton" if _dispatch.use_triton("auto", [bucket, *tensors], "bench") else "torch fallback"
        rows.append({"what": what, "tensors": len(tensors), "numel": bucket.numel(),
                     "from": str(tensors[0].dtype)[6:], "to": str(bucket.dtype)[6:], "path": path,
                     "unfused_ms": base_ms, "fused_ms": ms, "speedup": base_ms / ms,
                     "unfused_cpu_ms": base_cpu, "fused_cpu_ms": cpu_ms})
    return rows


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="examples/gpt2.py size (tiny, small, medium, ...)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--reduce-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    args = parser.parse_args()

    rows = run_ranks(bench, 1, args, timeout_s=1800, backend="gloo" if args.device == "cpu" else "nccl")[0]
    print(f"GPT-2 {args.size}, batch {args.batch_size} x {args.seq_len}, bf16 on float32 masters, gradients summed in "
          f"{args.reduce_dtype}; torch threads {torch.get_num_threads()}")
    print(f"{'call':<22}{'tensors':>8}{'elements':>12}{'cast':>18}  {'path':<16}{'unfused ms':>11}{'fused ms':>10}"
          f"{'speedup':>9}{'cpu ms (u/f)':>16}")
    for r in rows:
        cast = f"{r['from']}->{r['to']}"
        print(f"{r['what']:<22}{r['tensors']:>8}{r['numel']:>12,}{cast:>18}  {r['path']:<16}{r['unfused_ms']:>11.2f}"
              f"{r['fused_ms']:>10.2f}{r['speedup']:>8.2f}x{r['unfused_cpu_ms']:>8.1f}/{r['fused_cpu_ms']:<7.1f}")
    print(json.dumps({
        "benchmark": "kernel_fusion", "torch": torch.__version__, "git": git_sha(), "model": f"gpt2-{args.size}",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "reduce_dtype": args.reduce_dtype,
        "rows": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
    }))


if __name__ == "__main__":
    main()
