"""`import autopar` initialises no CUDA: a forked rank could not use CUDA its parent initialised."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every torch.cuda call that initialises CUDA raises; then the packages are imported. (`device_count` may run:
# it asks NVML, `autopar.compat.settle_autograd_engine` on torch 2.11 and 2.12.)
_PROBE = """
import torch
def touched(name):
    def call(*args, **kwargs):
        raise RuntimeError(f"torch.cuda.{name} called at import")
    return call  # one function per name: torch._dynamo refuses one object under two names
for name in ("is_available", "init", "_lazy_init", "current_device", "get_device_name", "get_device_properties",
             "get_rng_state", "set_device", "synchronize", "mem_get_info"):
    setattr(torch.cuda, name, touched(name))
import autopar, autopar.cli, autopar.runtime.launch, autopar.runtime.rng, autopar.runtime.checkpoint, kernels
import autopar.api, autopar.solver, autopar.codegen
print("clean")
"""


def test_importing_autopar_touches_no_cuda():
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and run.stdout.strip() == "clean", run.stderr[-2000:]
