"""ZeRO parameters re-gathered in backward (FSDP's reshard-after-forward), with torch's selective checkpointing.

A ZeRO parameter is stored as a shard and all-gathered to its use spec. If the
gathered tensor simply flowed into its consumer, the consumer would save it for
backward (mm saves both inputs) and the full parameter would stay alive from
forward to backward: ZeRO would save nothing. So each consumer gets its own
copy of the parameter's *chain* (the gather and the ops that depend on ZeRO
parameters only: edge collectives, permutes, casts) placed right before it, and

- a consumer the plan recomputes takes its chain into its recompute region
  (the chain's nodes inherit the consumer's origin), so the region's saved input
  is the shard and recomputation re-gathers;
- any other consumer and its chain become a region run under torch's non-reentrant
  `checkpoint` with early stop: what the region saves is its inputs (the shard and
  the activation the consumer saves anyway); backward re-runs the region only
  until every tensor the consumer's backward needs exists again, i.e. the gather
  and the permute/cast chain but not the consumer itself when the consumer does
  not save its own output (mm, addmm, embedding). This is FSDP's re-gather (one
  more all-gather per use in backward) with no extra compute.

  Selective checkpointing (`create_selective_checkpoint_contexts`) with a policy
  saving the consumer's outputs was tried and measured worse: it keeps outputs that
  nothing else saves (each c_proj output of GPT-2, the logits), 1.4 MB per rank on
  the test GPT-2 of `tests/codegen/test_memory.py`, more than the gathers it freed.

A parameter used by several consumers (tied embeddings) is gathered once per use.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.utils.checkpoint as ckpt
from torch import fx, nn

from autopar.codegen.recompute import outline


def regathered(region: fx.GraphModule, *args):
    """Run a ZeRO consumer region: its parameter gathers re-run in backward (a named call in `gm.code`)."""
    return ckpt.checkpoint(region, *args, use_reentrant=False, early_stop=True)


def _writes_back(node: fx.Node) -> bool:
    """A write of the forward's new value into a buffer or frozen parameter (`lower.emit_buffer_updates`)."""
    return node.op == "call_function" and node.target is torch.ops.aten.copy_.default


def _chain(graph: fx.Graph, roots: set[fx.Node]) -> set[fx.Node]:
    """Nodes computed from ZeRO parameters alone (graph order is topological, so one pass suffices). A
    write-back is not one even so (a momentum encoder moved toward a ZeRO query encoder): it consumes them."""
    chain = set(roots)
    for node in graph.nodes:
        if _writes_back(node):
            continue
        if node.op == "call_function" and node.all_input_nodes and all(a in chain for a in node.all_input_nodes):
            chain.add(node)
    return chain


def _ancestors(node: fx.Node, chain: set[fx.Node], roots: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [a for a in node.all_input_nodes if a in chain and a not in roots]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if a in chain and a not in roots)
    return seen


def regather_zero_params(graph: fx.Graph, root: nn.Module, zero_params: Iterable[fx.Node], recompute: set[str],
                         origin: dict[str, str]) -> int:
    """Rewrite `graph` so no gathered ZeRO parameter outlives its consumer's forward; returns the regions made."""
    roots = set(zero_params)
    if not roots:
        return 0
    chain = _chain(graph, roots)
    order = {n: i for i, n in enumerate(graph.nodes)}
    consumers = [n for n in graph.nodes if n not in chain and n.op == "call_function" and any(a in chain for a in n.all_input_nodes)]
    regions = []
    for c in consumers:
        needed = sorted(_ancestors(c, chain, roots), key=order.__getitem__)
        env: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(c):
            for n in needed:
                env[n] = graph.node_copy(n, lambda a: env.get(a, a))
                if c.name in origin:
                    origin[env[n].name] = origin[c.name]
        c.args, c.kwargs = fx.map_arg((c.args, c.kwargs), lambda a: env.get(a, a))
        # a write-back saves nothing for backward, and a region re-run there would write again
        if needed and origin.get(c.name) not in recompute and not _writes_back(c):
            regions.append([env[n] for n in needed] + [c])
    for n in sorted(chain - roots, key=order.__getitem__, reverse=True):
        if not n.users:  # every consumer has its own copy now (the graph output may still use the original)
            graph.erase_node(n)
    for i, run in enumerate(regions):
        outline(graph, root, run, f"zero_{i}", regathered)
    return len(regions)

