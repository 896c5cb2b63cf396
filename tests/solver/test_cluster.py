"""Follower merging and repeated-block tying on GPT-2 (tiny widths, 2 and 4 layers)."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from tests.zoo import load_zoo
from autopar.profiler import profile
from autopar.solver import fixed_plan, solve
from autopar.solver.cluster import block_key, group
from autopar.solver.mesh import make_mesh
from autopar.solver.strategies import enumerate_strategies
from autopar.tracer import trace

ROOT = Path(__file__).resolve().parents[2]
_CACHE: dict = {}


def gpt(n_layer: int):
    if n_layer not in _CACHE:
        m = load_zoo("gpt2")
        cfg = dataclasses.replace(m.CONFIGS["tiny"], n_layer=n_layer)
        with torch.device("meta"):
            model = m.GPT(cfg).train()
            ids = torch.randint(0, cfg.vocab_size, (4, 32))
        traced = trace(model, (ids, ids))
        _CACHE[n_layer] = (traced, profile(traced))
    return _CACHE[n_layer]


@functools.lru_cache(maxsize=None)
def ample_plan():
    """4-layer GPT's plan on 2x2 without a budget (two tests price it or go below it)."""
    traced, prof = gpt(4)
    return solve(traced, prof, make_mesh(4, (2, 2)), memory_budget_bytes=None)


def test_followers_join_their_producer_and_layers_tie():
    mesh = make_mesh(4, (2, 2))
    sizes = {}
    for n_layer in (2, 4):
        traced, _ = gpt(n_layer)
        g = group(traced, enumerate_strategies(traced, mesh))
        for cl in g.clusters:  # every follower's single input is inside its cluster
            for name in cl.members[1:]:
                node = traced.node(name)
                assert node.op == "call_function"
        views = [n.name for n in traced.graph.nodes if "view" in str(n.target) or "permute" in str(n.target)]
        merged = [v for v in views if g.clusters[g.cluster_of[v]].leader != v]
        # a view stays separate only when some producer spec has no matching view strategy (e.g. Partial)
        assert len(merged) >= 0.6 * len(views), f"only {len(merged)}/{len(views)} views follow their producer"
        sizes[n_layer] = (len(g.cluster_of), len(g.clusters), len(g.classes))
        # every layer's clusters are tied into the same classes
        per_layer = {}
        for c, cl in enumerate(g.clusters):
            key = block_key(traced, traced.node(cl.leader))
            if key and key[0] == "transformer.h":
                per_layer.setdefault(key[1], []).append(g.class_of[c])
        assert len({tuple(v) for v in per_layer.values()}) == 1 and len(per_layer) == n_layer
    assert sizes[4][0] > sizes[2][0] and sizes[4][1] > sizes[2][1]
    assert sizes[4][2] == sizes[2][2]  # 4 layers: as many ILP nodes as 2


def test_tied_and_merged_plan_prices_the_same_as_per_node_pricing():
    traced, prof = gpt(4)
    mesh = make_mesh(4, (2, 2))
    plan = ample_plan()
    per_node = fixed_plan(traced, prof, mesh, {d.node: d.strategy for d in plan.nodes if d.op != "output"},
                          recompute=frozenset(plan.recomputed()), zero_params=frozenset(p.fqn for p in plan.params if p.zero))
    assert per_node.time.total_s == pytest.approx(plan.time.total_s, rel=1e-9)
    assert per_node.memory.total_bytes == pytest.approx(plan.memory.total_bytes, rel=1e-9)
    # tied layers take the same decision: layer 0's and layer 3's qkv projections agree
    by_module = {}
    for d in plan.nodes:
        if d.op == "aten.addmm.default" and d.module.endswith("attn.c_attn"):
            by_module[d.module] = str(d.strategy)
    assert len(by_module) == 4 and len(set(by_module.values())) == 1


def test_memory_bound_tied_plan_fits_and_prices_the_same_per_node():
    # Below the ample-memory plan's need the ILP must ZeRO-shard / recompute; the grouped recompute and
    # ZeRO variables must map back onto every member of every tied copy, priced as per-node pricing does.
    traced, prof = gpt(4)
    mesh = make_mesh(4, (2, 2))
    ample = ample_plan()
    budget = 0.6 * ample.memory.total_bytes
    # what is checked is the pricing of whatever plan is found, not its optimality: a short search
    plan = solve(traced, prof, mesh, memory_budget_bytes=budget, time_limit_s=5.0)
    assert plan.memory.total_bytes <= budget
    assert plan.time.total_s >= ample.time.total_s  # a tighter budget cannot be faster
    assert plan.recomputed() or any(p.zero for p in plan.params)
    per_node = fixed_plan(traced, prof, mesh, {d.node: d.strategy for d in plan.nodes if d.op != "output"},
                          recompute=frozenset(plan.recomputed()), zero_params=frozenset(p.fqn for p in plan.params if p.zero))
    assert per_node.time.total_s == pytest.approx(plan.time.total_s, rel=1e-9)
    assert per_node.memory.total_bytes == pytest.approx(plan.memory.total_bytes, rel=1e-9)
