"""Tables, rank correlation, JSON and plot of `vs_baselines` results (plain data in, text/files out)."""
from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from pathlib import Path
from typing import Sequence

from benchmarks.baselines.bench import ModelResult, SystemResult

MB = 1e6


def _ranks(xs: Sequence[float]) -> list[float]:
    """Ranks 1..n, ties sharing their average rank (as Spearman's rho needs)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's r of the ranks (nan for fewer than 3 points or constant ranks)."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs equal lengths, got {len(xs)} and {len(ys)}")
    if len(xs) < 3:
        return math.nan
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (sx * sy) if sx and sy else math.nan


def ratio_errors(results: Sequence[ModelResult]) -> list[float]:
    """The cost model's error on the ratio of two plans' step times, over every pair of one model's candidates:
    |log(predicted ratio / measured ratio)| (0: the model ranks them, and by how much, as measured). What the
    solver's robust choice needs (`solver.robust.ROBUST_MARGIN`): how far a predicted gain can be off."""
    errors = []
    for r in results:
        pts = candidates(r)
        errors += [abs(math.log((a.predicted_s / b.predicted_s) / (a.step_s / b.step_s)))
                   for i, a in enumerate(pts) for b in pts[i + 1:]]
    return errors


def candidates(r: ModelResult) -> list[SystemResult]:
    return [*r.baselines, *r.autopar_plans.values()]


def fits(s: SystemResult, budget_bytes: float) -> bool:
    return s.peak_bytes <= budget_bytes


def budget_rows(r: ModelResult) -> list[dict]:
    """Per budget: which baselines fit (measured peak <= budget), the fastest of them, autopar and the ratio."""
    rows = []
    for b in r.budgets:
        fitting = [s for s in r.baselines if fits(s, b.budget_bytes)]
        best = min(fitting, key=lambda s: s.step_s) if fitting else None
        ap = r.autopar_plans.get(b.autopar) if b.autopar else None
        ratio = ap.step_s / best.step_s if ap and best else None
        rows.append({"budget_bytes": b.budget_bytes, "fitting": [s.name for s in fitting],
                     "best_baseline": best.name if best else None, "best_baseline_s": best.step_s if best else None,
                     "autopar": b.autopar, "autopar_s": ap.step_s if ap else None,
                     "autopar_fits": fits(ap, b.budget_bytes) if ap else None, "ratio": ratio,
                     "note": b.solver_note})
    return rows


