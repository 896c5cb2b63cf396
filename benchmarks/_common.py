"""Shared bits of the benchmark scripts: loading zoo files and the provenance JSON line."""
from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path

import torch

from autopar.model_file import import_model_file

ROOT = Path(__file__).resolve().parents[1]


def load_example(name: str):
    """examples/<name>.py as a module, imported by path the way the CLI does."""
    return import_model_file(ROOT / "examples" / f"{name}.py")


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
