"""Keeping the ILP small: merge followers into producers, tie repeated blocks.

Followers: a node with a single input (views, single-input elementwise ops,
getitem, dropout's clone, ...) whose strategies can simply follow its producer
joins the producer's cluster: for every option of the cluster there is a
strategy of the follower that takes the producer's output spec as it is, so no
resharding is ever needed between them. A cluster's options are its leader's
strategies; each member's strategy is fixed by the option.

Repeated blocks: nodes whose module path (or parameter FQN) has an integer
component (`transformer.h.3.attn`) belong to block ("transformer.h", 3). Blocks
with the same prefix and the same signature (op sequence, shapes, strategy
counts and wiring within the block) are tied: the clusters at the same position
in each copy form one class, which the ILP decides once. A 96-layer model then
has as many ILP nodes as a 1-layer one plus the head and tail.

Per layer (`group(..., per_layer=True)`): each family's copies are tied in runs of
1, 2, 4, ... layers (`layer_runs`), so that any number of its layers, from none to
all, can take one set of decisions and the rest another: a budget that needs 10 of
32 layers recomputed is met with 10, not 32. A 96-layer model then has as many ILP
nodes as 7 copies of a layer plus the head and tail.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from torch import fx

from autopar.solver.spec import Partial, Replicate, Shard, Strategy
from autopar.solver.strategies import strategy_inputs
from autopar.tracer import TracedGraph, module_path, output_vals

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cluster:
    members: tuple[str, ...]  # leader first, then followers in graph order
    choices: tuple[tuple[int, ...], ...]  # per option (= leader strategy index): each member's strategy index

    @property
    def leader(self) -> str:
        return self.members[0]


@dataclass(frozen=True)
class Grouping:
    clusters: tuple[Cluster, ...]
    cluster_of: Mapping[str, int]  # node name -> cluster index
    classes: tuple[tuple[int, ...], ...]  # tied class -> its clusters (the first is the representative)
    class_of: tuple[int, ...]  # cluster index -> class index


def _kind(p: object) -> type:
    return Shard if isinstance(p, Shard) else Partial if isinstance(p, Partial) else Replicate


def _by_input(strategies: tuple[Strategy, ...]) -> dict:
    """Single-input strategies indexed by their input spec (indices in order)."""
    out: dict = {}
    for k, s in enumerate(strategies):
        if len(s.input_specs) == 1:
            out.setdefault(s.input_specs[0], []).append(k)
    return out


def _follow(strategies: tuple[Strategy, ...], by_input: dict, spec) -> int | None:
    """Index of the strategy taking `spec` unchanged; prefer one that keeps each axis' placement kind."""
    matching = by_input.get(spec, ())
    for k in matching:
        out = strategies[k].output_specs[0] if strategies[k].output_specs else None
        if out is not None and all(_kind(a) is _kind(b) for a, b in zip(out.placements, spec.placements)):
            return k
    return matching[0] if matching else None


def merge_followers(traced: TracedGraph, strategies: Mapping[str, tuple[Strategy, ...]]) -> tuple[list[Cluster], dict[str, int]]:
    clusters: list[Cluster] = []
    cluster_of: dict[str, int] = {}
    # per node: its strategy index under each option of its cluster
    member_choice: dict[str, tuple[int, ...]] = {}
    for node in traced.graph.nodes:
        if node.name not in strategies:
            continue  # the output node
        own = strategies[node.name]
        inputs = strategy_inputs(node) if node.op == "call_function" else ()
        if len(inputs) == 1 and inputs[0][0].name in cluster_of:
            producer, out_idx = inputs[0]
            c = cluster_of[producer.name]
            prod_strats = strategies[producer.name]
            by_input = _by_input(own)
            picks = [_follow(own, by_input, prod_strats[k].output_specs[out_idx]) for k in member_choice[producer.name]]
            if all(p is not None for p in picks):
                old = clusters[c]
                clusters[c] = Cluster(old.members + (node.name,), tuple(ch + (p,) for ch, p in zip(old.choices, picks)))
                cluster_of[node.name] = c
                member_choice[node.name] = tuple(picks)
                continue
        cluster_of[node.name] = len(clusters)
        clusters.append(Cluster((node.name,), tuple((k,) for k in range(len(own)))))
        member_choice[node.name] = tuple(range(len(own)))
    return clusters, cluster_of


def block_key(traced: TracedGraph, node: fx.Node) -> tuple[str, int, str] | None:
    """("transformer.h", 3, "attn.c_attn") for a node of layer 3; None outside repeated blocks."""
    path = traced.param_fqns.get(node.name) or traced.buffer_fqns.get(node.name) or module_path(node)
    parts = path.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1:])
    return None


