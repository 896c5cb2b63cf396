"""Smoke test of benchmarks/vs_baselines.py: its core on the tiniest case with 2 ranks (no timing assertions)."""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmark helpers are imported as the `benchmarks` package

from autopar.runtime.launch import run_ranks  # noqa: E402
from autopar.solver.ilp import MEMORY_SLACK_BYTES  # noqa: E402
from benchmarks._common import load_example  # noqa: E402
from benchmarks.baselines.bench import Case, run_model  # noqa: E402
from benchmarks.baselines.measure import balanced_orders  # noqa: E402
from benchmarks.baselines.report import budget_rows, candidates, explain_miss, format_model, ratio_interval, spearman, spread  # noqa: E402

SYSTEMS = ("ddp", "ddp+ac", "fsdp", "fsdp+ac", "tp", "tp+ac")


def test_spearman_against_hand_ranks():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2, 3) vs (1.5, 1.5, 3): pearson of ranks = 0.866...
    assert spearman([1, 2, 3], [5, 5, 9]) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(spearman([1, 2], [2, 1]))


@pytest.mark.parametrize("n", range(1, 14))
def test_each_system_follows_each_other_equally_often(n):
    orders = balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    follows = {(a, b): 0 for a in range(n) for b in range(n) if a != b}
    for order in orders:
        for before, after in zip(order, order[1:]):
            follows[before, after] += 1
    assert set(follows.values()) <= {1 if n % 2 == 0 else 2}
    assert len(orders) == (n if n % 2 == 0 else 2 * n)


def test_a_miss_is_explained_from_the_prices_and_the_spread():
    from dataclasses import replace

    from benchmarks.baselines.bench import BudgetResult, ModelResult, SystemResult

    steps = (0.010, 0.011, 0.012, 0.013, 0.014)  # quartiles 0.011 and 0.013 around a 0.012 median: 17% spread
    ddp = SystemResult("ddp", (4,), 0.010, 5e6, 0.012, int(4.8e6), steps)
    plan = SystemResult("autopar#0", (4,), 0.011, 5e6, 0.013, int(4.9e6), steps, loss_sync_s=0.002)
    assert spread(ddp) == pytest.approx(0.002 / 0.012)
    result = ModelResult(Case("gpt2"), {}, (ddp,), {"autopar#0": plan}, (BudgetResult(6e6, "autopar#0"),))
    row = budget_rows(result)[0]
    assert row["ratio"] == pytest.approx(0.013 / 0.012)
    # without its loss all-reduce the plan is priced 0.9x DDP: the model ranked it first
    why = explain_miss(result, row)
    assert "spread 17%" in why and "2.00 ms" in why and "0.90x ddp" in why and "ranked autopar's plan first" in why
    # priced slower, while DDP's predicted memory is over the budget the solver had: it could not pick DDP's plan
    slow = ModelResult(Case("gpt2"), {}, (ddp,), {"autopar#0": SystemResult("autopar#0", (4,), 0.013, 4e6, 0.013, int(4e6), steps)},
                       (BudgetResult(4.9e6, "autopar#0"),))
    assert "could not choose" in explain_miss(slow, budget_rows(slow)[0])
    # priced as DDP once its loss all-reduce is set aside: the same plan, so runtime overhead
    same = ModelResult(Case("gpt2"), {}, (ddp,), {"autopar#0": replace(plan, predicted_s=0.012)}, (BudgetResult(6e6, "autopar#0"),))
    assert "runtime overhead" in explain_miss(same, budget_rows(same)[0]) and "ranked" not in explain_miss(same, budget_rows(same)[0])


