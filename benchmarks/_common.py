"""Shared bits of the benchmark scripts: loading zoo files and the provenance JSON line."""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path
from typing import Callable, Sequence

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


def sweep_options(description: str, kind: str, names: Sequence[str], add_options: Callable[[argparse.ArgumentParser], None]
                  ) -> tuple[argparse.Namespace, tuple[int, ...], list[str]]:
    """A sweep's command line: `--only` (comma-separated `kind`s, default all of `names`), `--mesh` and what
    `add_options` adds. Returns the options, the mesh shape and the names to run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", help=f"comma-separated {kind} names (default: all)")
    parser.add_argument("--mesh", default="2", help="mesh shape, e.g. 2 or 2x2")
    add_options(parser)
    opts = parser.parse_args()
    return opts, tuple(int(n) for n in opts.mesh.split("x")), opts.only.split(",") if opts.only else list(names)


def sweep(kind: str, names: Sequence[str], check: Callable[[str], tuple[float, ...]], columns: Sequence[str]) -> int:
    """One row per name: `check(name)`'s numbers under `columns` (the first as a loss, the rest as errors), or
    the last line of the error it raised (a sweep reports every name). Returns how many failed."""
    print(f"{kind:20} " + " ".join(f"{c:>9}" for c in columns))
    failed = 0
    for name in names:
        try:
            loss, *errors = check(name)
            print(f"{name:20} {loss:9.5f} " + " ".join(f"{e:9.1e}" for e in errors), flush=True)
        except Exception as err:
            failed += 1
            print(f"{name:20} failed: {str(err).strip().splitlines()[-1][:240]}", flush=True)
    return failed
