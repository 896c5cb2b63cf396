"""Tensors whose size depends on tensor values, refused at trace time with the user's line.

`x[mask]`, `masked_select`, `nonzero`, `unique` (and `F.ctc_loss`, whose scratch
is sized by the longest target) make a tensor whose length is known only once
the values are. torch.export captures the first kind with an "unbacked" size
symbol; the second it cannot capture at all. autopar plans every tensor's
shape ahead of the step (how each splits over the mesh, what each costs and
holds), and a rank's part of such a tensor would have a length of its own, so
neither can be planned. Without this check the first kind failed deep in the
solver ("Cannot convert symbols to int"); now both name the op, the line and
the way around it: keep the shape and mask the values, or (where torch cannot size the
op at all) compute it outside the model, on the parallel module's outputs.
"""
from __future__ import annotations

import os

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autopar.errors import TraceError
from autopar.tracer.nodes import output_vals

WHAT = "an op whose output size depends on tensor values"
FIX = ("autopar plans fixed shapes: keep the shape and mask the values instead, e.g. "
       "`torch.where(mask, x, 0)` for `x[mask]`, or `(loss * mask).sum() / mask.sum()` for a mean over the "
       "selected elements")
UNSIZED_FIX = ("autopar plans fixed shapes, and torch cannot size this op's output without its input values: compute "
               "it outside the model, on the parallel module's outputs (each rank's result is its term of the "
               "global sum: divide a mean over its rows by the number of ranks)")


def refuse_data_dependent_sizes(gm: fx.GraphModule, model_name: str) -> None:
    """Raise TraceError naming the first op of `gm` whose output has a size that depends on values."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(free_unbacked_symbols(v) for v in output_vals(node) if v is not None):
            raise TraceError(f"cannot trace {model_name}: {WHAT} (`{node.target}`) at {user_line(node)}\n"
                             f"  fix: {FIX}")


def user_line(node: fx.Node) -> str:
    """'file:line (`code`)' of the innermost frame export recorded for `node` outside torch and autopar,
    or 'an unknown line'."""
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


def in_library(filename: str) -> bool:
    """Whether `filename` is torch's, autopar's or the standard library's (not a line of the user's)."""
    path = os.path.abspath(filename)
    return path.startswith(_LIBRARIES) or "site-packages/torch" in path


_LIBRARIES = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (torch.__file__, os.path.dirname(__file__), os.__file__))