def test_a_miss_against_ddp_is_set_against_ddp_returning_the_global_loss():
    """The reference (`ddp+loss`) is named with autopar's ratio to it, only when DDP is the best fit."""
    from benchmarks.baselines.bench import BudgetResult, ModelResult, SystemResult

    steps = (0.010, 0.011, 0.012, 0.013, 0.014)
    ddp = SystemResult("ddp", (4,), 0.010, 5e6, 0.012, int(4.8e6), steps)
    ref = SystemResult("ddp+loss", (4,), 0.010, 5e6, 0.013, int(4.8e6), tuple(t + 0.001 for t in steps))
    plan = SystemResult("autopar#0", (4,), 0.010, 5e6, 0.0126, int(4.9e6), tuple(t + 0.0006 for t in steps))
    result = ModelResult(Case("gpt2"), {}, (ddp,), {"autopar#0": plan}, (BudgetResult(6e6, "autopar#0"),), references=(ref,))
    why = explain_miss(result, budget_rows(result)[0])
    assert "(ddp+loss) 13.00 ms, autopar 0.97x of it" in why  # 12.6 / 13.0
    assert "ddp+loss" in format_model(result) and "a reference, not a baseline" in format_model(result)
    # the reference is not a baseline: not a budget's best fit, not a rank-correlation point
    assert budget_rows(result)[0]["best_baseline"] == "ddp" and ref not in candidates(result)
    fsdp = SystemResult("fsdp", (4,), 0.010, 3e6, 0.012, int(2.8e6), steps)
    tight = ModelResult(Case("gpt2"), {}, (fsdp,), {"autopar#0": plan}, (BudgetResult(3e6, "autopar#0"),), references=(ref,))
    assert "ddp+loss" not in explain_miss(tight, budget_rows(tight)[0])


def test_the_ratio_interval_says_whether_a_miss_is_beyond_noise():
    """Bootstrap of the ratio of medians: identical steps give an interval around 1.0, steps all twice as long one
    around 2.0; a 5% gap under a 15% spread stays within noise, a doubling is beyond it."""
    from benchmarks.baselines.bench import BudgetResult, ModelResult, SystemResult

    steps = tuple(0.010 + 0.0001 * ((7 * i) % 30) for i in range(30))  # 10-12.9 ms, a 15% spread
    base = SystemResult("ddp", (4,), 0.010, 5e6, statistics.median(steps), int(4.8e6), steps)
    same = SystemResult("autopar#0", (4,), 0.010, 5e6, statistics.median(steps), int(4.8e6), steps)
    lo, hi = ratio_interval(same, base)
    assert lo < 1.0 < hi and ratio_interval(same, base) == (lo, hi)  # seeded
    double = SystemResult("autopar#0", (4,), 0.010, 5e6, 2 * statistics.median(steps), int(4.8e6), tuple(2 * t for t in steps))
    lo2, hi2 = ratio_interval(double, base)
    assert 1.6 < lo2 <= 2.0 <= hi2 < 2.5
    slower = SystemResult("autopar#0", (4,), 0.010, 5e6, 1.05 * statistics.median(steps), int(4.9e6), tuple(1.05 * t for t in steps))
    result = ModelResult(Case("gpt2"), {}, (base,), {"autopar#0": slower}, (BudgetResult(6e6, "autopar#0"),))
    assert "within noise" in explain_miss(result, budget_rows(result)[0])
    result2 = ModelResult(Case("gpt2"), {}, (base,), {"autopar#0": double}, (BudgetResult(6e6, "autopar#0"),))
    assert "beyond noise" in explain_miss(result2, budget_rows(result2)[0])


@pytest.mark.long
@pytest.mark.timeout(120)
def test_benchmark_core_two_ranks():
    case = Case("gpt2", "tiny", batch=2, seq=16, steps=2, max_budgets=1)
    result = run_ranks(run_model, 2, case, timeout_s=110)[0]
    assert [s.name for s in result.baselines] == list(SYSTEMS)
    assert len(result.budgets) == 1 and result.budgets[0].autopar == "autopar#0"
    for s in [*result.baselines, *result.autopar_plans.values()]:
        assert s.step_s > 0 and s.peak_bytes > 0 and s.predicted_s > 0 and s.predicted_bytes > 0, s
    # hand count: DDP keeps the whole model's params + grads + two AdamW moments (fp32) on every rank
    model, _ = load_example("gpt2").build(2, 16, size="tiny", device="meta")
    state_bytes = 4 * sum(p.numel() * 4 for p in model.parameters())
    by_name = {s.name: s for s in result.baselines}
    assert by_name["ddp"].peak_bytes >= state_bytes
    # FSDP shards that state over the 2 ranks; its peak stays below DDP's
    assert by_name["fsdp"].peak_bytes < by_name["ddp"].peak_bytes
    # the largest budget is the largest baseline's predicted memory and the ILP's slack (so that baseline's plan
    # is one autopar may choose): autopar has a plan there and the row has a ratio
    row = budget_rows(result)[0]
    assert row["budget_bytes"] == pytest.approx(max(s.predicted_bytes for s in result.baselines) + MEMORY_SLACK_BYTES)
    assert row["autopar_s"] > 0
    # the reference, DDP returning the global loss, is measured beside them (same memory as DDP's)
    assert [s.name for s in result.references] == ["ddp+loss"]
    assert result.references[0].step_s > 0 and result.references[0].peak_bytes >= state_bytes
    table = format_model(result)
    for name in (*SYSTEMS, "autopar#0", "ddp+loss", "spearman"):
        assert name in table


