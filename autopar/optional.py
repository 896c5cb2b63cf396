"""Optional dependencies: the features that need them import them here, and a missing one names its pip command.

    transformers = require("transformers", "--hf-config gpt2")
"""
from __future__ import annotations

import importlib
from types import ModuleType

from autopar.errors import MissingDependencyError

# package -> the install that brings it: the extras of pyproject.toml (run from a clone of the repository)
INSTALL = {
    "transformers": 'pip install -e ".[hf]"',
    "safetensors": 'pip install -e ".[hf]"',
    "triton": 'pip install -e ".[kernels]"',
}


def install_command(package: str) -> str:
    return INSTALL.get(package, f"pip install {package}")


def missing(package: str, what: str) -> MissingDependencyError:
    return MissingDependencyError(f"{what} needs the optional package {package!r}, which is not installed\n"
                                  f"  fix: {install_command(package)}")


def require(package: str, what: str) -> ModuleType:
    """`import package`, or a `MissingDependencyError` saying that `what` needs it and how to install it."""
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != package:
            raise  # the package is there but something it imports is not: its own error says what
        raise missing(package, what) from None
