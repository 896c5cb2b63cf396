"""`as_strided` calls that only restate their input's layout, dropped from the traced graph.

`as_strided(x, size, stride, offset)` reads storage directly, so no sharding rule
can split it in general: the solver ran it replicated, its input gathered, and
warned. Export writes one where a decomposition restrides a result it just made:
`adaptive_avg_pool1d` (Swin's pooler, any `nn.AdaptiveAvgPool1d`) is a `mean`
over a (N, C, 1, L) view, then `as_strided` to (N, C, 1, 1) with strides whose
only difference is on the size-1 dims. Such a call reads every element exactly
where its input holds it: same size, same storage offset, same stride on every
dim longer than 1 (a size-1 dim's stride is never multiplied by anything but 0).
Its value is its input's, element for element, and so is its gradient; this pass
hands its users the input instead, which every later stage already knows how to
split. A call that really moves elements (a sliding window, a diagonal) stays,
and stays replicated.
"""
from __future__ import annotations

import logging

import torch
from torch import fx

log = logging.getLogger(__name__)


def drop_identity_as_strided(gm: fx.GraphModule) -> int:
    """Replace every `as_strided` of `gm` that reads its input in place by that input; returns how many."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.as_strided.default and _reads_in_place(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            dropped += 1
    if dropped:
        gm.recompile()
        log.info("tracer: %d as_strided calls that restate their input's layout dropped", dropped)
    return dropped


def _reads_in_place(node: fx.Node) -> bool:
    """as_strided(x, size, stride, offset) addresses each element where x holds it (concrete sizes only)."""
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    size, stride = node.args[1], node.args[2]
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    if not all(isinstance(v, int) for v in (*size, *stride, *val.shape, *val.stride())):
        return False  # symbolic: not provable here, left as it is
    if list(size) != list(val.shape):
        return False
    if offset is not None and offset != val.storage_offset():
        return False
    return all(n == 1 or s == xs for n, s, xs in zip(size, stride, val.stride()))
