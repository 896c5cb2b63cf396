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

from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autopar.errors import TraceError
from autopar.tracer.nodes import output_vals
from autopar.tracer.source_lines import node_line

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
            raise TraceError(f"cannot trace {model_name}: {WHAT} (`{node.target}`) at {node_line(node)}\n"
                             f"  fix: {FIX}")
