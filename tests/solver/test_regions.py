"""Checkpoint regions as the solver prices them: a layer's recomputed work split by kept work costs a region more."""
from __future__ import annotations

import random

import pytest
import torch
from torch import fx

from autopar.solver.anytime import solve_problem
from autopar.solver.evaluate import checkpoint_regions, evaluate
from autopar.solver.problem import Assignment, Node, Option, Problem, RegionCut
from autopar.solver.regions import region_cuts, region_runs
from tests.solver.test_ilp import brute_force

aten = torch.ops.aten
MB = 2**20


def _block() -> tuple[list[fx.Node], dict[str, str]]:
    """A GPT-2 block's shape: norm -> attention -> projection -> norm -> fc -> gelu, all matmuls real work."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    nodes: dict[str, fx.Node] = {}
    for name, target, args in (("ln1", aten.relu.default, (x,)), ("qkv", aten.mm.default, ("ln1", w)),
                               ("attn", aten.tanh.default, ("qkv",)), ("proj", aten.mm.default, ("attn", w)),
                               ("ln2", aten.relu.default, ("proj",)), ("fc", aten.mm.default, ("ln2", w)),
                               ("gelu", aten.gelu.default, ("fc",))):
        nodes[name] = g.call_function(target, tuple(nodes.get(a, a) for a in args))
        nodes[name].name = name
    g.output(nodes["gelu"])
    ops = [n for n in g.nodes if n.op == "call_function"]
    return ops, {n.name: "h.0" for n in ops}


def test_two_recomputed_ops_with_kept_real_work_between_them_make_two_regions():
    """attn and gelu recomputed, the projection, norm and fc kept: the kept work reads attn's run and gelu reads
    it, so codegen ends the run there (a cut). attn and proj have nothing between them: one region."""
    ops, layer = _block()
    units = [["attn"], ["proj"], ["gelu"]]
    cuts = region_cuts(ops, units, layer)
    assert (0, 2) in cuts and (1, 2) in cuts  # gelu reads fc, which reads proj: kept work between
    assert (0, 1) not in cuts  # proj reads attn directly: taken into its region


def _random_ops(rng: random.Random, size: int) -> list[fx.Node]:
    """`size` ops of one layer, each reading one or two earlier values: real work, copies, elementwise ops,
    random draws (never deferred) and in-place writes (never deferred), in graph order."""
    g = fx.Graph()
    values = [g.placeholder("x"), g.placeholder("w")]
    kinds = [(aten.mm.default, 2), (aten.relu.default, 1), (aten.t.default, 1), (aten.add.Tensor, 2),
             (aten.rand_like.default, 1), (aten.relu_.default, 1), (aten.cat.default, None)]
    for k in range(size):
        target, arity = rng.choice(kinds)
        picked = [rng.choice(values) for _ in range(arity or 2)]
        node = g.call_function(target, (picked,) if arity is None else tuple(picked))
        node.name = f"op{k}"
        values.append(node)
    g.output(values[-1])
    return [n for n in g.nodes if n.op == "call_function"]


def test_cuts_match_the_runs_over_the_whole_layer():
    """`region_cuts` scans only the span between a pair's first and last recomputed node: on random layers
    it finds the pairs whose runs over the whole layer outnumber either unit's alone."""
    rng = random.Random(0)
    for _ in range(20):
        ops = _random_ops(rng, 40)
        layer = {n.name: "h.0" for n in ops}
        origin = {n.name: n.name for n in ops}
        names = [n.name for n in ops]
        units = [rng.sample(names, rng.randint(1, 3)) for _ in range(8)]

        def count(recompute: set[str]) -> int:
            return len(region_runs(ops, recompute, origin, layer))  # noqa: B023 (called in this iteration)
        want = [(i, j) for i in range(len(units)) for j in range(i + 1, len(units))
                if count({*units[i], *units[j]}) > max(count(set(units[i])), count(set(units[j])))]
        assert region_cuts(ops, units, layer) == want
        assert want  # the random layers do split somewhere


