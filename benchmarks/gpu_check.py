"""What autopar does on one CUDA GPU, stage by stage, each stage one JSON line on stdout.

    python benchmarks/gpu_check.py                 # a one-GPU machine (H100 or H200): every stage, ~9 minutes at most
    python benchmarks/gpu_check.py --cpu           # the same stages on CPU, small (CI: tests/test_gpu_check.py)
    python benchmarks/gpu_check.py --stage kernels # one stage

Every stage runs in a subprocess of its own with its own timeout, so a stage that fails or hangs prints a
line with "ok": false and its error, and the next stage runs. The parent never touches CUDA: each stage's
process is fresh, so `run_ranks` may fork there. Stages:

  versions       Python, torch, Triton, transformers, the device; fails fast on a torch or Triton outside
                 `autopar.compat.SUPPORTED_TORCH` / `SUPPORTED_TRITON`, naming this machine's versions. On a
                 GPU, `pip install --no-deps -e .` (the image's packages stand in for the pins; the stages
                 import the repository directly if that fails).
  kernels        every Triton kernel against its torch fallback, bit for bit (compiled on CUDA; the
                 interpreter on CPU).
  world_of_one   a world of one rank (NCCL on a GPU): every collective autopar issues, GradSync, and
                 `parallelize` of GPT-2 on (1,) against eager (loss, gradients), then per precision (fp32,
                 TF32, bf16) the measured step time and peak memory against the plan's prediction.
  fake_world     rank 0 of an 8-device plan under torch's fake process group: its measured step time and
                 peak memory against the plan (collectives do nothing, shard sizes are real).
  gloo_shared    two gloo ranks sharing the device: a data-parallel plan and random plans against one device.
  train_example  `examples/train.py` under torchrun on one rank, saving a checkpoint and resuming from it.
  offload        GPT-2 medium (tiny on CPU) under bf16 with every parameter on the host tier (ZeRO-Offload's
                 layout: `docs/guide/offload.md`), a world of one: the loss against the same run without offload,
                 the measured step and peak (`torch.cuda.max_memory_allocated`) against the plan's.

What one GPU cannot show: NCCL refuses two ranks on one GPU, and a world of one emits no collective (autopar
lowers a one-device plan without any), so collective timings and overlap need two GPUs or more; the gloo
stage runs real collectives, through host memory.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# 560 s in all: every stage fits one 10-minute device call even if each runs to its limit (on CPU, idle, each
# takes under 15 s; on a GPU the first CUDA context and Triton's compiles are the slow part)
STAGE_TIMEOUT_S = {"versions": 50, "kernels": 60, "world_of_one": 140, "fake_world": 80, "gloo_shared": 80,
                   "train_example": 80, "offload": 70}


def _limit_s(stage: str) -> float:
    """The stage's timeout, scaled as the driver was told (`--timeout-scale`), for the waits inside it."""
    return STAGE_TIMEOUT_S[stage] * float(os.environ.get("GPU_CHECK_TIMEOUT_SCALE", "1"))


def _device(cpu: bool):
    import torch
    return torch.device("cpu" if cpu else "cuda", None if cpu else 0)


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ------------------------------------------------------------------------------------------------ stages
def stage_versions(cpu: bool) -> dict:
    import platform

    import torch
    from autopar.compat import check_torch, check_triton
    from autopar.errors import AutoparError

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    if not cpu:
        props = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(0), capability=f"{props.major}.{props.minor}",
                   memory_bytes=props.total_memory, cuda=torch.version.cuda)
        free_before, total = torch.cuda.mem_get_info(0)  # the context exists now: what it took, beside the allocator
        out["context_bytes"] = total - free_before - torch.cuda.memory_reserved(0)
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
                             capture_output=True, text=True, timeout=30)
        out["pip_install"] = "ok" if pip.returncode == 0 else pip.stderr.strip().splitlines()[-1:]
    try:  # first thing after the versions are known: the other stages would only fail on an unsupported release
        check_torch()
        if out["triton"] is not None:  # (without Triton the kernels stage says so)
            check_triton(out["triton"])
    except AutoparError as err:
        raise AutoparError(f"{err}. This machine: {json.dumps(out)}") from None
    return out


