"""Start collectives on gradient-free values as early as their inputs allow, wait where they are used.

A value without gradient that a plan reduces or gathers (labels a plan needs
whole, a token count) is emitted as `all_reduce_start` + `wait`,
`all_gather_start` + `wait_all_gather` (`runtime.collectives`), or for a mean
loss's count, `start_count`, waited by the loss's backward (`runtime.deferred_loss`). It usually
depends on the inputs alone, yet sits where the traced graph computes it, near
the loss: a blocking collective there would stop every rank at the end of the
forward until the slowest arrives. This pass moves each start, with the ops
computing its input, to just after those ops' own inputs (for labels: right
after their placeholder). The collective then runs in the background during
the forward, and each wait moves to just before the value's first use.

Only plain ATen ops and views are moved (no checkpointed region, no random op,
no collective): moving them changes no value, since each still runs after its
inputs and before its users.
"""
from __future__ import annotations

import torch
from torch import fx

from autopar.runtime import collectives as C

_STARTS = (C.all_reduce_start, C.all_gather_start, C.start_count)
_WAITS = (C.wait, C.wait_all_gather)


def start_collectives_early(graph: fx.Graph) -> int:
    """Hoist every started collective and the chain feeding it; returns how many were moved."""
    moved = 0
    for start in [n for n in graph.nodes if n.op == "call_function" and n.target in _STARTS]:
        chain = _feeding_chain(start)
        if chain is None:
            continue
        index = {n: i for i, n in enumerate(graph.nodes)}
        for node in sorted(chain, key=index.__getitem__):  # producers first, so each lands after its inputs
            if not node.all_input_nodes:
                continue  # a factory op: stays where it is, and its users after it
            latest = max(node.all_input_nodes, key=index.__getitem__)
            if index[latest] + 1 < index[node]:
                latest.append(node)
                index = {n: i for i, n in enumerate(graph.nodes)}
        moved += 1
    for wait in [n for n in graph.nodes if n.op == "call_function" and n.target in _WAITS]:
        _sink_to_first_user(graph, wait)
    return moved


def _sink_to_first_user(graph: fx.Graph, node: fx.Node) -> None:
    """Move `node` to just before its first user: a wait emitted where its value was made (a
    placeholder's reshard) then blocks only where the value is needed."""
    if not node.users:
        return
    index = {n: i for i, n in enumerate(graph.nodes)}
    first = min(node.users, key=index.__getitem__)
    if index[first] > index[node] + 1:
        first.prepend(node)


def _feeding_chain(start: fx.Node) -> list[fx.Node] | None:
    """`start` and the call_function nodes it transitively reads, back to placeholders and attributes;
    None when the chain holds something that must not move."""
    chain, stack = [], [start]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen or node.op in ("placeholder", "get_attr"):
            continue
        seen.add(node)
        if node.op != "call_function" or not _movable(node, start):
            return None
        chain.append(node)
        stack.extend(node.all_input_nodes)
    return chain


def _movable(node: fx.Node, start: fx.Node) -> bool:
    if node is start:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False  # collectives, checkpointed regions, Python helpers
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags
