"""What comparing replicated parameters across ranks costs (`runtime.drift`), against a training step.

    python -m benchmarks.drift_check                       # gpt2 tiny, 2 gloo ranks, the solver's plan
    python -m benchmarks.drift_check --model llama --ranks 4 --steps 20

Forked gloo ranks (one thread each) train the model under `autopar.parallelize`'s plan; after
a warm-up, the median of `--steps` steps (forward, backward, AdamW) and of as many checks
(`check_replicas` over every parameter, what `ParallelModule` runs every `drift_check_every`
steps and before each save), each timed between barriers on the slowest rank. The table gives
both and the check's cost as a fraction of one step and of `drift_check_every` (default 100)
steps. One JSON line follows.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from autopar.api import parallelize
from autopar.runtime.drift import check_replicas
from autopar.runtime.launch import run_ranks
from autopar.tracer import split_sample_input

from benchmarks._common import load_example, provenance_line

EVERY = 100  # ParallelModule's default drift_check_every


def _timed(fn) -> float:
    """Seconds `fn` took on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _bench(rank: int, world: int, opts: argparse.Namespace) -> dict:
    model, batch = load_example(opts.model).build(batch_size=opts.batch, seq_len=opts.seq, size=opts.size, device="cpu")
    pm = parallelize(model, batch, (world,), drift_check_every=0)  # only the timed checks below
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    args, kwargs = split_sample_input(pm.local_batch(batch))

    def step() -> None:
        opt.zero_grad()
        out = pm(*args, **kwargs)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
        opt.step()

    def check() -> None:
        check_replicas(pm.named_parameters(), pm.param_storage(), pm.mesh, "in the benchmark", 0)

    for _ in range(3):
        step()
        check()
    steps = [_timed(step) for _ in range(opts.steps)]
    checks = [_timed(check) for _ in range(opts.steps)]
    replicated = sum(1 for _ in pm.named_parameters())
    return {"step_s": statistics.median(steps), "check_s": statistics.median(checks), "params": replicated,
            "numel": sum(p.numel() for p in pm.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    opts = ap.parse_args()
    r = run_ranks(_bench, opts.ranks, opts, timeout_s=600)[0]
    print(f"{'model':12} {'ranks':>5} {'params':>6} {'elements':>9} {'step':>9} {'check':>9} {'check/step':>10} "
          f"{'per ' + str(EVERY) + ' steps':>14}")
    print(f"{opts.model + '-' + opts.size:12} {opts.ranks:5d} {r['params']:6d} {r['numel']:9d} {r['step_s'] * 1e3:7.1f}ms "
          f"{r['check_s'] * 1e3:7.2f}ms {r['check_s'] / r['step_s']:10.3f} {r['check_s'] / (EVERY * r['step_s']):14.5f}")
    print(provenance_line("drift_check", model=opts.model, size=opts.size, ranks=opts.ranks, **r))


if __name__ == "__main__":
    main()
