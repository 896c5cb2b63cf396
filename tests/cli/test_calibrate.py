"""`autopar calibrate` for real: 2 gloo ranks under torchrun, then the saved mesh planned with as --hardware."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from autopar.cli import main
from autopar.solver.plan_io import load_mesh
from tests.cli.plans import EXAMPLES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.long
@pytest.mark.timeout(150)
def test_calibrate_under_torchrun_saves_a_mesh_that_plans(tmp_path, capsys):
    out = tmp_path / "mesh.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "autopar.cli", "calibrate", "--gpus", "2", "--save", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines.count("dp=2 (calibrated-cpu)") == 1  # printed once, by rank 0
    axis = next(line for line in lines if line.strip().startswith("axis dp:"))
    assert "size 2" in axis and "GB/s" in axis

    mesh = load_mesh(out)
    assert mesh.shape == (2,) and mesh.hardware == "calibrated-cpu"
    # every number measured, none a placeholder: positive and finite
    for value in (mesh.flops_per_s, mesh.mem_bandwidth_bytes_per_s, mesh.memory_bytes, mesh.axes[0].alpha_s, mesh.axes[0].beta_bytes_per_s):
        assert 0 < value < float("inf")

    code = main(["plan", str(EXAMPLES / "mlp.py"), "--size", "tiny", "--gpus", "2", "--hardware", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "Mesh dp=2  (2 devices, calibrated-cpu)" in printed
    assert "Communication per device" in printed
