"""Repeated pure ops merged: common-subexpression elimination of the traced graph.

Every later stage plans, prices and runs each node, so a node that repeats an
earlier one costs three times: the solver counts its bytes, the profiler its
time, and the generated module runs it (an op call and, in training, an autograd
node). Export leaves such repeats: decomposed cross-entropy computes
`ne(labels, -100)` three times, and a BERT layer views its input as
(batch * seq, hidden) once per q, k, v projection.

The elimination is torch.fx's `CSEPass`, run with every op that draws random
numbers (`Tag.nondeterministic_seeded`) or mutates an argument banned, so only
pure computations merge. (Export's other no-op, `clone` for `Dropout(p=0)`, is
kept: `nodes.is_dropout_clone` marks it, the profiler prices it as a view and
codegen runs it as `contiguous`.)
"""
from __future__ import annotations

import logging

import torch
from torch import fx
from torch.fx.passes.dialect.common.cse_pass import CSEPass

log = logging.getLogger(__name__)


def eliminate_common_subexpressions(gm: fx.GraphModule) -> int:
    """Merge repeated pure ops of `gm` in place; returns how many nodes went."""
    before = len(gm.graph.nodes)
    result = CSEPass(banned_ops=_impure_ops(gm.graph))(gm)
    if not result.modified:
        return 0
    gm.graph = result.graph_module.graph  # node names and meta are kept: the export signature still matches
    gm.recompile()
    removed = before - len(gm.graph.nodes)
    log.info("tracer: %d repeated pure ops merged", removed)
    return removed


def _impure_ops(graph: fx.Graph) -> set[torch._ops.OpOverloadPacket]:
    """Overload packets of the graph's ops that must never merge: random draws and mutations."""
    banned = set()
    for node in graph.nodes:
        op = node.target
        if isinstance(op, torch._ops.OpOverload) and (
            torch.Tag.nondeterministic_seeded in op.tags or op._schema.is_mutable
        ):
            banned.add(op.overloadpacket)
    return banned
