"""How each parameter is laid out relative to its module's math, read off the ops that consume it.

    param_layouts(traced)  # {"transformer.h.0.mlp.c_fc.weight": "in_out", "transformer.wte.weight": "embedding", ...}

The same split means opposite things for two storage orders of a matmul weight: `nn.Linear`
stores (out, in) and multiplies by the transpose, so splitting dim 0 splits the outputs
(Megatron's column-parallel); Hugging Face's `Conv1D` stores (in, out) and multiplies as is, so
dim 0 splits the inputs (row-parallel). The graph says which: a plan records the layout per
parameter, so every report words a split the same way without the model at hand.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import fx

from autopar.tracer.capture import TracedGraph

Layout = Literal["out_in", "in_out", "embedding", "conv", "vector", "other", ""]
# "out_in": a matmul weight stored (out, in), as nn.Linear; "in_out": stored (in, out), as HF Conv1D;
# "embedding": a lookup table (rows, width); "conv": a convolution's (out channels, in channels, ...);
# "vector": one dim (a bias, a norm's scale); "other": anything else; "": not recorded (older plan files)

_aten = torch.ops.aten
_TRANSPOSES = (_aten.t.default, _aten.transpose.int, _aten.permute.default)
_MATMULS = {_aten.mm.default: (0, 1), _aten.addmm.default: (1, 2), _aten.bmm.default: (0, 1)}  # (left, right) arg index


def _is_2d_transpose(node: fx.Node) -> bool:
    if node.target is _aten.permute.default:
        return list(node.args[1]) == [1, 0]
    return node.target in _TRANSPOSES


def _matmul_layouts(param: fx.Node) -> set[str]:
    """The layouts the matmuls reading `param` (directly or through one transpose) imply: the right operand
    (in, out) as is is "in_out", transposed "out_in"; the left operand (out, in) the other way round."""
    reads = [(param, user, False) for user in param.users]
    reads += [(t, user, True) for t in param.users if _is_2d_transpose(t) for user in t.users]
    found = set()
    for operand, user, flipped in reads:
        if user.target not in _MATMULS:
            continue
        left, right = _MATMULS[user.target]
        if len(user.args) > right and user.args[right] is operand:
            found.add("out_in" if flipped else "in_out")
        elif len(user.args) > left and user.args[left] is operand:
            found.add("in_out" if flipped else "out_in")
    return found


def _layout(param: fx.Node) -> Layout:
    val = param.meta.get("val")
    ndim = getattr(val, "ndim", None)
    targets = {u.target for u in param.users}
    if ndim == 1:
        return "vector"
    if _aten.embedding.default in targets:  # a tied LM head reads it too: rows are the vocabulary either way
        return "embedding"
    if _aten.convolution.default in targets:
        return "conv"
    if ndim == 2:
        found = _matmul_layouts(param)
        if len(found) == 1:
            return found.pop()  # type: ignore[return-value]
    return "other"


def param_layouts(traced: TracedGraph) -> dict[str, Layout]:
    """Parameter FQN -> its layout, for every parameter placeholder of the graph."""
    return {traced.param_fqns[n.name]: _layout(n) for n in traced.graph.nodes
            if n.op == "placeholder" and n.name in traced.param_fqns}
