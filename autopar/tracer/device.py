"""Retarget a graph traced on `meta` to a real device.

Tracing on meta bakes `device=meta` into factory and copy ops
(`scalar_tensor(..., device=meta)`, `_to_copy(..., device=meta)`); before a
graph runs on real tensors those kwargs must name the real device.
"""
from __future__ import annotations

import copy

import torch
from torch import fx


def with_device(gm: fx.GraphModule, device: torch.device | str) -> fx.GraphModule:
    """A copy of `gm` whose `device=` keyword arguments all name `device`."""
    device = torch.device(device)
    out = copy.deepcopy(gm)
    for node in out.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device):
            node.kwargs = {**node.kwargs, "device": device}
    out.recompile()
    return out
