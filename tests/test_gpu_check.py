"""`benchmarks/gpu_check.py --cpu`: the one-GPU check's stages run on CPU, so the script cannot rot between GPU runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long
def test_every_stage_of_the_gpu_check_passes_on_cpu():
    # stage timeouts are sized for a GPU machine's 16 cores: three times as long on CI's two
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--timeout-scale", "3"],
                         capture_output=True, text=True, timeout=1200, cwd=ROOT)
    lines = {d["stage"]: d for d in map(json.loads, run.stdout.splitlines()) if "stage" in d}
    failed = {name: line.get("error") for name, line in lines.items() if not line["ok"]}
    assert not failed and run.returncode == 0, failed or run.stderr[-2000:]
    assert list(lines) == ["versions", "kernels", "world_of_one", "fake_world", "gloo_shared", "train_example", "offload"]
    assert len(lines["kernels"]["bit_exact"]) == 8  # 4 kernels x (float32, bfloat16), each against its fallback
    one = lines["world_of_one"]
    assert one["collectives"] == ["all_gather", "all_reduce", "all_to_all", "reduce_scatter"] and one["grad_sync"]
    assert one["loss_error"] == 0.0 and one["grad_max_abs_error"] == 0.0  # one device: the same ops as eager
    assert one["fp32"]["step_ms"] > 0 and one["fp32"]["predicted_peak_bytes"] > 0
    assert all(v["loss_error"] < 1e-4 and v["param_error"] < 1e-4 for v in lines["gloo_shared"]["plans"].values())
    assert len(lines["train_example"]["first_losses"]) == 1 and len(lines["train_example"]["resumed_losses"]) == 1
    offload = lines["offload"]  # every parameter on the host tier: the same first loss, less device memory planned
    assert offload["host"]["hosted"] > 0 and offload["host"]["first_loss"] == offload["device"]["first_loss"]
    assert offload["host"]["predicted_peak_bytes"] < offload["device"]["predicted_peak_bytes"]
