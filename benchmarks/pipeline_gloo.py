"""A pipeline plan's measured step on 4 gloo ranks against the cost model's prediction (a sanity check).

    python benchmarks/pipeline.py --gloo

GPT-2 tiny (2 layers, batch 8 x 8 tokens) on 4 CPU processes of one thread each, planned for the `cpu`
preset (gloo over loopback): pp=2 x dp=2 (`parallelize(pp=2)`: the pipeline search picks the cuts,
micro-batches and schedule), and as the baseline of the same run the plan without stages (`pp=None`).
A step is `pm.step(...)` (forward and backward of every micro-batch, the gradient sync) and the
optimizer's step, timed after warm-up steps: each step's slowest rank, the median over steps.
"""
from __future__ import annotations

import statistics
import time

import torch

from _common import load_example
from autopar.api import parallelize
from autopar.pipeline.choose import describe
from autopar.pipeline.plan import PipelinePlan
from autopar.runtime.launch import run_ranks

BATCH, SEQ, WARMUP, STEPS = 8, 8, 3, 20


def _rank(rank: int, world: int, pp: int | None) -> dict:
    torch.set_num_threads(1)
    model, sample = load_example("gpt2").build(BATCH, SEQ, size="tiny", device="cpu")
    pm = parallelize(model, sample, (world,), hardware="cpu", pp=pp, time_limit_s=10)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    batch = pm.local_batch(sample)
    times = []
    for i in range(WARMUP + STEPS):
        began = time.perf_counter()
        opt.zero_grad()
        pm.step(**batch)
        opt.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - began)
    plan = pm.plan
    if isinstance(plan, PipelinePlan):
        return {"times": times, "plan": describe(plan), "predicted_s": plan.time.step_s}
    return {"times": times, "plan": " x ".join(f"{a.name}={a.size}" for a in plan.mesh.axes) + ", no stages",
            "predicted_s": plan.time.total_s}


def measure() -> list[dict]:
    """Per plan (pp=2, then none): its predicted step and the measured one (seconds)."""
    rows = []
    for pp in (2, None):
        ranks = run_ranks(_rank, 4, pp, timeout_s=600)
        steps = [max(r["times"][i] for r in ranks) for i in range(STEPS)]
        rows.append({"plan": ranks[0]["plan"], "predicted_s": ranks[0]["predicted_s"],
                     "measured_s": statistics.median(steps), "measured_min_s": min(steps)})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':10} {'ranks':>5}  {'plan':42} {'predicted ms':>12} {'measured ms':>11} {'measured/predicted':>18}")
    for r in rows:
        print(f"{'gpt2 tiny':10} {4:5d}  {r['plan']:42} {r['predicted_s'] * 1e3:12.3f} {r['measured_s'] * 1e3:11.3f} "
              f"{r['measured_s'] / r['predicted_s']:18.2f}")
    piped, flat = rows
    print(f"pp / no pp: predicted {piped['predicted_s'] / flat['predicted_s']:.2f}, "
          f"measured {piped['measured_s'] / flat['measured_s']:.2f}")
