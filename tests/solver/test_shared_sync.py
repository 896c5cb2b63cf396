"""A parameter several nodes read (tied embeddings) has its gradient synced once: priced once, the largest part."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.profiler import profile
from autopar.solver.cost import bucketed_all_reduce_s
from autopar.solver.anytime import solve_problem
from autopar.solver.evaluate import evaluate
from autopar.solver.mesh import make_mesh
from autopar.solver.problem import Assignment, Node, Option, Problem, SharedSync, build_problem
from autopar.solver.strategies import enumerate_strategies
from tests.codegen.harness import trace_model
from tests.codegen.plans import load_zoo
from tests.solver.test_ilp import brute_force


def _tied(shared: bool) -> Problem:
    """A weight read by a lookup and a projection. Data parallel ('dp') pays the weight's gradient sync in each
    reader's price, 1 ms; 'local' (every rank computes everything) syncs nothing but costs 0.6 ms more compute.
    Priced per reader, dp costs 2 ms against local's 1.2 ms; synced once, 1 ms."""
    w = Node("w", (Option("R"),))
    readers = tuple(Node(n, (Option("dp", compute_s=1e-3, comm_s=1e-3), Option("local", compute_s=1.6e-3)))
                    for n in ("lookup", "proj"))
    syncs = (SharedSync("w", ((1, (1e-3, 0.0)), (2, (1e-3, 0.0)))),) if shared else ()
    return Problem((w, *readers), (), None, shared_syncs=syncs)


def test_a_tied_weight_pays_its_sync_once():
    per_reader, once = _tied(False), _tied(True)
    assert solve_problem(per_reader).assignment.choice == (0, 1, 1)
    sol = solve_problem(once)
    assert sol.assignment.choice == (0, 0, 0)
    assert sol.time.total_s == pytest.approx(3e-3) == evaluate(once, sol.assignment)[1].total_s
    # one reader data parallel, the other local: that one's part is the whole sync
    assert evaluate(once, Assignment.of([0, 0, 1]))[1].comm_s == pytest.approx(1e-3)
    assert brute_force(once)[0] == pytest.approx(sol.time.total_s)


def test_gpt2s_tied_embedding_is_priced_as_one_all_reduce():
    """gpt2-tiny on 4 data-parallel ranks: `wte` is read by the token lookup and by the logits' matmul, each of
    whose prices has its gradient's all-reduce; the runtime sends the summed gradient once (`GradSync` holds one
    entry per parameter). The data-parallel plan is priced one bucketed all-reduce of wte's 64 KB less than the
    two readers' parts add up to."""
    model, sample = load_zoo("gpt2").build(batch_size=8, seq_len=16, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    mesh = make_mesh(4, (4,), "cpu")
    built = build_problem(traced, profile(traced).evaluate(), mesh, enumerate_strategies(traced, mesh), None, grouped=False)
    problem = built.problem
    wte = next(s for s in problem.shared_syncs if s.param == "p_transformer_wte_weight")
    assert sorted(problem.nodes[v].name for v, _ in wte.terms) == ["embedding", "mm"]
    sol = solve_problem(problem)
    assert all(problem.nodes[v].options[sol.assignment.choice[v]].label.endswith("S(0)") for v, _ in wte.terms)  # data parallel
    wte_bytes = model.transformer.wte.weight.numel() * 4
    per_reader = evaluate(dataclasses.replace(problem, shared_syncs=()), sol.assignment)[1].comm_s
    assert per_reader - sol.time.comm_s == pytest.approx(bucketed_all_reduce_s(wte_bytes, mesh, (0,)))