def _chain(region_s: float, budget_mb: float) -> Problem:
    """attn, mid and gelu of one layer, each saving 10 MB (recompute 1, 2 and 1 ms), beside a 30 MB scratch (the
    step's largest transient, whatever is rebuilt) and 100 MB of parameters. attn and gelu fall into two regions
    unless mid (on the path between them) is recomputed too."""
    p = Node("p", (Option("p", compute_s=1e-3, param_bytes=100 * MB, temp_bytes=30 * MB),))
    attn, mid, gelu = (Node(n, (Option(n, compute_s=1e-3, recompute_s=r, saved_bytes=10 * MB),), recomputable=True, region="h.0")
                       for n, r in (("attn", 1e-3), ("mid", 2e-3), ("gelu", 1e-3)))
    return Problem((p, attn, mid, gelu), (), budget_mb * MB, region_cuts=(RegionCut(1, 3, (2,), (2,)),), region_s=region_s)


def test_a_split_layer_pays_a_region_more_and_joining_it_can_win():
    """Under 145 MB two of the three must be recomputed. attn + gelu is the cheapest recompute (2 ms) but opens two
    regions: at 0.5 ms a region 3 ms, against attn + mid (3 ms + one region, 3.5 ms). At 2 ms a region
    attn + gelu costs 6 ms and attn + mid 5 ms. A node recomputed on the path joins the regions: all three
    fit in one."""
    cheap, dear = _chain(0.5e-3, 145), _chain(2e-3, 145)
    assert checkpoint_regions(cheap, (False, True, False, True)) == 2
    assert checkpoint_regions(cheap, (False, True, True, True)) == 1
    assert solve_problem(cheap).assignment.recompute == (False, True, False, True)
    assert solve_problem(cheap).time.recompute_s == pytest.approx(3e-3)
    sol = solve_problem(dear)
    assert sol.assignment.recompute in ((False, True, True, False), (False, False, True, True))
    assert sol.time.recompute_s == pytest.approx(5e-3) == evaluate(dear, sol.assignment)[1].recompute_s


def test_a_region_opened_between_a_pair_leaves_its_first_node_behind():
    """a, b, c in graph order; a->b and a->c and b->c are cuts. With all three recomputed, b opens a region, so a
    is no longer in c's run and only b->c can open another: 3 regions, not 4; with b kept, a->c opens one."""
    nodes = tuple(Node(n, (Option(n, recompute_s=1e-3, saved_bytes=MB),), recomputable=True, region="h.0") for n in "abc")
    problem = Problem(nodes, (), None, region_cuts=(RegionCut(0, 1, (), ()), RegionCut(0, 2, (), (1,)), RegionCut(1, 2, (), ())),
                      region_s=1e-3)
    assert checkpoint_regions(problem, (True, True, True)) == 3
    assert checkpoint_regions(problem, (True, False, True)) == 2
    assert checkpoint_regions(problem, (False, True, True)) == 2


def _random_layer(rng: random.Random) -> Problem:
    n = rng.randint(3, 6)
    nodes = tuple(Node(f"n{v}", (Option("o", compute_s=1e-3, recompute_s=rng.uniform(0, 2e-3), saved_bytes=rng.uniform(1, 10) * MB),),
                       recomputable=True, region=rng.choice(["h.0", "h.0", "h.1"])) for v in range(n))
    cuts = []
    for v in range(n):  # by graph order of the second, as `build_problem` lists them
        for u in range(v):
            if nodes[u].region == nodes[v].region and rng.random() < 0.5:
                between = tuple(m for m in range(u + 1, v) if nodes[m].region == nodes[u].region)
                cuts.append(RegionCut(u, v, tuple(m for m in between if rng.random() < 0.5), between))
    saved = sum(node.options[0].saved_bytes for node in nodes)
    scratch = Node("scratch", (Option("s", temp_bytes=saved),))  # a transient no rebuild exceeds: recompute frees memory
    return Problem(nodes + (scratch,), (), saved + rng.uniform(0.2, 0.9) * saved, region_cuts=tuple(cuts),
                   region_s=rng.uniform(0.2e-3, 2e-3))


def test_random_layers_price_their_regions_as_brute_force_does():
    """The ILP's region rows (`cut_*`) against `evaluate` over every recompute set: the same best step time."""
    rng = random.Random(3)
    split = 0
    for _ in range(30):
        problem = _random_layer(rng)
        best_s, best = brute_force(problem)
        sol = solve_problem(problem)
        assert sol.time.total_s == pytest.approx(best_s, rel=1e-6, abs=1e-9)
        assert evaluate(problem, sol.assignment)[1].total_s == pytest.approx(sol.time.total_s, rel=1e-6, abs=1e-9)
        layers = len({node.region for node, r in zip(problem.nodes, best.recompute) if r})
        split += checkpoint_regions(problem, best.recompute) > layers
    assert split >= 3  # some optima do pay for a split layer