def test_calibrations_share_the_numbers_of_the_group_of_all_ranks():
    """The 1-D axis of 4 and the 2x2 mesh's group over both axes are one group of ranks measured twice:
    both get the mean of the two measurements (kind by kind), the 2-rank axes keep their own."""
    from dataclasses import replace

    from autopar.solver.mesh import AxisGroup, LinkCost, MeshAxis, make_mesh
    from benchmarks.baselines.bench import _shared_device_numbers

    def axis(name, size, alpha_s, beta):
        return MeshAxis(name, size, alpha_s, beta, (LinkCost("all_reduce", alpha_s, beta), LinkCost("all_gather", 2 * alpha_s, beta)), alpha_s / 4)

    one = replace(make_mesh(4, (4,), "cpu"), axes=(axis("dp", 4, 1.0e-3, 1e9),), op_overhead_s=1e-5)
    two = replace(make_mesh(4, (2, 2), "cpu"), axes=(axis("dp", 2, 0.4e-3, 1e9), axis("tp", 2, 0.5e-3, 1e9)),
                  groups=(AxisGroup((0, 1), axis("dp+tp", 4, 0.6e-3, 3e9)),), op_overhead_s=3e-5)
    shared = _shared_device_numbers({"1d": one, "2d": two})
    world = shared["1d"].axes[0]
    assert world.name == "dp" and world.link("all_reduce") == (pytest.approx(0.8e-3), pytest.approx(2e9))
    assert world.link("all_gather")[0] == pytest.approx(1.6e-3) and world.scalar_alpha_s == pytest.approx(0.2e-3)
    group = shared["2d"].groups[0].link
    assert group.name == "dp+tp" and group.link("all_reduce") == world.link("all_reduce")
    assert shared["2d"].axes == two.axes  # 2-rank groups: other ranks, their own measurements
    assert shared["1d"].op_overhead_s == shared["2d"].op_overhead_s == pytest.approx(2e-5)


@pytest.mark.timeout(120)
def test_the_ddp_baseline_is_priced_as_the_same_plan_from_the_solver():
    """DDP's plan is autopar's data-parallel plan: the baseline's price must be the ILP's price of that plan,
    not less (a mean loss's token count rides in the loss's own all-reduce, which the ILP charges nothing)."""
    from autopar.profiler.measure import block_paths
    from autopar.solver.mesh import make_mesh
    from benchmarks.baselines.predict import Predictor, scalar_reshard_s

    model, sample = load_example("gpt2").build(8, 32, size="tiny", device="cpu")
    pred = Predictor(model, sample, {"1d": make_mesh(4, (4,), "cpu"), "2d": make_mesh(4, (2, 2), "cpu")},
                     block_paths(model), "gpt2")
    pinned = pred.pinned_plan(pred.meshes["1d"], tp_params=False, zero="never")
    assert scalar_reshard_s(pred.traced, pinned) == 0.0
    assert pred.baseline("ddp").time.total_s == pytest.approx(pinned.time.total_s, rel=1e-9)
    ample = pred.autopar(float("inf"))
    assert ample.time.total_s <= pinned.time.total_s * (1 + 1e-9)