def stage_kernels(cpu: bool) -> dict:
    import torch
    import kernels

    device = _device(cpu)
    gen = torch.Generator().manual_seed(0)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        grads = [torch.randn(s, generator=gen).to(device, dtype) for s in ((7, 5), (64,), (3, 4, 5))]

        def same(name: str, run: Callable[[str], Any]) -> None:
            got, want = run("triton"), run("torch")
            got, want = (got if isinstance(got, (list, tuple)) else [got]), (want if isinstance(want, (list, tuple)) else [want])
            results[f"{name}/{str(dtype)[6:]}"] = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

        same("pack", lambda impl: kernels.pack(grads, scale=0.5, dtype=torch.float32, impl=impl))
        bucket = kernels.pack(grads, impl="torch")
        same("unpack", lambda impl: [t for t in _unpacked(bucket, grads, impl)])
        x = torch.randn(6, 8, 4, generator=gen).to(device, dtype)
        same("chunk_to_leading", lambda impl: kernels.chunk_to_leading(x, 1, 2, impl=impl))
        buf = kernels.chunk_to_leading(x, 1, 2, impl="torch")
        same("leading_to_dim", lambda impl: kernels.leading_to_dim(buf, 1, 2, x.shape, impl=impl))
    failed = sorted(k for k, ok in results.items() if not ok)
    if failed:
        raise AssertionError(f"Triton and torch differ on {failed}")
    return {"bit_exact": sorted(results)}


def _unpacked(bucket, like, impl: str):
    import torch
    outs = [torch.zeros_like(t) for t in like]
    import kernels
    kernels.unpack(bucket, outs, scale=2.0, accumulate=False, impl=impl)
    return outs


def _gpt2(cpu: bool, device, dtype=None):
    from examples.gpt2 import build
    size, batch, seq = ("tiny", 8, 32) if cpu else ("small", 8, 512)  # a batch every rank of 8 gets a row of
    model, sample = build(batch_size=batch, seq_len=seq, size=size, device="cpu")
    model = model.to(device, dtype) if dtype is not None else model.to(device)
    return model, {k: v.to(device) for k, v in sample.items()}


def _measured_steps(module, sample, optimizer, device, steps: int) -> tuple[float, float]:
    """Seconds per step (forward, backward, optimizer step) after one warm-up step, which makes the state, and
    the steps' peak memory: `torch.cuda.max_memory_allocated` since `_reset_peak`, or on CPU the live tensor
    storage of one more step (`LiveStorageTracker`: parameters, optimizer state and batch count throughout)."""
    import torch
    from torch.utils import _pytree as pytree

    from autopar.profiler.measure import LiveStorageTracker

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        module(**sample).backward()
        optimizer.step()

    for i in range(steps + 1):
        if i == 1:
            _sync(device)
            start = time.perf_counter()
        step()
    _sync(device)
    step_s = (time.perf_counter() - start) / steps
    if device.type == "cuda":
        return step_s, float(torch.cuda.max_memory_allocated(device))
    optimizer.zero_grad(set_to_none=True)
    state = [t for s in optimizer.state.values() for t in pytree.tree_leaves(s) if isinstance(t, torch.Tensor)]
    with LiveStorageTracker([*module.parameters(), *module.buffers(), *state, *sample.values()]) as tracker:
        step()
    return step_s, float(tracker.peak_bytes)