def spread(s: SystemResult) -> float:
    """Step-to-step spread of a system's timed steps: interquartile range over the median (0 with < 4 steps)."""
    if len(s.steps_s) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(s.steps_s, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(s.steps_s)


def ratio_interval(a: SystemResult, b: SystemResult, level: float = 0.9, resamples: int = 2000) -> tuple[float, float]:
    """A `level` bootstrap interval of median(a's steps) / median(b's steps): each resample draws each system's
    steps with replacement (seeded: the same run gives the same interval). How far the measured ratio could move
    from noise alone: 30 steps with a 20% step-to-step spread leave a median a few percent either way."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(a.steps_s, k=len(a.steps_s)))
                    / statistics.median(rng.choices(b.steps_s, k=len(b.steps_s))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return ratios[int(tail * resamples)], ratios[min(resamples - 1, int((1.0 - tail) * resamples))]


def explain_miss(r: ModelResult, row: dict) -> str:
    """Why a budget row misses target 1, from what the run knows: the step-to-step spread against the gap,
    and whether the cost model ranked the baseline first (then why the solver did not pick its plan)."""
    ap = r.autopar_plans[row["autopar"]]
    best = next(s for s in r.baselines if s.name == row["best_baseline"])
    noise = max(spread(ap), spread(best))
    # like for like: the baselines are priced without the 0-d reshards they do not run
    predicted = (ap.predicted_s - ap.loss_sync_s) / best.predicted_s
    parts = [f"step-to-step spread {noise:.0%}"]
    if len(ap.steps_s) >= 4 and len(best.steps_s) >= 4:
        lo, hi = ratio_interval(ap, best)
        within = "within noise" if lo <= 1.0 else "beyond noise"
        parts.append(f"90% interval of the ratio {lo:.2f}-{hi:.2f}x ({within})")
    if ap.loss_sync_s:
        parts.append(f"0-d reshards the baselines do not run priced {ap.loss_sync_s * 1e3:.2f} ms")
    if abs(predicted - 1.0) < 0.005:
        parts.append(f"the rest priced as {best.name} (the same plan, or as fast): the gap is runtime overhead the model "
                     f"does not price")
    elif predicted < 1.0:
        parts.append(f"the rest priced {predicted:.2f}x {best.name}: the model ranked autopar's plan first, so a cost "
                     f"the model does not price (runtime overhead) or prices low")
    elif best.predicted_bytes > row["budget_bytes"]:
        parts.append(f"the rest priced {predicted:.2f}x, but the memory model puts {best.name} at {best.predicted_bytes / MB:.2f} MB, "
                     f"over the budget (measured {best.peak_bytes / MB:.2f} MB): the solver could not choose that plan")
    else:
        parts.append(f"the rest priced {predicted:.2f}x {best.name}, which fits the budget: the solver missed a faster plan")
    if best.name == "ddp":
        parts += [_against_global_loss_ddp(ap, ref) for ref in r.references if ref.name == "ddp+loss"]
    return "; ".join(parts)


def _against_global_loss_ddp(ap: SystemResult, ref: SystemResult) -> str:
    """autopar against DDP returning the global loss, the value autopar returns (DDP returns each rank's own)."""
    text = f"DDP returning the global loss as autopar does (ddp+loss) {ref.step_s * 1e3:.2f} ms, autopar {ap.step_s / ref.step_s:.2f}x of it"
    if len(ap.steps_s) >= 4 and len(ref.steps_s) >= 4:
        lo, hi = ratio_interval(ap, ref)
        text += f" ({lo:.2f}-{hi:.2f}x)"
    return text


def format_model(r: ModelResult) -> str:
    c = r.case
    lines = [f"== {c.model}-{c.size} batch {c.batch} x seq {c.seq}, {c.optimizer}; meshes: "
             + "; ".join(f"{k}: {v}" for k, v in r.meshes.items())]
    lines.append(f"{'system':<12} {'mesh':>5} {'pred ms':>8} {'meas ms':>8} {'pred MB':>8} {'peak MB':>8}")
    for s in (*candidates(r), *r.references):
        lines.append(f"{s.name:<12} {'x'.join(map(str, s.mesh)):>5} {s.predicted_s * 1e3:8.2f} {s.step_s * 1e3:8.2f} "
                     f"{s.predicted_bytes / MB:8.2f} {s.peak_bytes / MB:8.2f}")
    names = [s.name for s in r.baselines]
    lines.append("")
    lines.append(f"{'budget MB':>9} " + " ".join(f"{n:>8}" for n in names)
                 + f" {'autopar':>14} {'best fit':>16} {'ratio':>6}")
    for b, row in zip(r.budgets, budget_rows(r)):
        cells = [f"{s.step_s * 1e3:8.2f}" if fits(s, b.budget_bytes) else f"{'over':>8}" for s in r.baselines]
        if row["autopar"]:
            ap = r.autopar_plans[row["autopar"]]
            mark = "" if row["autopar_fits"] else "!"  # measured peak above the budget
            ap_cell = f"{ap.step_s * 1e3:.2f}{mark} ({row['autopar'].split('#')[1]})"
        else:
            ap_cell = "no plan"
        best = f"{row['best_baseline']} {row['best_baseline_s'] * 1e3:.2f}" if row["best_baseline"] else "none fits"
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        lines.append(f"{b.budget_bytes / MB:9.2f} " + " ".join(cells) + f" {ap_cell:>14} {best:>16} {ratio:>6}")
    if r.references:
        lines.append("ddp+loss: DDP whose step also returns the global loss, as autopar's does (a reference, not a baseline)")
    pts = candidates(r)
    lines.append(f"spearman(predicted, measured step time) over {len(pts)} candidates: "
                 f"{spearman([s.predicted_s for s in pts], [s.step_s for s in pts]):.3f}")
    return "\n".join(lines)


def to_json(results: Sequence[ModelResult]) -> dict:
    pts = [s for r in results for s in candidates(r)]
    return {
        "models": [{**dataclasses.asdict(r), "budget_rows": budget_rows(r),
                    "spearman": spearman([s.predicted_s for s in candidates(r)], [s.step_s for s in candidates(r)])}
                   for r in results],
        "spearman_all": spearman([s.predicted_s for s in pts], [s.step_s for s in pts]),
    }


def write_json(results: Sequence[ModelResult], path: Path) -> None:
    path.write_text(json.dumps(to_json(results), indent=1, default=str))


def plot(results: Sequence[ModelResult], path: Path) -> str:
    """Step time vs memory budget, one line per system (a point only where it fits). Returns what was done."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        budgets = [b.budget_bytes / MB for b in r.budgets]
        for s in r.baselines:
            ys = [s.step_s * 1e3 if fits(s, b.budget_bytes) else math.nan for b in r.budgets]
            ax.plot(budgets, ys, marker="o", label=s.name)
        ys = [r.autopar_plans[b.autopar].step_s * 1e3 if b.autopar else math.nan for b in r.budgets]
        ax.plot(budgets, ys, marker="s", linewidth=2.5, color="black", label="autopar")
        ax.set(title=f"{r.case.model}-{r.case.size}", xlabel="memory budget per rank (MB)", ylabel="step time (ms)")
        ax.invert_xaxis()
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"