def _signature(traced: TracedGraph, nodes: list[fx.Node], strategies, clusters: list[Cluster], cluster_of: Mapping[str, int]) -> tuple:
    pos = {n.name: i for i, n in enumerate(nodes)}
    sig = []
    for n in nodes:
        key = block_key(traced, n)
        shapes = tuple(None if v is None else (tuple(v.shape), v.dtype) for v in output_vals(n))
        wiring = tuple((pos.get(p.name, -1), k) for p, k in (strategy_inputs(n) if n.op == "call_function" else ()))
        leader = pos.get(clusters[cluster_of[n.name]].leader, -1)  # -1: led from outside the block
        sig.append((key[2] if key else "", n.op, str(n.target) if n.op != "placeholder" else "", shapes,
                    len(strategies[n.name]), wiring, leader))
    return tuple(sig)


def layer_runs(n: int) -> list[int]:
    """Run lengths summing to `n` whose subsets sum to every count from 0 to n: 1, 2, 4, ... and what is left
    (31 layers: 1, 2, 4, 8, 16; 30: 1, 2, 4, 8, 15)."""
    runs, size = [], 1
    while sum(runs) + size <= n:
        runs.append(size)
        size *= 2
    return runs + ([n - sum(runs)] if n > sum(runs) else [])


def tie_blocks(
    traced: TracedGraph, strategies: Mapping[str, tuple[Strategy, ...]], clusters: list[Cluster], cluster_of: Mapping[str, int],
    per_layer: bool = False,
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Classes of clusters (`Grouping.classes`): each family of repeated blocks tied into one, or with `per_layer`
    into one per run of `layer_runs`."""
    blocks: dict[tuple[str, int], list[fx.Node]] = {}
    for node in traced.graph.nodes:
        key = block_key(traced, node) if node.name in strategies else None
        if key is not None:
            blocks.setdefault(key[:2], []).append(node)
    # signature -> blocks sharing it, in first-seen order (deterministic)
    families: dict[tuple, list[list[fx.Node]]] = {}
    for (prefix, _), nodes in blocks.items():
        families.setdefault((prefix, _signature(traced, nodes, strategies, clusters, cluster_of)), []).append(nodes)
    runs: list[list[list[fx.Node]]] = []  # copies tied together
    for copies in families.values():
        if not per_layer:
            runs.append(copies)
            continue
        start = 0
        for length in layer_runs(len(copies)):
            runs.append(copies[start:start + length])
            start += length
    class_members: dict[int, list[int]] = {}  # representative cluster -> tied clusters
    tied_to: dict[int, int] = {}
    for copies in runs:
        if len(copies) < 2:
            continue
        first = copies[0]
        for i, rep_node in enumerate(first):
            rep = cluster_of[rep_node.name]
            if clusters[rep].leader != rep_node.name:
                continue  # ties go leader to leader; followers come along with their cluster
            for other in copies[1:]:
                c = cluster_of[other[i].name]
                if clusters[c].leader == other[i].name and len(clusters[c].choices) == len(clusters[rep].choices):
                    tied_to[c] = rep
                    class_members.setdefault(rep, [rep]).append(c)
    classes: list[tuple[int, ...]] = []
    class_of = [-1] * len(clusters)
    for c in range(len(clusters)):
        if c in tied_to:
            continue
        class_of[c] = len(classes)
        classes.append(tuple(class_members.get(c, [c])))
    for c, rep in tied_to.items():
        class_of[c] = class_of[rep]
    return tuple(classes), tuple(class_of)


def singletons(traced: TracedGraph, strategies: Mapping[str, tuple[Strategy, ...]]) -> Grouping:
    """No merging or tying: one problem node per graph node (to price arbitrary per-node plans)."""
    names = [n.name for n in traced.graph.nodes if n.name in strategies]
    clusters = tuple(Cluster((n,), tuple((k,) for k in range(len(strategies[n])))) for n in names)
    return Grouping(clusters, {n: i for i, n in enumerate(names)}, tuple((i,) for i in range(len(names))), tuple(range(len(names))))


def group(traced: TracedGraph, strategies: Mapping[str, tuple[Strategy, ...]], per_layer: bool = False) -> Grouping:
    """Merge followers, then tie repeated blocks (`per_layer`: in runs, see the module docstring)."""
    clusters, cluster_of = merge_followers(traced, strategies)
    classes, class_of = tie_blocks(traced, strategies, clusters, cluster_of, per_layer)
    log.debug("cluster: %d nodes -> %d clusters -> %d classes", len(cluster_of), len(clusters), len(classes))
    return Grouping(tuple(clusters), cluster_of, classes, class_of)
