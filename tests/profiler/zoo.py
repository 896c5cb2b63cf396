"""Zoo models loaded by path (examples/ is not a package)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# model -> dynamic dims its forward allows (mlp has no sequence dim)
DYNAMIC = {"gpt2": {"batch": 0, "seq": 1}, "bert": {"batch": 0, "seq": 1}, "vit": {"batch": 0}, "mlp": {"batch": 0}}


def load_example(name: str):
    mod_name = f"autopar_example_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, ROOT / "examples" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod  # dataclasses need the module registered while it executes
        spec.loader.exec_module(mod)
    return sys.modules[mod_name]