def _world_of_one(rank: int, world: int, cpu: bool) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    import autopar
    from autopar.runtime import comm
    from autopar.runtime.grad_sync import GradSync

    device = _device(cpu)
    group = dist.group.WORLD.group_name
    x = torch.arange(12.0, device=device)
    collectives = {"all_reduce": comm.all_reduce(x, group), "all_gather": comm.all_gather(x, group),
                   "reduce_scatter": comm.reduce_scatter(x, group), "all_to_all": comm.all_to_all(x, group)}
    out: dict[str, Any] = {"collectives": sorted(k for k, y in collectives.items() if torch.equal(y, x))}
    layer = torch.nn.Linear(8, 4).to(device)
    sync = GradSync([(n, p, (group,)) for n, p in layer.named_parameters()])
    layer(torch.ones(2, 8, device=device)).sum().backward()
    out["grad_sync"] = bool(torch.equal(layer.bias.grad, torch.full((4,), 2.0, device=device)))
    out["grad_sync_buckets"] = sync.num_buckets

    torch.manual_seed(0)
    model, sample = _gpt2(cpu, device)
    eager = copy.deepcopy(model)
    pm = autopar.parallelize(model, sample, (1,))
    loss, want = pm(**sample), eager(**sample)
    loss.backward()
    want.backward()
    grads = dict(pm.named_parameters())
    worst = max((grads[n].grad - p.grad).abs().max().item() for n, p in eager.named_parameters() if p.grad is not None)
    out["loss_error"] = abs(loss.item() - want.item()) / abs(want.item())
    out["grad_max_abs_error"] = worst
    del pm, eager, model, grads
    precisions = {"fp32": (None, "highest")} if cpu else {"fp32": (None, "highest"), "tf32": (None, "high"),
                                                          "bf16": (torch.bfloat16, "highest")}
    for name, (dtype, matmul) in precisions.items():
        torch.set_float32_matmul_precision(matmul)
        _reset_peak(device)
        model, sample = _gpt2(cpu, device, dtype)
        pm = autopar.parallelize(model, sample, (1,))
        del model
        _reset_peak(device)  # the step's peak, not parallelize's
        step_s, peak = _measured_steps(pm, sample, torch.optim.AdamW(pm.parameters(), lr=1e-4), device, 3 if cpu else 10)
        out[name] = {"plan_precision": pm.plan.mesh.precision, "step_ms": step_s * 1e3,
                     "predicted_step_ms": pm.plan.time.total_s * 1e3, "peak_bytes": peak,
                     "predicted_peak_bytes": pm.plan.memory.total_bytes}
        del pm
    torch.set_float32_matmul_precision("highest")
    if out["loss_error"] > 1e-4 or len(out["collectives"]) < 4 or not out["grad_sync"]:
        raise AssertionError(f"a world of one differs from eager: {out}")
    return out


def stage_world_of_one(cpu: bool) -> dict:
    from autopar.runtime.launch import run_ranks
    return run_ranks(_world_of_one, 1, cpu, timeout_s=_limit_s("world_of_one") - 10,
                     backend="gloo" if cpu else "nccl")[0]


