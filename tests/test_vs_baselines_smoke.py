"""Smoke test of benchmarks/vs_baselines.py: its core on the tiniest case with 2 ranks (no timing assertions)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmark helpers are imported as the `benchmarks` package

from autopar.runtime.launch import run_ranks  # noqa: E402
from benchmarks._common import load_example  # noqa: E402
from benchmarks.baselines.bench import Case, run_model  # noqa: E402
from benchmarks.baselines.report import budget_rows, format_model, spearman  # noqa: E402

SYSTEMS = ("ddp", "ddp+ac", "fsdp", "fsdp+ac", "tp", "tp+ac")


def test_spearman_against_hand_ranks():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2, 3) vs (1.5, 1.5, 3): pearson of ranks = 0.866...
    assert spearman([1, 2, 3], [5, 5, 9]) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(spearman([1, 2], [2, 1]))


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
    # the largest budget is DDP's predicted memory: autopar has a plan there and the row has a ratio
    row = budget_rows(result)[0]
    assert row["budget_bytes"] == pytest.approx(max(s.predicted_bytes for s in result.baselines))
    assert row["autopar_s"] > 0
    table = format_model(result)
    for name in (*SYSTEMS, "autopar#0", "spearman"):
        assert name in table
