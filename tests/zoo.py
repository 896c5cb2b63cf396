"""The model zoo (examples/) as the tests load it: by path, the way the CLI does."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from autopar.model_file import import_model_file

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ZOO = ("mlp", "gpt2", "llama", "bert", "vit", "resnet", "hf_gpt2", "hf_llama")


def load_zoo(name: str) -> ModuleType:
    """examples/<name>.py as a module (with CONFIGS and build())."""
    return import_model_file(EXAMPLES / f"{name}.py")
