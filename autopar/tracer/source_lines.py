"""Which line of the user's code an op or a call came from, for error messages.

Export records each node's Python stack (`node.meta["stack_trace"]`); a call made while tracing has
the interpreter's stack. Either way the line to show is the innermost one outside torch, autopar,
the standard library and generated code (`<string>`, fx's `<eval_with_key>`).
"""
from __future__ import annotations

import os
import traceback

import torch
from torch import fx


def in_library(filename: str) -> bool:
    """Whether `filename` is torch's, autopar's, the standard library's or generated (not a line of the user's)."""
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_STDLIB) and _INSTALLED not in path:  # installed packages live under the stdlib's folder
        return True
    return path.startswith(_TORCH_AND_AUTOPAR)


_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_INSTALLED = os.sep + "site-packages" + os.sep
_TORCH_AND_AUTOPAR = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (torch.__file__, os.path.dirname(__file__)))


def node_line(node: fx.Node) -> str:
    """'file:line (`code`)' of the innermost user frame export recorded for `node`, or 'an unknown line'."""
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        text = lines[i].strip()
        if not text.startswith('File "'):
            continue
        filename, _, rest = text[len('File "'):].partition('", line ')
        if in_library(filename):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) else ""
        return f"{filename}:{rest.split(',')[0]} (`{code}`)"
    return "an unknown line"


def calling_line() -> str:
    """'file:line (`code`)' of the innermost user frame of the current call stack, or 'an unknown line'."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not in_library(frame.filename):
            return f"{frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)"
    return "an unknown line"
