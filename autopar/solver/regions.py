"""Which nodes one checkpoint region takes: the rule codegen outlines by and the solver prices by.

Codegen (`codegen.recompute`) outlines each run `region_runs` finds into a checkpoint region. The
solver charges a region's fixed cost (`Mesh.recompute_region_s`) per layer with recomputed work, and
once more where `region_cuts` says the layer's recomputed work falls into two regions
(`evaluate.checkpoint_regions`): GPT-2 with its attention and MLP activation recomputed and the projections
and norm between them kept makes two regions a layer, priced as one before. Kept here, upstream of
codegen, so that both read the same rule.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
from torch import fx

from autopar.runtime import rng


def layer_key(path: str) -> str:
    """The repeated layer a module path belongs to: up to its first numeric part ('transformer.h.3'), else its first part."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


# Ops that only alias or copy their input: free to run again, so a region may take them in (see `region_runs`).
_COPY_OPS = frozenset({"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "squeeze", "unsqueeze",
                       "slice", "select", "alias", "clone", "contiguous", "split", "split_with_sizes", "unbind", "detach"})


def is_copy(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and packet.__name__ in _COPY_OPS


def is_cheap(node: fx.Node) -> bool:
    """A copy, an elementwise op (torch's `pointwise` tag) or a concatenation: one pass over its output to
    run again. Never an op that draws random numbers or writes its input (run again, it would write twice)."""
    if is_copy(node):
        return True
    if node.op != "call_function" or draws_random(node) or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target._schema.is_mutable:
        return False
    return torch.Tag.pointwise in node.target.tags or node.target is torch.ops.aten.cat.default


def draws_random(node: fx.Node) -> bool:
    return node.target is rng.random_op or (
        isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags)


def _deferrable(node: fx.Node) -> bool:
    """Kept work that may run later than its place in the graph: it draws no random numbers (their order is
    part of the result) and writes none of its inputs (a later reader would see the old value). Our
    collectives never write their input (`runtime.comm`)."""
    if node.op != "call_function" or draws_random(node):
        return False
    return not (isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable)


@dataclass(frozen=True)
class _Facts:
    """What `region_runs` asks of a node, found once (a layer's cuts scan its nodes once per pair of units)."""

    call: bool
    deferrable: bool
    cheap: bool
    inputs: tuple[fx.Node, ...]


def _facts(node: fx.Node) -> _Facts:
    return _Facts(node.op == "call_function", _deferrable(node), is_cheap(node), tuple(node.all_input_nodes))


def region_runs(nodes: Iterable[fx.Node], recompute: set[str], origin: Mapping[str, str], layer: Mapping[str, str],
                facts: Mapping[fx.Node, _Facts] | None = None) -> list[tuple[list[fx.Node], list[fx.Node]]]:
    """Maximal runs (graph order) of recomputed nodes of one layer, bridging cheap work between them
    and stepping over kept nodes; each with the kept nodes to move after the region's call.

    A view or a dropout-free clone the plan keeps sits between most recomputed ops (a linear is
    `t(weight)` then `addmm`), and kept work interleaves with recomputed work (LLaMA's up projection
    between `silu(gate)` and the product). Cutting the run there would make the run's output so far
    the next region's input, which checkpoint saves: the region would free nothing of what the solver
    priced it to free (`Problem.recompute_with` assumes a layer's recomputed ops share a region), and pay a region's
    fixed cost per op (measured: gpt2-tiny's 22 recomputed ops made 13 regions and saved no memory).
    So a kept node that reads nothing of the run stays outside it (the region is called where its last
    node was, after it: `outline`); cheap work on the run's values (a copy, an elementwise op, a
    concatenation: `is_cheap`) is taken into the region when a recomputed node of the same layer
    follows, and run again in backward; other kept work that reads the run (the reduce-scatter of a
    row-parallel output whose consumer is kept) is deferred: moved after the region's call, with the
    kept work that reads it. The run ends only where a recomputed node reads deferred work, or at kept
    work that cannot be deferred (`_deferrable`: it draws random numbers or writes its input). The solver never recomputes an
    op that saves nothing (it would free nothing), yet such ops sit inside recomputed work: LLaMA's
    rotary embedding (`q * cos`, `cat(-x2, x1)`) cut a recomputed attention into four regions
    (measured on llama-tiny's tightest plan: 10 regions made 4, 144 -> 138 ms a step); the reduce-scatters
    of its row-parallel projections cut it into 11 regions for 2 layers and the head.

    `facts`: each node's `_Facts`, found once by a caller that scans the nodes many times (`region_cuts`)."""
    runs: list[tuple[list[fx.Node], list[fx.Node]]] = []
    current: list[fx.Node] = []
    bridge: list[fx.Node] = []  # cheap work after the run's last recomputed node, kept only if the run goes on
    deferred: dict[fx.Node, None] = {}  # kept work that reads the run (or deferred work), in graph order
    members: set[fx.Node] = set()  # current and bridge
    moved = 0  # how many of `deferred` precede the run's last recomputed node: those move after the region's call

    def end_run() -> None:
        runs.append((current, list(deferred)[:moved]))

    for node in nodes:
        fact = facts[node] if facts is not None else _facts(node)
        traced = origin.get(node.name)
        reads_deferred = not deferred.keys().isdisjoint(fact.inputs)
        if fact.call and traced in recompute:
            if current and (reads_deferred or layer.get(traced) != layer.get(origin[current[-1].name])):
                # one region per layer: backward rebuilds one layer's activations at a time
                end_run()
                current, deferred, members = [], {}, set()
            elif current:
                current.extend(bridge)
            bridge = []
            current.append(node)
            members.add(node)
            moved = len(deferred)
            continue
        if not current:
            continue  # no run to extend, end or defer work after
        kept_work = fact.deferrable
        if kept_work and not reads_deferred and members.isdisjoint(fact.inputs):
            continue  # independent kept work: stays before the region's call
        if not reads_deferred and fact.cheap and layer.get(traced) == layer.get(origin[current[-1].name]):
            bridge.append(node)  # cheap work on the run's values: taken in if the run goes on
            members.add(node)
            continue
        if kept_work:
            deferred[node] = None  # reads the run (or deferred work): runs after the region's call
            continue
        end_run()
        current, bridge, deferred, members = [], [], {}, set()
    if current:
        end_run()
    return runs


def region_cuts(nodes: Sequence[fx.Node], units: Sequence[Iterable[str]], layer: Mapping[str, str]) -> list[tuple[int, int]]:
    """Pairs (i, j), i < j, of `units` (names of `nodes`, one layer's in graph order, recomputed together:
    a solver class's members) that make more checkpoint regions together than either alone: recomputed
    with no unit between them, they cost a region more than one layer's. GPT-2's attention and its
    MLP activation: the kept projections and layer norm between them read the first run and feed the
    second, so `region_runs` ends the first there. A rule on the traced graph: the collectives codegen
    adds between them (a tensor-parallel plan's) may cut a run this does not see."""
    origin = {n.name: n.name for n in nodes}
    facts = {n: _facts(n) for n in nodes}
    position = {n.name: k for k, n in enumerate(nodes)}
    spans = [(min(position[name] for name in unit), max(position[name] for name in unit)) for unit in units]

    def count(recompute: set[str], first: int, last: int) -> int:
        # Before a run's first recomputed node and after its last, a node neither starts nor splits a run:
        # scanning only between them counts the same runs (an RNN unrolled in one layer has hundreds of units).
        return len(region_runs(nodes[first:last + 1], recompute, origin, layer, facts))

    alone = [count(set(unit), *span) for unit, span in zip(units, spans)]
    cuts = []
    for i, first in enumerate(units):
        for j in range(i + 1, len(units)):
            span = (min(spans[i][0], spans[j][0]), max(spans[i][1], spans[j][1]))
            if count({*first, *units[j]}, *span) > max(alone[i], alone[j]):
                cuts.append((i, j))
    return cuts
