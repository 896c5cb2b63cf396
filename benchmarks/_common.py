"""Shared bits of the benchmark scripts: loading zoo files and the provenance JSON line."""
from __future__ import annotations

import importlib.util
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_example(name: str):
    """Import examples/<name>.py by path (registered in sys.modules so its dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location(f"zoo_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance_line(benchmark: str, **extra) -> str:
    """One JSON line: what ran, where, on which torch and commit."""
    return json.dumps({"benchmark": benchmark, "torch": torch.__version__, "device": platform.processor() or "cpu",
                       "python": platform.python_version(), "git": git_sha(), **extra})