def stage_fake_world(cpu: bool) -> dict:
    """Rank 0 of 8 under the fake process group (`torch.testing._internal.distributed.fake_pg`): collectives
    return at once, so the step's compute and memory are rank 0's alone."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar
    from autopar.solver.mesh import default_axis_names

    device = _device(cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    out = {}
    for shape in ((8,),) if cpu else ((8,), (2, 4)):
        torch.manual_seed(0)
        model, sample = _gpt2(cpu, device)
        # the fake backend names no device: the mesh says where the shards live
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=default_axis_names(len(shape)))
        pm = autopar.parallelize(model, sample, mesh)
        del model
        _reset_peak(device)
        step_s, peak = _measured_steps(pm, pm.local_batch(sample), torch.optim.AdamW(pm.parameters(), lr=1e-4), device,
                                       2 if cpu else 5)
        out["x".join(map(str, shape))] = {"step_ms": step_s * 1e3, "predicted_compute_ms": pm.plan.time.compute_s * 1e3,
                                          "peak_bytes": peak, "predicted_peak_bytes": pm.plan.memory.total_bytes}
        del pm
    dist.destroy_process_group()
    return out


def _gloo_shared(rank: int, world: int, cpu: bool, plans: int) -> dict:
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.api import capture_copy
    from autopar.solver.plan_io import with_fingerprint
    from autopar.tracer import trace
    from tests.codegen.plans import cpu_mesh, random_plan

    device = _device(cpu)
    mesh = init_device_mesh(device.type, (2,), mesh_dim_names=("dp",))
    from examples.gpt2 import build
    model, sample = build(batch_size=4, seq_len=16, size="tiny", device="cpu")
    traced = trace(*capture_copy(model, sample, "cpu" if cpu else "meta"))  # as parallelize traces for this mesh
    rng, planned = random.Random(0), cpu_mesh((2,))
    candidates = [None] + [with_fingerprint(random_plan(traced, planned, rng), traced, planned, None) for _ in range(plans)]
    out = {}
    for i, plan in enumerate(candidates):
        torch.manual_seed(0)
        model, sample = build(batch_size=4, seq_len=16, size="tiny", device="cpu")
        model, sample = model.to(device), {k: v.to(device) for k, v in sample.items()}
        eager = copy.deepcopy(model)
        pm = autopar.parallelize(model, sample, mesh, plan=plan)
        opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=1e-3), torch.optim.AdamW(eager.parameters(), lr=1e-3)
        loss = pm(**pm.local_batch(sample))
        want = eager(**sample)
        loss.backward(), want.backward(), opt.step(), ref_opt.step()
        full = pm.state_dict()
        error = max((full[n].to(device) - p.detach()).abs().max().item() for n, p in eager.named_parameters())
        out["solver" if plan is None else f"random{i}"] = {"loss_error": abs(loss.item() - want.item()), "param_error": error}
    return out


def stage_gloo_shared(cpu: bool) -> dict:
    from autopar.runtime.launch import run_ranks
    out = run_ranks(_gloo_shared, 2, cpu, 1 if cpu else 3, timeout_s=_limit_s("gloo_shared") - 10)[0]
    bad = {k: v for k, v in out.items() if v["loss_error"] > 1e-4 or v["param_error"] > 1e-4}
    if bad:
        raise AssertionError(f"plans differ from one device: {bad}")
    return {"plans": out}  # nested: the stage's line also carries "stage", "ok" and "seconds"


def stage_train_example(cpu: bool) -> dict:
    import tempfile
    with tempfile.TemporaryDirectory() as ckpt:
        runs = []
        for steps in (1, 2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                   str(ROOT / "examples" / "train.py"), "--steps", str(steps), "--checkpoint", ckpt, "--seq-len", "16"]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=_limit_s("train_example") / 2 - 5,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            if run.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd[3:])} exited {run.returncode}: {run.stderr.strip()[-800:]}")
            runs.append(run.stdout)
    losses = [[line.split()[3] for line in r.splitlines() if line.startswith("step")] for r in runs]
    resumed = "resumed from" in runs[1]
    if not resumed or len(losses[1]) != 1:
        raise AssertionError(f"the second run did not resume at step 1: {runs[1][-400:]}")
    return {"first_losses": losses[0], "resumed_losses": losses[1]}


def _offloaded_step(rank: int, world: int, cpu: bool) -> dict:
    import torch

    import autopar
    from examples.gpt2 import build

    device = _device(cpu)
    size, batch, seq = ("tiny", 4, 32) if cpu else ("medium", 4, 1024)
    policy = autopar.MixedPrecision(torch.bfloat16)
    out: dict[str, Any] = {}
    for tier in ("device", "host"):
        torch.manual_seed(0)
        model, sample = build(batch_size=batch, seq_len=seq, size=size, device="cpu")
        model, sample = model.to(device), {k: v.to(device) for k, v in sample.items()}
        _reset_peak(device)
        pm = autopar.parallelize(model, sample, (1,), mixed_precision=policy, time_limit_s=2 if cpu else 10,
                                 offload="optimizer" if tier == "host" else None)
        del model
        _reset_peak(device)  # the step's peak, not parallelize's
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        loss = pm(**sample).item()
        step_s, peak = _measured_steps(pm, sample, opt, device, 1 if cpu else 5)
        m = pm.plan.memory
        out[tier] = {"first_loss": loss, "step_ms": step_s * 1e3, "predicted_step_ms": pm.plan.time.total_s * 1e3,
                     "peak_bytes": peak, "predicted_peak_bytes": m.total_bytes, "host_bytes": m.host_bytes,
                     "hosted": len(pm.plan.offloaded())}
        del pm, opt
    if abs(out["host"]["first_loss"] - out["device"]["first_loss"]) > 1e-3 * abs(out["device"]["first_loss"]):
        raise AssertionError(f"the offloaded step's loss differs from the device's: {out}")
    return out


def stage_offload(cpu: bool) -> dict:
    from autopar.runtime.launch import run_ranks
    return run_ranks(_offloaded_step, 1, cpu, timeout_s=_limit_s("offload") - 10, backend="gloo" if cpu else "nccl")[0]


STAGES: dict[str, Callable[[bool], dict]] = {
    "versions": stage_versions, "kernels": stage_kernels, "world_of_one": stage_world_of_one,
    "fake_world": stage_fake_world, "gloo_shared": stage_gloo_shared, "train_example": stage_train_example,
    "offload": stage_offload,
}


# ------------------------------------------------------------------------------------------------ driver
def run_stage(name: str, cpu: bool) -> dict:
    """In this process: the stage's JSON line (its error in it, if it raised)."""
    start = time.perf_counter()
    try:
        result = {"stage": name, "ok": True, **STAGES[name](cpu)}
    except BaseException as err:  # noqa: BLE001 -- reported on the stage's line; the driver goes on
        result = {"stage": name, "ok": False, "error": f"{type(err).__name__}: {err}"[:2000],
                  "where": traceback.format_exc().strip().splitlines()[-3:]}
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def run_all(names: list[str], cpu: bool, scale: float) -> list[dict]:
    """Each stage in a fresh subprocess under its timeout; one JSON line per stage as it ends."""
    lines = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", "GPU_CHECK_TIMEOUT_SCALE": str(scale)}
    if cpu:
        env["TRITON_INTERPRET"] = "1"  # the kernels stage runs Triton's interpreter on CPU tensors
    for name in names:
        if lines and lines[0]["stage"] == "versions" and not lines[0]["ok"]:
            break  # an unsupported torch or no device: the other stages would only fail the same way
        timeout_s = STAGE_TIMEOUT_S[name] * scale
        cmd = [sys.executable, __file__, "--stage", name] + (["--cpu"] if cpu else [])
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
            found = [line for line in run.stdout.splitlines() if line.startswith('{"stage"')]
            line = json.loads(found[-1]) if found else {
                "stage": name, "ok": False, "error": f"exited {run.returncode} without a result: {run.stderr.strip()[-1500:]}"}
        except subprocess.TimeoutExpired:
            line = {"stage": name, "ok": False, "error": f"timed out after {timeout_s:.0f} s"}
        print(json.dumps(line), flush=True)
        lines.append(line)
    print(json.dumps({"summary": {line["stage"]: line["ok"] for line in lines}, "cpu": cpu}), flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the CPU smoke form: small models, gloo, Triton's interpreter")
    ap.add_argument("--stage", choices=sorted(STAGES), action="append", help="run only these stages (default: all)")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every stage's timeout (slow hosts)")
    args = ap.parse_args(argv)
    if args.stage and len(args.stage) == 1 and os.environ.get("_GPU_CHECK_CHILD"):
        print(json.dumps(run_stage(args.stage[0], args.cpu)), flush=True)
        return 0
    os.environ["_GPU_CHECK_CHILD"] = "1"
    lines = run_all(args.stage or list(STAGES), args.cpu, args.timeout_scale)
    return 0 if all(line["ok"] for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
