"""Step time of autopar's generated module vs hand-written DTensor tensor parallelism vs DDP, in one run.

    python -m benchmarks.step_time                        # GPT-2 tiny, 4 gloo ranks, mesh (2, 2)
    python -m benchmarks.step_time --model llama --size tiny --batch 16 --seq 64 --steps 10

Four forked gloo ranks (one thread each) run, one system after the other, the same
model (same init) on the same global batch:
- autopar: `autopar.parallelize` on the (world/tp, tp) mesh with the solver's plan;
- tp: the Megatron plan on the same mesh written by hand with `parallelize_module`
  (`benchmarks/baselines/tensor_parallel.py`), data parallel over the outer axis;
- ddp: `DistributedDataParallel` over all ranks.
Timing is `benchmarks/baselines/measure.py`: warm-up, then the slowest rank's step
(forward, backward, gradient sync, AdamW) between barriers, median over steps.
The table gives each system's step time and its ratio to autopar; the autopar row
also says what the solver chose (parameters sharded over the tp axis, ZeRO, recompute),
so one can see whether the plans coincide. One JSON line follows.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from autopar.api import parallelize
from autopar.profiler.measure import make_optimizer
from autopar.runtime.launch import run_ranks
from autopar.solver.spec import Shard
from autopar.tracer import split_sample_input

from benchmarks._common import load_example, provenance_line
from benchmarks.baselines.measure import measure_training
from benchmarks.baselines.systems import build_system


def _autopar_system(model, batch, mesh_shape: tuple[int, ...]):
    pm = parallelize(model, batch, mesh_shape)
    local = pm.local_batch(batch)  # this rank's rows of the global batch (the plan-independent convention)
    args, kwargs = split_sample_input(local)
    tp_axis = len(mesh_shape) - 1
    summary = {
        "tp_sharded_params": sum(isinstance(d.use.placements[tp_axis], Shard) for d in pm.plan.params) if len(mesh_shape) > 1 else 0,
        "zero_params": sum(d.zero for d in pm.plan.params),
        "recomputed_nodes": len(pm.plan.recomputed()),
        "params": len(pm.plan.params),
    }

    def step() -> None:
        out = pm(*args, **kwargs)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()

    def live():
        return [*pm.parameters(), *pm.buffers(), *(t for t in tree_leaves(local) if isinstance(t, torch.Tensor))]

    return step, make_optimizer(pm, "adamw"), live, summary


def _bench(rank: int, world_size: int, opts: argparse.Namespace) -> dict:
    zoo = load_example(opts.model)
    model, batch = zoo.build(batch_size=opts.batch, seq_len=opts.seq, size=opts.size, device="cpu", seed=0)
    mesh_shape = (world_size // opts.tp, opts.tp)
    results = {}
    step, opt, live, summary = _autopar_system(model, batch, mesh_shape)
    results["autopar"] = measure_training(step, opt, live, steps=opts.steps, warmup=opts.warmup).step_s
    del step, opt, live
    for name in ("tp", "ddp"):
        system = build_system(name, opts.model, model, batch, tp=opts.tp)
        results[name] = measure_training(system.step, system.optimizer, system.live, steps=opts.steps, warmup=opts.warmup).step_s
        dist.barrier()
    return {"step_s": results, "plan": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama", "bert"), help="zoo families with a hand-written TP plan")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--batch", type=int, default=8, help="global batch (divisible by the data-parallel degree)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--world", type=int, default=4, help="gloo ranks")
    ap.add_argument("--tp", type=int, default=2, help="size of the inner (tensor-parallel) mesh axis")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    opts = ap.parse_args()
    if opts.world % opts.tp:
        raise SystemExit(f"--tp {opts.tp} does not divide --world {opts.world}")

    out = run_ranks(_bench, opts.world, opts, timeout_s=opts.timeout_s)[0]  # times are already max over ranks
    times, plan = out["step_s"], out["plan"]
    mesh = (opts.world // opts.tp, opts.tp)
    print(f"{opts.model}-{opts.size}, batch {opts.batch} x seq {opts.seq}, {opts.world} gloo ranks, mesh {mesh}")
    print(f"{'system':<10}{'step ms':>10}{'vs autopar':>12}")
    for name, t in times.items():
        print(f"{name:<10}{t * 1e3:>10.1f}{t / times['autopar']:>11.2f}x")
    print(f"autopar plan: {plan['tp_sharded_params']}/{plan['params']} params sharded over tp, "
          f"{plan['zero_params']} ZeRO, {plan['recomputed_nodes']} nodes recomputed")
    ratios = {f"{k}_over_autopar": round(v / times["autopar"], 3) for k, v in times.items() if k != "autopar"}
    print(provenance_line("step_time", model=f"{opts.model}-{opts.size}", batch=opts.batch, seq=opts.seq, mesh=list(mesh),
                          step_ms={k: round(v * 1e3, 2) for k, v in times.items()}, **ratios, plan=plan))


if __name__ == "__main__":
    main()
