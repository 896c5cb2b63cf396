"""Is autopar's plan better than what a user would write? Step time and peak memory vs DDP, FSDP2 and Megatron TP.

    python benchmarks/vs_baselines.py --ranks 4 --model gpt2-tiny,llama-tiny,bert-tiny --out vs_baselines.json

On `--ranks` forked gloo ranks (one thread each), calibrate the cost model to the live
process group once (1-D and (ranks/tp, tp) meshes); then, for each model, measure the
training step (forward + backward + AdamW; median of --steps after 2 warm-up steps)
and the peak live-tensor bytes per rank of DDP, FSDP2 (`fully_shard`), Megatron TP +
data parallel, each also with every block checkpointed, and of autopar's plan for a
range of memory budgets: the baselines' predicted memories, from "everything fits
replicated" down to "only the most sharded one fits". A system fits a budget when its
measured peak is within it. Beside them, one reference that is not a baseline: DDP whose
step also returns the global loss (`ddp+loss`), the value autopar's module returns where
DDP returns each rank's own; a miss against DDP is set against it.

Targets (a benchmark, not a test): autopar's step time <= the best baseline that fits,
at every budget; Spearman rank correlation of predicted vs measured step time >= 0.9.
Prints a table per model, writes the raw numbers to --out (JSON) and a PNG plot beside
it when matplotlib is installed, and ends with one JSON provenance line.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this directory comes first on sys.path, and its kernels.py would shadow the
# top-level `kernels` package autopar imports: import benchmark helpers as the `benchmarks` package instead.
if sys.path and Path(sys.path[0]).resolve() == ROOT / "benchmarks":
    sys.path[0] = str(ROOT)

from autopar.runtime.launch import run_ranks  # noqa: E402

from benchmarks._common import provenance_line  # noqa: E402
from benchmarks.baselines.bench import Case, ModelResult, calibrate_all, run_model  # noqa: E402
from benchmarks.baselines.report import (budget_rows, candidates, explain_miss, format_model, plot, ratio_errors,  # noqa: E402
                                         spearman, write_json)
from autopar.solver.robust import ROBUST_MARGIN  # noqa: E402

log = logging.getLogger(__name__)


def run(cases: list[Case], ranks: int, timeout_s: float) -> list[ModelResult]:
    results = []
    calibrations: dict[int, dict] = {}  # by tp degree: one calibration prices every model alike
    for case in cases:
        start = time.perf_counter()
        if case.tp not in calibrations:
            calibrations[case.tp] = run_ranks(calibrate_all, ranks, case.tp, timeout_s=timeout_s)[0]
        result = run_ranks(run_model, ranks, case, calibrations[case.tp], timeout_s=timeout_s)[0]
        log.info("%s-%s measured in %.0f s", case.model, case.size, time.perf_counter() - start)
        results.append(result)
    return results


def summary(results: list[ModelResult]) -> str:
    """Whether the two targets were met, with the budgets that miss the first."""
    misses = [f"{r.case.model} @ {row['budget_bytes'] / 1e6:.2f} MB: {row['ratio']:.2f}x {row['best_baseline']} ({explain_miss(r, row)})"
              for r in results for row in budget_rows(r) if row["ratio"] is not None and row["ratio"] > 1.0]
    pts = [s for r in results for s in candidates(r)]
    rho = spearman([s.predicted_s for s in pts], [s.step_s for s in pts])
    lines = [f"target 1 (autopar <= best fitting baseline at every budget): {'met' if not misses else 'MISSED'}"]
    lines += [f"  {m}" for m in misses]
    lines.append(f"target 2 (spearman >= 0.9 over all {len(pts)} candidates): {rho:.3f} {'met' if rho >= 0.9 else 'MISSED'}")
    errors = sorted(ratio_errors(results))
    if errors:  # what `autopar.solver.robust.ROBUST_MARGIN` is set from
        at = lambda q: math.exp(errors[min(len(errors) - 1, int(q * len(errors)))]) - 1  # noqa: E731
        lines.append(f"ratio error (predicted vs measured ratio of two plans, {len(errors)} pairs): median {at(0.5):.1%}, "
                     f"80th percentile {at(0.8):.1%}; the solver's robust margin: {ROBUST_MARGIN:.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="gloo ranks to fork (4: 1-D mesh of 4 and a 2x2 TP mesh)")
    ap.add_argument("--model", default="gpt2-tiny,llama-tiny,bert-tiny", help="comma list of <zoo file>-<size>")
    ap.add_argument("--batch", type=int, default=8, help="global batch (divisible by --ranks)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length: large enough that activations matter")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree of the Megatron baseline")
    ap.add_argument("--steps", type=int, default=90, help="timed steps per system (median reported: a shared host varies from "
                    "step to step; measured at a 17-22%% spread, 90 left the ratio's 90%% interval +-4-6%%, 30 left +-6-9%%)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per model before the ranks are killed")
    ap.add_argument("--out", type=Path, default=Path("vs_baselines.json"), help="raw numbers (JSON); the plot goes beside it")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cases = []
    for item in args.model.split(","):
        name, _, size = item.strip().partition("-")
        cases.append(Case(name, size or "tiny", args.batch, args.seq, args.tp, args.steps))
    start = time.perf_counter()
    results = run(cases, args.ranks, args.timeout)
    for r in results:
        print(format_model(r))
        print()
    print(summary(results))
    write_json(results, args.out)
    print(f"raw numbers: {args.out}")
    print(plot(results, args.out.with_suffix(".png")))
    pts = [s for r in results for s in candidates(r)]
    print(provenance_line("vs_baselines", ranks=args.ranks, models=args.model, batch=args.batch, seq=args.seq,
                          spearman=spearman([s.predicted_s for s in pts], [s.step_s for s in pts]),
                          wall_s=round(time.perf_counter() - start, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
