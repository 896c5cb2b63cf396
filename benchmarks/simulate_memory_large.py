"""Rank 0 of 64-device plans for a mid-size model: its step's peak memory under torch's fake process group,
against the plan's prediction, without 64 GPUs.

    python benchmarks/simulate_memory_large.py                          # GPT-2 medium, 64 and 8x8, two budgets
    python benchmarks/simulate_memory_large.py --size small --meshes 8x8 --budgets-gib 0.5

Each plan is solved for the h100 preset laid out as the mesh, under each budget (ample: the device less its
overheads; and tight ones, where the solver shards and recomputes). `simulate_memory.simulate_step` then
builds rank 0's ParallelModule with the real shard sizes and runs its third step on fake tensors: collectives
return at once, every storage the step makes is counted while it lives (forward, backward, the optimizer's
step). The table gives both peaks and their difference; one JSON line follows.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from autopar.api import capture_copy  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402
from autopar.profiler import profile  # noqa: E402
from autopar.solver import solve  # noqa: E402
from autopar.solver.mesh import make_mesh  # noqa: E402
from autopar.tracer import trace  # noqa: E402
from benchmarks.simulate_memory import simulate_step  # noqa: E402
from examples.gpt2 import build  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="medium", help="GPT-2 size of examples/gpt2.py (medium: 24 layers, 350M)")
    ap.add_argument("--batch", type=int, default=64, help="global batch (rows): one per rank of 64")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--meshes", default="64,8x8", help="comma-separated mesh shapes of 64 devices")
    ap.add_argument("--budgets-gib", default="0,1.0", help="per-device budgets in GiB (0: the preset's default)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, sample = build(batch_size=args.batch, seq_len=args.seq, size=args.size, device="cpu")
    traced = trace(*capture_copy(model, sample, "cpu"))  # as parallelize traces on a CPU mesh
    prof = profile(traced)
    rows = []
    print(f"GPT-2 {args.size}, batch {args.batch} x {args.seq}, rank 0 of 64 (h100 preset), fake tensors")
    print(f"{'mesh':>6} {'budget GiB':>10} {'predicted MB':>12} {'simulated MB':>12} {'pred/sim':>8}  plan")
    for text in args.meshes.split(","):
        shape = tuple(int(n) for n in text.split("x"))
        for budget_gib in (float(b) for b in args.budgets_gib.split(",")):
            mesh = make_mesh(64, shape, "h100")
            start = time.perf_counter()
            try:
                plan = solve(traced, prof, mesh, memory_budget_bytes=budget_gib * 2**30 or None, time_limit_s=60)
            except InfeasibleError as err:
                print(f"{text:>6} {budget_gib:>10g}  no plan: {str(err).splitlines()[0]}")
                continue
            solve_s = time.perf_counter() - start
            sim = simulate_step(model, sample, plan)
            zero = sum(p.zero for p in plan.params)
            row = {"mesh": text, "budget_gib": budget_gib, "predicted_bytes": plan.memory.total_bytes,
                   "simulated_bytes": sim.peak_bytes, "ratio": plan.memory.total_bytes / sim.peak_bytes,
                   "recomputed_nodes": len(plan.recomputed()), "zero_params": zero, "solve_s": solve_s}
            rows.append(row)
            print(f"{text:>6} {budget_gib:>10g} {row['predicted_bytes'] / 1e6:>12.1f} {row['simulated_bytes'] / 1e6:>12.1f} "
                  f"{row['ratio']:>8.3f}  {row['recomputed_nodes']} nodes recomputed, {zero} params ZeRO", flush=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    print(json.dumps({"torch": torch.__version__, "device": "cpu (fake tensors)", "git": sha, "size": args.size,
                      "batch": args.batch, "seq": args.seq, "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
