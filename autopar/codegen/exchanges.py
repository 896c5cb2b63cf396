"""Whether a lowered graph moves data computed from its inputs between ranks.

Such a graph's collectives have the sizes of this rank's inputs, so every rank must
feed inputs of the same shapes (`runtime.same_inputs` checks it each forward). A graph
that does not (data parallel: only gradients leave the rank, in the gradient sync, and
the loss's scalars) runs on any shapes each rank is given.

A node computes from the inputs when one of its arguments is a user input or such a
node. It exchanges them when it calls one of the runtime's collectives (or the
vocabulary-parallel or synchronised batch-norm functions, which hold collectives),
or runs a recomputed region holding one. A parameter stored sharded and gathered
where it is used computes from no input: that gather has the same size on every
rank, whatever the batch. The loss's all-reduces (`runtime.deferred_loss`) move
scalars and are not counted.
"""
from __future__ import annotations

from torch import fx

from autopar.runtime import collectives, sync_batch_norm, vocab_parallel

# the runtime's modules whose functions move data between ranks (the loss's scalars live in `deferred_loss`)
_EXCHANGING_MODULES = frozenset(m.__name__ for m in (collectives, vocab_parallel, sync_batch_norm))


def exchanges_activations(gm: fx.GraphModule, num_state_inputs: int) -> bool:
    """Whether `gm` (its first `num_state_inputs` arguments parameters and buffers, the rest the user's inputs)
    sends or receives data computed from the user's inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    from_inputs = set(placeholders[num_state_inputs:])
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or not any(a in from_inputs for a in node.all_input_nodes):
            continue
        from_inputs.add(node)
        if _exchanges(gm, node):
            return True
    return False


def _exchanges(gm: fx.GraphModule, node: fx.Node) -> bool:
    """`node` calls a collective, or a graph (a recomputed region, passed as an attribute) that calls one."""
    if node.op == "call_function" and _is_collective(node.target):
        return True
    regions = [getattr(gm, a.target) for a in node.all_input_nodes if a.op == "get_attr"]
    return any(isinstance(r, fx.GraphModule) and any(n.op == "call_function" and _is_collective(n.target)
                                                     for n in r.graph.nodes) for r in regions)


def _is_collective(target: object) -> bool:
    return getattr(target, "__module__", None) in _EXCHANGING_MODULES
