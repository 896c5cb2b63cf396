"""Whether a lowered graph's collectives move tensors whose size depends on the inputs' shapes.

Such a graph's collectives have sizes set by this rank's inputs, so every rank must feed
inputs of the same shapes (`runtime.same_inputs` checks it each forward): ranks fed other
shapes lower graphs of their own, whose collectives then send and expect different byte
counts (gloo aborts the process, "Received data size doesn't match expected size"; NCCL
hangs or reads the wrong bytes). A graph whose collectives all have sizes fixed by the
parameters (data parallel: only gradients leave the rank, in the gradient sync, and the
loss's scalars; a parameter stored sharded and gathered whole where it is used) runs on any
shapes each rank is given.

The graph is traced at fixed shapes, so a size read from an input is a literal in the graph
(`arange(16)`, `slice(wpe, 0, 0, 16)`) that cannot be told from a constant of the model. So a
node counts as sized by the inputs unless it is computed from parameters and buffers alone by
ops that keep their number of elements (casts, views, transposes, copies; `_KEEP_NUMEL`) or by
collectives: a user input, anything computed from one, any tensor made from nothing
(`arange`, `full`), and any other op (a slice, an index, a concatenation, a product of two
parameters) counts, which may ask a plan for checks it could do without, never the reverse. Measured: GPT-2-tiny's plan on the CPU preset
stores the position table split and gathers the rows `wpe[:T]` the sequence length T reads;
ranks fed T = 16 and 12 aborted in that gather. The loss's all-reduces
(`runtime.deferred_loss`) move scalars and are not counted.
"""
from __future__ import annotations

import torch
from torch import fx

from autopar.runtime import collectives, sync_batch_norm, vocab_parallel

# the runtime's modules whose functions move data between ranks (the loss's scalars live in `deferred_loss`)
_EXCHANGING_MODULES = frozenset(m.__name__ for m in (collectives, vocab_parallel, sync_batch_norm))


def exchanges_activations(gm: fx.GraphModule, num_state_inputs: int) -> bool:
    """Whether `gm` (its first `num_state_inputs` arguments parameters and buffers, the rest the user's inputs)
    sends or receives a tensor whose size may depend on the shapes of the user's inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return _exchanges_sized(gm, set(placeholders[num_state_inputs:]))


def _exchanges_sized(gm: fx.GraphModule, sized: set[fx.Node]) -> bool:
    """Whether a collective of `gm` (or of a recomputed region it calls) moves a node sized by the inputs;
    `sized`: the placeholders that are (filled in with every node that is)."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        inputs = node.all_input_nodes
        if _is_sized(node, sized):
            sized.add(node)
        if node.op == "call_function" and _is_collective(node.target) and any(a in sized for a in inputs):
            return True
        for region in (getattr(gm, a.target) for a in inputs if a.op == "get_attr"):
            if not isinstance(region, fx.GraphModule) or not _has_collective(region):
                continue
            if any(a in sized for a in inputs):  # (which of the region's arguments is which: all or none, here)
                return True
            if _exchanges_sized(region, set()):
                return True
    return False


def _is_sized(node: fx.Node, sized: set[fx.Node]) -> bool:
    """Whether `node`'s shape may depend on the inputs' (module docstring)."""
    tensors = [a for a in node.all_input_nodes if a.op != "get_attr"]
    if any(a in sized for a in tensors):
        return True
    if node.op == "call_function" and _is_collective(node.target):
        return False  # its size is its operand's times the group's, which the parameters fix
    # a lowered graph's nodes carry no shapes: what keeps the element count is known by its op
    return not tensors or _op_name(node) not in _KEEP_NUMEL


# ops whose output has as many elements as their (first) input: layouts, dtypes, copies. By name: the lowered
# graph calls them as ATen overloads, tensor methods or torch functions (`codegen.python_calls`)
_KEEP_NUMEL = frozenset({"permute", "t", "transpose", "view", "reshape", "_unsafe_view", "_to_copy", "to", "clone",
                         "detach", "alias", "lift_fresh_copy", "contiguous", "view_as", "reshape_as", "numpy_T"})


def _op_name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return node.target
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target.overloadpacket.__name__
    return getattr(node.target, "__name__", None)


def _has_collective(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and _is_collective(n.target) for n in gm.graph.nodes)


def _is_collective(target: object) -> bool:
    return getattr(target, "__module__", None) in _EXCHANGING_MODULES
