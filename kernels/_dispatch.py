"""Choosing between the Triton kernels and the torch fallbacks.

Rule (the same for every public function in `kernels`):
- ``impl="torch"``: always the torch fallback.
- ``impl="auto"``: Triton when triton imports, every tensor has a float32 / float16 / bfloat16
  dtype, and either all tensors are on a CUDA device (compiled kernels) or ``TRITON_INTERPRET``
  is set and all tensors are on the CPU (Triton's interpreter); otherwise the torch fallback.
  (With TRITON_INTERPRET set, CUDA tensors take the torch path: the multi-tensor kernels read
  raw addresses from a table, which the interpreter cannot copy off the GPU.)
- ``impl="triton"``: the same conditions, but a failed condition raises `TritonUnavailableError`
  naming it, so a test that means to exercise the kernel never silently runs the fallback.

``TRITON_INTERPRET`` is read by ``triton.jit`` when a kernel is *decorated*, not when it runs,
so `triton_kernels()` (re)imports the module holding the kernels whenever the variable's value
differs from the one the loaded kernels were built under. That is what lets a test switch the
interpreter on with ``monkeypatch.setenv`` after triton was imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Literal

import torch

Impl = Literal["auto", "triton", "torch"]

# Dtypes the Triton kernels load and store; math inside them is always float32.
TRITON_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})

# Values triton itself accepts as true for TRITON_INTERPRET (checked against libtriton's getenv_bool).
_TRUE = frozenset({"1", "true", "on", "yes"})


class TritonUnavailableError(RuntimeError):
    """``impl="triton"`` was requested where the Triton path cannot run."""


@functools.cache
def triton_importable() -> bool:
    """True when ``import triton`` succeeds (cached: importing triton takes about a second)."""
    try:
        import triton  # noqa: F401
    except Exception:  # an ImportError, or a broken install failing inside triton's own imports
        return False
    return True


def interpret_requested() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter (read on every call)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def _unusable_reason(tensors: list[torch.Tensor]) -> str:
    """Why the Triton path cannot run on these tensors (`_usable` or triton's import said no)."""
    if not triton_importable():
        return "triton is not importable (install it: pip install -e \".[kernels]\")"
    bad = sorted({str(t.dtype) for t in tensors if t.dtype not in TRITON_DTYPES})
    if bad:
        return f"dtype {', '.join(bad)} has no Triton kernel (supported: float32, float16, bfloat16)"
    devices = sorted({t.device.type for t in tensors})
    if interpret_requested():
        # The interpreter runs on host memory; our kernels also read raw addresses from
        # pointer tables, which the interpreter cannot move off a GPU. So CPU tensors only.
        return f"TRITON_INTERPRET is set but tensors are on {devices} (the interpreter needs cpu)"
    return f"tensors are on {devices}: compiled Triton needs cuda (or set TRITON_INTERPRET=1 for cpu)"


def _usable(tensors: list[torch.Tensor]) -> bool:
    """The rule's conditions on the tensors in one pass (a bucket's dozens of gradients, every
    backward): the full reason is only spelled out when impl="triton" needs it."""
    device = "cpu" if interpret_requested() else "cuda"
    return all(t.dtype in TRITON_DTYPES and t.device.type == device for t in tensors)


def use_triton(impl: Impl, tensors: Iterable[torch.Tensor], op: str) -> bool:
    """Decide the path for one call of `op`; see the module docstring for the rule."""
    if impl == "torch":
        return False
    if impl not in ("auto", "triton"):
        raise ValueError(f"{op}: impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    tensors = list(tensors)
    if _usable(tensors) and triton_importable():  # tensors first: CPU runs never pay triton's import
        return True
    if impl == "triton":
        raise TritonUnavailableError(f"{op}: impl='triton' but {_unusable_reason(tensors)}")
    return False


def device_guard(device: torch.device) -> AbstractContextManager[object]:
    """Make `device` current for a launch: Triton launches on the *current* CUDA device, which
    need not be the tensors' (cuda:1 tensors while cuda:0 is current). No-op off CUDA."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def triton_kernels() -> ModuleType:
    """The module of @triton.jit kernels, built for the current TRITON_INTERPRET value."""
    from kernels import _triton_kernels as mod  # imports triton; only called on the Triton path

    if mod.BUILT_INTERPRETED != interpret_requested():
        mod = importlib.reload(mod)  # re-runs the @triton.jit decorators under the new mode
    return mod
