"""A tied embedding's gradients at the lookup's backward: predicted against measured and simulated peaks.

    python benchmarks/tied_gradient_memory.py

GPT-2 (2 layers, width 128) whose tied embedding dominates (vocabulary 8192: 4 MiB) on 2 gloo ranks, data
parallel, replicated and ZeRO. Measured as `tests/codegen/test_memory.py` measures (real tensors, every storage
tracked): the peak of forward and backward with the gradients zeroed in place, and of a whole step with them set
to None; simulated on fake tensors (`simulate_memory.simulate_step`). The lookup's backward holds the LM head's
gradient of the embedding, its own and their sum (three whole gradients, replicated). The optimizer step's
scratch is priced per tensor (CPU's Adam: twice the largest parameter) and as foreach (CUDA's: once every
parameter): the foreach row shows what the lookup's step adds where the scratch does not hide it; its measured
peak is forward and backward's (no optimizer step in it).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "benchmarks":
    sys.path[0] = str(ROOT)

from autopar.profiler import profile  # noqa: E402
from autopar.runtime.launch import run_ranks  # noqa: E402
from autopar.solver.pinned import fixed_plan  # noqa: E402
from benchmarks.simulate_memory import simulate_step  # noqa: E402
from tests.codegen.harness import trace_model  # noqa: E402
from tests.codegen.plans import cpu_mesh, greedy_plan  # noqa: E402
from tests.codegen.test_memory import _measure  # noqa: E402
from tests.codegen.test_parameter_gradient_memory import _model  # noqa: E402

MIB = 2**20


def main() -> None:
    model, sample = _model()
    traced = trace_model(model, sample)
    mesh, prof = cpu_mesh((2,)), profile(traced)
    dp = {d.node: d.strategy for d in greedy_plan(traced, mesh, {name: "S(0)" for name in traced.input_names}).nodes}
    everything = frozenset(traced.param_fqns.values())
    plans = {"replicated": fixed_plan(traced, prof, mesh, dp), "zero": fixed_plan(traced, prof, mesh, dp, zero_params=everything)}
    foreach = dataclasses.replace(mesh, optimizer_foreach=True)
    priced_foreach = {"replicated": fixed_plan(traced, prof, foreach, dp),
                      "zero": fixed_plan(traced, prof, foreach, dp, zero_params=everything)}
    measured = run_ranks(_measure, 2, model, sample, traced, plans, timeout_s=300)[0]
    print(f"{'plan':11s} {'scratch':8s} {'predicted':>10s} {'temp':>7s} {'measured':>9s} {'ratio':>6s} "
          f"{'set_to_none':>11s} {'ratio':>6s} {'simulated':>9s} {'ratio':>6s}  (MiB, rank 0)")
    for name, plan in plans.items():
        simulated = simulate_step(model, sample, plan).peak_bytes
        r = measured[name]
        for scratch, p in (("per-tensor", plan), ("foreach", priced_foreach[name])):
            m = p.memory
            row = f"{name:11s} {scratch:10s} {m.total_bytes / MIB:8.3f} {m.temp_bytes / MIB:7.3f} {r['peak'] / MIB:9.3f} " \
                  f"{m.total_bytes / r['peak']:6.3f}"
            if scratch == "per-tensor":
                row += f" {r['peak_grads_to_none'] / MIB:11.3f} {m.total_bytes / r['peak_grads_to_none']:6.3f} " \
                       f"{simulated / MIB:9.3f} {m.total_bytes / simulated:6.3f}"
            print(row)


if __name__ == "__main__":
    main()
