"""Start collectives on gradient-free values as early as their inputs allow, wait where they are used.

The traced graph computes a loss's token count (`sum(labels != -100)`) right
before the division that needs it, so its all-reduce would stop every rank at
the end of forward until the slowest one arrives. The count depends only on the
labels: codegen emits it as `all_reduce_start` + `wait` (`runtime.collectives`; the
labels themselves, when a plan gathers them, as `all_gather_start` + `wait_all_gather`),
and this pass moves the start, with the ops computing its input, to just after
those ops' own inputs (for the count: right after the labels placeholder). The
collective then runs in the background during the forward, and the `wait`
stays where the value is first needed.

Only plain ATen ops and views are moved (no checkpointed region, no random op,
no collective): moving them changes no value, since each still runs after its
inputs and before its users.
"""
from __future__ import annotations

import torch
from torch import fx

from autopar.runtime import collectives as C

_STARTS = (C.all_reduce_start, C.all_gather_start)


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
    return moved


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
