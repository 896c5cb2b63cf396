"""Golden-answer tests of the joint ILP on hand-built 3-5 node problems.

The reference is brute force: every (option, recompute, ZeRO) combination priced
by `evaluate`, which does not touch PuLP.
"""
from __future__ import annotations

import dataclasses
import itertools
import random

import pulp
import pytest

from autopar.errors import PARALLELIZE_KNOBS, InfeasibleError, SearchTimeoutError
from autopar.solver.backends import _reset_scheduler, make_solver
from autopar.solver import ilp
from autopar.solver import anytime
from autopar.solver.anytime import min_memory, solve_problem
from autopar.solver.ilp import Restrictions, _Model
from autopar.solver.evaluate import evaluate
from autopar.solver.needs import infeasible_error, need_and_budget
from autopar.solver.problem import Assignment, Edge, Node, Option, Problem, ZeroOption

GIB = 2**30
MB = 2**20


def every_assignment(problem: Problem, restrictions: Restrictions = Restrictions()):
    """Every (option, recompute, ZeRO) combination the restrictions allow, with recompute as the ILP pairs it:
    u only with the v that keeps its output (`recompute_with`), never both of u and a reader in another region
    (`region_inputs`)."""
    for choice in itertools.product(*(range(len(node.options)) for node in problem.nodes)):
        if any(v in restrictions.allowed and c not in restrictions.allowed[v] for v, c in enumerate(choice)):
            continue
        rc_ok = [problem.nodes[v].recomputable and problem.nodes[v].options[c].saved_bytes > 0 for v, c in enumerate(choice)]
        z_ok = [problem.nodes[v].options[c].zero is not None for v, c in enumerate(choice)]
        for rc in itertools.product(*([False, True] if ok else [False] for ok in rc_ok)):
            if any(rc[u] and not rc[v] for u, v in problem.recompute_with) or any(rc[u] and rc[v] for u, v in problem.region_inputs):
                continue
            for z in itertools.product(*([False, True] if ok else [False] for ok in z_ok)):
                yield Assignment(choice, rc, z)


def brute_force(problem: Problem, restrictions: Restrictions = Restrictions()):
    """(best time, best assignment) over every combination that fits; None when nothing fits."""
    best = None
    for a in every_assignment(problem, restrictions):
        mem, t = evaluate(problem, a)
        if problem.budget_bytes is not None and mem.total_bytes > problem.budget_bytes * (1 + 1e-9):
            continue
        if best is None or t.total_s < best[0] - 1e-12:
            best = (t.total_s, a)
    return best


def least_memory(problem: Problem) -> float:
    return min(evaluate(problem, a)[0].total_bytes for a in every_assignment(problem))


def dp_vs_tp(bandwidth_bytes_per_s: float, budget_bytes: float | None) -> Problem:
    """y = x @ w on 2 devices. Options: data parallel (x S(0), w R) or tensor parallel (x R, w S(1)).

    w: 1 GiB of fp32 (param + grad + 2 Adam states = 4 GiB replicated); x and y: 256 MiB each.
    """
    w_bytes, act_bytes = 1 * GIB, 256 * MB
    ring = lambda b: b / bandwidth_bytes_per_s  # (n-1)/n * 2 for n=2 all-reduce = 1x bytes
    w = Node("w", (
        Option("R", param_bytes=w_bytes, grad_bytes=w_bytes, optimizer_bytes=2 * w_bytes,
               zero=ZeroOption(factor=2, comm_s=ring(w_bytes) / 2, gathered_bytes=w_bytes)),
        Option("S(1)", param_bytes=w_bytes / 2, grad_bytes=w_bytes / 2, optimizer_bytes=w_bytes),
    ))
    x = Node("x", (Option("S(0)", saved_bytes=act_bytes / 2), Option("R", saved_bytes=act_bytes)))
    mm = Node("mm", (
        Option("DP", compute_s=1.0, saved_bytes=act_bytes / 2, recompute_s=0.3),
        Option("TP", compute_s=1.0, saved_bytes=act_bytes / 2, recompute_s=0.3),
    ), recomputable=True)
    # grad sync: w replicated + mm data parallel = all-reduce of w's grad; TP: all-reduce of x's grad in backward.
    w_mm = Edge.dense(0, 2, [[ring(w_bytes), 0.0], [1e3, 0.0]])  # w S(1) cannot feed DP: huge resharding
    x_mm = Edge.dense(1, 2, [[0.0, ring(act_bytes)], [0.0, 2 * ring(act_bytes)]])
    return Problem((w, x, mm), (w_mm, x_mm), budget_bytes)


def test_ample_memory_slow_links_prefer_data_parallel_without_recompute():
    # Activation-heavy: TP's activation resharding (10 s) dwarfs DP's 0.1 s gradient all-reduce.
    p = dp_vs_tp(bandwidth_bytes_per_s=10e9, budget_bytes=None)
    act_heavy = Problem(p.nodes, (p.edges[0], Edge.dense(1, 2, [[0.0, 10.0], [0.0, 10.0]])), 64 * GIB)
    sol = solve_problem(act_heavy)
    assert [p.nodes[v].options[c].label for v, c in enumerate(sol.assignment.choice)] == ["R", "S(0)", "DP"]
    assert not any(sol.assignment.recompute) and not any(sol.assignment.zero)
    assert sol.report.status == "optimal"
    assert sol.time.total_s == pytest.approx(brute_force(act_heavy)[0])


def test_memory_below_data_parallel_need_shards_parameters():
    p = dp_vs_tp(bandwidth_bytes_per_s=10e9, budget_bytes=None)
    act_heavy = lambda budget: Problem(p.nodes, (p.edges[0], Edge.dense(1, 2, [[0.0, 10.0], [0.0, 10.0]])), budget)
    dp = solve_problem(act_heavy(64 * GIB))
    dp_need = dp.memory.total_bytes
    assert dp_need == pytest.approx(4 * GIB + 128 * MB + 128 * MB)  # static 4 GiB + x, y halves
    tight = solve_problem(act_heavy(dp_need - 1 * MB))
    # ZeRO (params+grads+opt halved, +1 GiB gathered transient) beats TP's 10 s resharding.
    assert tight.assignment.zero[0] and tight.assignment.choice == (0, 0, 0)
    assert tight.memory.params_bytes + tight.memory.grads_bytes + tight.memory.optimizer_bytes == pytest.approx(2 * GIB)
    assert tight.time.total_s == pytest.approx(brute_force(act_heavy(dp_need - 1 * MB))[0])


def test_memory_below_data_parallel_need_goes_tensor_parallel_when_zero_is_too_slow():
    p = dp_vs_tp(bandwidth_bytes_per_s=1e9, budget_bytes=3 * GIB)  # ZeRO's 2 GiB + 1 GiB gather does not fit 3 GiB
    sol = solve_problem(p)
    assert [p.nodes[v].options[c].label for v, c in enumerate(sol.assignment.choice)][0::2] == ["S(1)", "TP"]
    assert sol.memory.total_bytes <= 3 * GIB
    assert sol.time.total_s == pytest.approx(brute_force(p)[0])


def chain_with_activations(budget_bytes: float | None) -> Problem:
    """A placeholder then three layers saving 1 GiB each; recomputing them costs 3 s, 1 s, 2 s."""
    inp = Node("inp", (Option("S(0)", saved_bytes=0.5 * GIB),))
    layers = tuple(
        Node(f"l{i}", (Option("S(0)", compute_s=5.0, saved_bytes=1 * GIB, recompute_s=r),), recomputable=True)
        for i, r in enumerate((3.0, 1.0, 2.0))
    )
    return Problem((inp,) + layers, (), budget_bytes)


@pytest.mark.parametrize("budget_gib, expected", [(3.5, ()), (3.0, (2,)), (2.0, (2, 3)), (1.0, (1, 2, 3))])
def test_tighter_budget_recomputes_cheapest_first(budget_gib, expected):
    p = chain_with_activations(budget_gib * GIB)
    sol = solve_problem(p)
    assert tuple(v for v, r in enumerate(sol.assignment.recompute) if r) == expected
    assert sol.time.recompute_s == pytest.approx(sum(p.nodes[v].options[0].recompute_s for v in expected))
    assert not sol.assignment.recompute[0]  # the placeholder is never recomputed


def test_infeasible_budget_reports_the_minimum_and_what_dominates():
    p = dp_vs_tp(bandwidth_bytes_per_s=10e9, budget_bytes=1 * GIB)
    with pytest.raises(InfeasibleError) as info:
        solve_problem(p)
    # By hand: w S(1) holds 2 GiB static (ZeRO on w R also 2 GiB, plus a 1 GiB gathered transient);
    # x S(0) (a placeholder, never recomputed) 128 MiB; mm recomputed saves nothing. Minimum 2.125 GiB.
    assert info.value.min_memory_bytes == pytest.approx(2.125 * GIB)
    # the need rounded up, a budget the user can copy (2.1 GiB would not fit)
    assert "needs 2.2 GiB per device (optimizer state 1.0 GiB); budget 1.0 GiB" in str(info.value)
    assert min_memory(p).memory.total_bytes == pytest.approx(2.125 * GIB)
    # a budget just below the need: as many digits as it takes to tell the two apart (not "needs 2.7; budget 2.7")
    assert need_and_budget(2.68 * MB, 2.66 * MB) == ("2.68 MiB", "2.66 MiB")


def test_a_least_memory_not_proven_in_time_is_reported_with_the_bound_it_proved():
    p = dp_vs_tp(bandwidth_bytes_per_s=10e9, budget_bytes=1 * GIB)
    best = min_memory(p).memory  # 2.125 GiB, proven
    proven = infeasible_error(best, 1 * GIB, None)
    assert proven.min_memory_bytes == proven.lower_bound_bytes == pytest.approx(2.125 * GIB)
    assert "none needs less" not in str(proven)
    # stopped at the time limit 20% above the solver's bound: a budget between the two may fit
    open_ = infeasible_error(best, 1 * GIB, 0.2)
    assert open_.min_memory_bytes == pytest.approx(2.125 * GIB)
    assert open_.lower_bound_bytes == pytest.approx(0.8 * 2.125 * GIB)
    assert "(the leanest plan found; none needs less than 1.7 GiB)" in str(open_)
    # a budget proven infeasible bounds the least need from below too
    assert infeasible_error(best, 2 * GIB, 0.2, proven=True).lower_bound_bytes == pytest.approx(2 * GIB)


def _finding_nothing(monkeypatch, finds):
    """`anytime.run` as HiGHS out of time (Mixtral-tiny on 2x2 at 1.5 MB: nothing in 29 s) wherever
    `finds(model, memory row in, warm start)` says so; returns every run's (objective, memory row in, warm start)."""
    real_run = anytime.run
    runs = []

    def run(model, backend, time_limit_s, presolve=False, mip_rel_gap=ilp.DEFAULT_GAP, warm_start=False, settled_s=None):
        bound = "memory" in model.prob.constraints
        runs.append((model.prob.name, bound, warm_start))
        if not finds(model, bound, warm_start):
            return ilp.Outcome("none", "highs", time_limit_s, None)
        return real_run(model, backend, time_limit_s, presolve, mip_rel_gap, warm_start, settled_s)

    monkeypatch.setattr(anytime, "run", run)
    return runs


def tp_or_dp(budget_bytes: float) -> Problem:
    """`dp_vs_tp` with x resharded for TP at 10 s: unconstrained, data parallel (4.25 GiB)."""
    base = dp_vs_tp(bandwidth_bytes_per_s=10e9, budget_bytes=None)
    return Problem(base.nodes, (base.edges[0], Edge.dense(1, 2, [[0.0, 10.0], [0.0, 10.0]])), budget_bytes)


@pytest.mark.parametrize("seed", range(4))
def test_a_seeded_start_out_of_time_still_returns_a_plan_no_worse_than_the_start(monkeypatch, seed):
    """No search finds anything in time (a time limit too short for any of them): the answer is the fastest start
    that fits, never an error and never slower; with time, the answer is the brute-force optimum."""
    p = random_problem(random.Random(seed))
    needs = sorted(evaluate(p, a)[0].total_bytes for a in every_assignment(p))
    p = dataclasses.replace(p, budget_bytes=needs[len(needs) // 2])  # half the assignments fit
    fitting = sorted((evaluate(p, a)[1].total_s, i, a) for i, a in enumerate(every_assignment(p))
                     if evaluate(p, a)[0].total_bytes <= p.budget_bytes)
    starts = [a for _, _, a in fitting[-3:]]  # the slowest three that fit
    assert solve_problem(p, starts=starts).time.total_s == pytest.approx(brute_force(p)[0])
    _finding_nothing(monkeypatch, lambda model, bound, warm: False)
    sol = solve_problem(p, time_limit_s=1e-3, starts=starts)
    assert sol.memory.total_bytes <= p.budget_bytes
    assert sol.time.total_s <= min(evaluate(p, a)[1].total_s for a in starts) * (1 + 1e-9)


@pytest.mark.parametrize("started_search_finds", [True, False])
def test_when_no_start_fits_the_leanest_plan_starts_the_memory_bound_search(monkeypatch, started_search_finds):
    """The memory-bound search finds nothing from scratch; the least-memory search's plan fits, so the search
    starts from it, and the answer is the leanest plan when nothing better is found (as HiGHS on Mixtral-tiny at
    1.5 MB: nothing in 29 s from scratch; from the leanest plan, 20.8 ms a step, 6.0-6.4 ms)."""
    runs = _finding_nothing(monkeypatch, lambda model, bound, warm: not bound or (warm and started_search_finds))
    p = tp_or_dp(3 * GIB)
    sol = solve_problem(p)
    assert ("autopar_memory", False, True) in runs and runs[-1] == ("autopar_time", True, True)
    leanest = min_memory(p)
    assert sol.memory.total_bytes <= 3 * GIB
    if started_search_finds:
        assert sol.report.status == "optimal"
        assert sol.time.total_s == pytest.approx(brute_force(p)[0]) and sol.time.total_s < leanest.time.total_s
    else:  # nothing better found: a leanest plan is the answer
        assert sol.report.status == "leanest" and sol.memory.total_bytes == pytest.approx(least_memory(p))


def test_a_budget_below_the_least_need_is_infeasible_not_a_timeout():
    p = tp_or_dp(2 * GIB)
    with pytest.raises(InfeasibleError) as info:
        solve_problem(p)
    assert not isinstance(info.value, SearchTimeoutError)
    assert info.value.min_memory_bytes == pytest.approx(least_memory(p))
    assert "fix: pass memory_budget_bytes=" in str(info.value)


def test_when_no_search_finds_a_plan_in_time_the_error_names_the_time_and_the_leanest_plans_need(monkeypatch):
    """The memory-bound search and the leanest plan's both stop at the time limit with nothing better than the plan
    found without a budget (a GRU unrolled over its steps on 2x2): a `SearchTimeoutError` (an `InfeasibleError`)
    naming the time limit, and a budget that plans, that plan's need; worded for the entry point called."""
    _finding_nothing(monkeypatch, lambda model, bound, warm: not bound and model.prob.name == "autopar_time")
    p = tp_or_dp(3 * GIB)
    with pytest.raises(SearchTimeoutError) as info:
        solve_problem(p, time_limit_s=7.0)
    assert isinstance(info.value, InfeasibleError)
    assert info.value.time_limit_s == 7.0 and info.value.min_memory_bytes == pytest.approx(4.25 * GIB)
    assert ("found no plan within 3.0 GiB in 7 s (its time limit) and could not rule one out: the leanest plan it "
            "found needs 4.3 GiB per device (optimizer state 2.0 GiB)\n") in str(info.value)
    assert "fix: pass time_limit_s=14 or more, or memory_budget_bytes=4.564e+09 or more" in str(info.value)
    worded = info.value.worded_for(PARALLELIZE_KNOBS)
    assert isinstance(worded, SearchTimeoutError) and "memory_budget=4.564e+09 or more" in str(worded)


def test_resharding_edges_pick_the_globally_cheapest_chain():
    # a -> b -> c, each with options S / R. Locally S is cheaper everywhere, but c only has a cheap R option,
    # and resharding S->R costs 4 s on each edge: the optimum switches the whole chain to R.
    a = Node("a", (Option("S", compute_s=1.0), Option("R", compute_s=2.0)))
    b = Node("b", (Option("S", compute_s=1.0), Option("R", compute_s=2.0)))
    c = Node("c", (Option("S", compute_s=10.0), Option("R", compute_s=1.0)))
    cost = [[0.0, 4.0], [4.0, 0.0]]
    p = Problem((a, b, c), (Edge.dense(0, 1, cost), Edge.dense(1, 2, cost)))
    sol = solve_problem(p)
    assert sol.assignment.choice == (1, 1, 1)
    assert sol.time.total_s == pytest.approx(5.0) == pytest.approx(brute_force(p)[0])


def test_grouped_edge_classes_price_like_the_dense_matrix():
    # b has 3 options whose input spec is S, S, R: grouped into 2 classes.
    a = Node("a", (Option("S", compute_s=2.0), Option("R", compute_s=1.0)))
    b = Node("b", (Option("S1", compute_s=3.0), Option("S2", compute_s=2.5), Option("R", compute_s=4.0)))
    grouped = Edge(0, 1, (0, 1), (0, 0, 1), ((0.0, 1.0), (0.2, 0.0)))
    sol = solve_problem(Problem((a, b), (grouped,)))
    assert sol.assignment.choice == (1, 1)  # 1 + 2.5 + 0.2
    assert sol.time.total_s == pytest.approx(3.7)


def random_problem(rng: random.Random, gib: float = GIB, second: float = 1.0, layered: bool = False) -> Problem:
    """3-5 nodes of 1-3 options, sizes in units of `gib` bytes and times in units of `second`. Layered: nodes
    after the first fall into two layers (regions), so a recomputed layer's rebuild is priced (gradients at each
    backward step, reshards run again and the inputs they save, a consumer keeping its producer's output, the whole
    gradients a consumer makes of a parameter resharded into it or stored ZeRO, a tied parameter's later use)."""
    nodes = []
    count = rng.randint(3, 5)
    for v in range(count):
        opts = []
        for s in range(rng.randint(1, 3)):
            static = rng.choice([0.0, rng.uniform(0, 4)]) * gib
            zero = (ZeroOption(rng.choice([2, 4]), rng.uniform(0, 2) * second, static / 4, grad_bytes=static / 4)
                    if static and rng.random() < 0.6 else None)
            opts.append(Option(f"o{s}", compute_s=rng.uniform(0, 5) * second, comm_s=rng.uniform(0, 1) * second,
                               recompute_s=rng.uniform(0, 2) * second, saved_bytes=rng.uniform(0, 2) * gib,
                               temp_bytes=rng.uniform(0, 1) * gib, grad_flow_bytes=rng.uniform(0, 2) * gib if layered else 0.0,
                               param_bytes=static / 4, grad_bytes=static / 4, optimizer_bytes=static / 2, zero=zero))
        region = f"h.{2 * v // (count + 1)}" if layered and v > 0 else None
        nodes.append(Node(f"n{v}", tuple(opts), recomputable=v > 0, region=region))
    edges = []
    for v in range(1, len(nodes)):
        u = rng.randrange(v)
        edge = Edge.dense(u, v, [[rng.choice([0.0, rng.uniform(0, 3) * second]) for _ in nodes[v].options]
                                 for _ in nodes[u].options])
        if layered:
            table = lambda scale: tuple(tuple(rng.choice([0.0, rng.uniform(0, scale) * gib]) for _ in nodes[v].options)
                                        for _ in nodes[u].options)
            edge = dataclasses.replace(edge, saved_bytes=table(1), buffer_bytes=table(2), grad_bytes=table(1))
            if rng.random() < 0.5:  # a later use of a tied parameter; its gradient made at another node's step
                edge = dataclasses.replace(edge, accumulated_bytes=table(1), grad_step=rng.randrange(len(nodes)))
        edges.append(edge)
    keeps = tuple((e.src, e.dst) for e in edges if e.src > 0 and rng.random() < 0.5) if layered else ()
    return Problem(tuple(nodes), tuple(edges), rng.uniform(2, 12) * gib, recompute_with=keeps)


# A tiny model's sizes: a "GiB" of 1.5 KB and a "second" of 1 ms. HiGHS' tolerances are absolute, so bytes
# in GiB would put every difference between these plans below them (`ilp.memory_unit_bytes`).
TINY = dict(gib=1500.0, second=1e-3)


@pytest.mark.parametrize("sizes", [{}, TINY, dict(layered=True), dict(TINY, layered=True)],
                         ids=["gib", "tiny", "layered", "layered-tiny"])
def test_random_problems_match_brute_force(sizes):
    rng = random.Random(0)
    checked = infeasible = 0
    for _ in range(25):
        p = random_problem(rng, **sizes)
        ref = brute_force(p)
        if ref is None:
            with pytest.raises(InfeasibleError) as info:
                solve_problem(p)
            assert info.value.min_memory_bytes > p.budget_bytes
            infeasible += 1
            continue
        sol = solve_problem(p)
        assert sol.time.total_s == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
        assert sol.memory.total_bytes <= p.budget_bytes * (1 + 1e-6)
        checked += 1
    assert checked >= 15 and infeasible >= 1  # both outcomes exercised


def _relaxed_cases(count: int):
    """Random layered problems with a plan that fits: (problem, brute-force optimum, the LP relaxation)."""
    rng = random.Random(0)
    for _ in range(count):
        p = random_problem(rng, layered=True)
        ref = brute_force(p)
        if ref is not None:
            yield p, ref, ilp.relax(_Model(p, Restrictions(), "time"), "highs", 10.0)


def test_the_relaxation_bounds_every_plan_that_fits_and_a_cutoff_at_or_below_it_stops_the_search():
    checked = 0
    for p, ref, relaxed in _relaxed_cases(12):
        assert relaxed.bound_s <= ref[0] * (1 + 1e-9)
        with pytest.raises(anytime.Outpaced):
            solve_problem(p, cutoff_s=relaxed.bound_s)
        # a cutoff the optimum beats: the search goes on to it
        assert solve_problem(p, cutoff_s=ref[0] * 1.01).time.total_s == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
        checked += 1
    assert checked >= 6


def test_a_settled_step_proven_out_ends_the_search_at_a_plan_that_fits_and_a_faster_optimum_is_still_found():
    checked = 0
    for p, ref, relaxed in _relaxed_cases(5):
        # a settled step the optimum does not beat, proven by the relaxation or within the MIP: the answer fits and
        # reports "optimal", whichever plan the search had in hand when it stopped
        for settled_s in (relaxed.bound_s, (relaxed.bound_s + ref[0]) / 2):
            settled = solve_problem(p, settled_s=settled_s)
            assert settled.memory.total_bytes <= p.budget_bytes * (1 + 1e-6)
            assert settled.time.total_s >= ref[0] * (1 - 1e-9) and settled.report.status == "optimal"
        # a settled step the optimum beats: the search goes on to it
        assert solve_problem(p, settled_s=ref[0] * 1.01).time.total_s == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("sizes", [{}, TINY, dict(layered=True)], ids=["gib", "tiny", "layered"])
def test_the_least_memory_is_the_brute_force_minimum(sizes):
    rng = random.Random(1)
    for _ in range(25):
        p = random_problem(rng, **sizes)
        assert min_memory(p).memory.total_bytes == pytest.approx(least_memory(p), rel=1e-9)


def test_cbc_agrees_with_highs_and_solves_are_deterministic():
    p = random_problem(random.Random(7))
    p = Problem(p.nodes, p.edges, None)
    highs, again, cbc = solve_problem(p), solve_problem(p), solve_problem(p, backend="cbc")
    assert highs.assignment == again.assignment
    assert highs.report.backend == "highs" and cbc.report.backend == "cbc"
    assert cbc.time.total_s == pytest.approx(highs.time.total_s)


def test_restrictions_force_options_zero_and_no_recompute():
    p = dp_vs_tp(bandwidth_bytes_per_s=10e9, budget_bytes=None)
    sol = solve_problem(p, restrictions=Restrictions(allowed={0: frozenset({0}), 2: frozenset({0})}, zero="always", recompute="never"))
    assert sol.assignment.choice[0] == 0 and sol.assignment.choice[2] == 0
    assert sol.assignment.zero[0] and not any(sol.assignment.recompute)


def test_every_constraint_is_named_after_its_family():
    p = dp_vs_tp(bandwidth_bytes_per_s=10e9, budget_bytes=8 * GIB)
    mm = p.nodes[2]
    mm = Node(mm.name, tuple(dataclasses.replace(o, temp_bytes=64 * MB) for o in mm.options), mm.recomputable)
    p = Problem(p.nodes[:2] + (mm,), p.edges, p.budget_bytes)
    model = _Model(p, Restrictions(), "time")
    model.add_memory_limit()
    names = list(model.prob.constraints)
    families = {n.rsplit("_", 1)[0].rstrip("_0123456789") for n in names}
    assert families == {"onehot", "edge_src", "edge_dst", "recompute", "zero", "temp", "gather", "param_grad", "memory"}


def test_options_with_the_same_recompute_effect_share_one_binary():
    # mm's two options save and recompute the same: one y for both, and still the brute-force optimum
    p = dp_vs_tp(bandwidth_bytes_per_s=10e9, budget_bytes=4.1 * GIB)
    model = _Model(p, Restrictions(), "time")
    assert [v.name for v in model.prob.variables() if v.name.startswith("y_")] == ["y_2_0"]  # x is a placeholder
    sol = solve_problem(p)
    assert sol.time.total_s == pytest.approx(brute_force(p)[0])
    assert sol.assignment == solve_problem(p).assignment  # deterministic under a binding budget too


def test_a_loose_gap_stays_within_it():
    rng = random.Random(3)
    for _ in range(10):
        p = random_problem(rng)
        ref = brute_force(p)
        if ref is None:
            continue
        sol = solve_problem(p, mip_rel_gap=0.2)
        assert ref[0] - 1e-9 <= sol.time.total_s <= ref[0] * 1.2 + 1e-6
        assert sol.report.gap is None or 1e-4 < sol.report.gap <= 0.2


def test_each_gradient_sync_group_used_pays_one_bucket_latency():
    """Two weights' consumers may sync over dp (2 ranks) or over the flat dp+tp group (4 ranks, a bit cheaper
    per byte here). Each group used sends its own bucket: splitting the grads costs both latencies, so the
    best plan keeps both on dp: 1 + 1 ms + 2 ms (one dp bucket), not 0.8 + 0.8 + 5 or 1 + 0.8 + 2 + 5."""
    dp, flat = (0,), (0, 1)
    options = (Option("dp", comm_s=1e-3, sync_groups=frozenset({dp})), Option("flat", comm_s=0.8e-3, sync_groups=frozenset({flat})))
    problem = Problem((Node("a", options), Node("b", options)), (), None, ((dp, 2e-3), (flat, 5e-3)))
    sol = solve_problem(problem)
    assert sol.assignment.choice == (0, 0)
    assert sol.time.comm_s == pytest.approx(4e-3)
    assert evaluate(problem, Assignment.of([0, 1]))[1].comm_s == pytest.approx(1.8e-3 + 7e-3)
    assert brute_force(problem)[0] == pytest.approx(4e-3)
    # without the group latencies the flat group wins on bytes alone
    assert solve_problem(dataclasses.replace(problem, sync_latency_s=())).assignment.choice == (1, 1)


def test_recomputing_a_producer_frees_nothing_while_its_consumer_keeps_its_output():
    """b's backward keeps a's 100 MB output (recompute_with): recomputing a alone still holds it (evaluate
    counts it), so fitting 60 MB needs a and b in one region: 1 ms + 0.1 ms of recompute, by hand."""
    a = Node("a", (Option("a", compute_s=1e-3, recompute_s=1e-3, saved_bytes=100 * MB),), recomputable=True)
    b = Node("b", (Option("b", compute_s=1e-3, recompute_s=0.1e-3),), recomputable=True)
    problem = Problem((a, b), (), 60 * MB, recompute_with=((0, 1),))
    alone = evaluate(problem, Assignment.of([0, 0], recompute=[0]))
    assert alone[0].activations_bytes == 100 * MB and alone[1].recompute_s == pytest.approx(1e-3)
    sol = solve_problem(problem)
    assert sol.assignment.recompute == (True, True)
    assert sol.time.recompute_s == pytest.approx(1.1e-3) and sol.memory.activations_bytes == 0.0


def test_a_recomputed_reader_in_another_region_keeps_its_input():
    """b reads a's output across a layer boundary (region_inputs; no rebuild transient in this hand-built
    problem): recomputed, b's region saves that output as its input, so recomputing both frees only b's
    50 MB (evaluate), and the ILP never pairs them. Budget 110 MB from 150 MB saved: recompute b alone
    (0.1 ms) or a alone (1 ms): b, by hand."""
    a = Node("a", (Option("a", compute_s=1e-3, recompute_s=1e-3, saved_bytes=100 * MB),), recomputable=True)
    b = Node("b", (Option("b", compute_s=1e-3, recompute_s=0.1e-3, saved_bytes=50 * MB),), recomputable=True)
    problem = Problem((a, b), (), 110 * MB, region_inputs=((0, 1),))
    both = evaluate(problem, Assignment.of([0, 0], recompute=[0, 1]))
    assert both[0].activations_bytes == 100 * MB
    sol = solve_problem(problem)
    assert sol.assignment.recompute == (False, True) and sol.time.recompute_s == pytest.approx(0.1e-3)
    # 40 MB would need a's 100 MB freed as well: only possible if b's region did not hold it
    with pytest.raises(InfeasibleError):
        solve_problem(dataclasses.replace(problem, budget_bytes=40 * MB))
    assert solve_problem(dataclasses.replace(problem, budget_bytes=40 * MB, region_inputs=())).assignment.recompute == (True, True)


def test_a_recomputed_node_holds_its_inputs_from_other_layers():
    """b's region saves an 80 MB input that no backward kept (held_input_bytes): recomputing b frees 100 - 80
    MB; fitting 90 MB from 150 needs a (50 MB) recomputed too: 1 + 2 ms of recompute, by hand."""
    a = Node("a", (Option("a", compute_s=1e-3, recompute_s=2e-3, saved_bytes=50 * MB),), recomputable=True)
    b = Node("b", (Option("b", compute_s=1e-3, recompute_s=1e-3, saved_bytes=100 * MB, held_input_bytes=80 * MB),),
             recomputable=True)
    problem = Problem((a, b), (), 90 * MB)
    assert evaluate(problem, Assignment.of([0, 0], recompute=[1]))[0].activations_bytes == 130 * MB
    sol = solve_problem(problem)
    assert sol.assignment.recompute == (True, True)
    assert sol.memory.activations_bytes == 80 * MB and sol.time.recompute_s == pytest.approx(3e-3)


def test_a_saved_resharded_input_counts_unless_its_consumer_is_recomputed():
    """b saves its input as resharded from a (40 MB more than a's option counts: Edge.saved_bytes). Kept, it
    needs 140 MB; recomputed, the reshard reruns in b's region and nothing resharded is saved: 100 MB fits
    a 120 MB budget only that way, at 1 ms of recompute plus the reshard's 1 ms forward again, by hand."""
    a = Node("a", (Option("a", compute_s=1e-3, saved_bytes=100 * MB),))
    b = Node("b", (Option("b", compute_s=1e-3, recompute_s=1e-3, saved_bytes=1 * MB),), recomputable=True)
    edge = Edge(0, 1, (0,), (0,), ((2e-3,),), ((1e-3,),), ((40 * MB,),))
    problem = Problem((a, b), (edge,), 120 * MB)
    assert evaluate(problem, Assignment.of([0, 0]))[0].activations_bytes == 141 * MB
    sol = solve_problem(problem)
    assert sol.assignment.recompute == (False, True)
    assert sol.memory.activations_bytes == 100 * MB and sol.time.recompute_s == pytest.approx(2e-3)


def test_a_recomputed_consumer_saves_its_resharded_input_again_while_its_layer_is_rebuilt():
    """b's first option gathers a's output (b saves the 40 MB copy). Recomputed, nothing resharded is kept
    through the step, but backward's rebuild of b's layer gathers it again and saves it beside b's own 1 MB:
    100 + 41 MB, over a 120 MB budget. So the plan is b's second option (no gather, 7 ms by hand), not the
    gather recomputed (6 ms), which fits only if the rebuild is priced without the copy."""
    a = Node("a", (Option("a", compute_s=1e-3, saved_bytes=100 * MB),))
    b = Node("b", (Option("gather", compute_s=1e-3, recompute_s=1e-3, saved_bytes=1 * MB),
                   Option("split", compute_s=6e-3, recompute_s=1e-3, saved_bytes=1 * MB)), recomputable=True, region="h.0")
    edge = Edge(0, 1, (0,), (0, 1), ((2e-3, 0.0),), ((1e-3, 0.0),), ((40 * MB, 0.0),))
    problem = Problem((a, b), (edge,), 120 * MB)
    memory, step = evaluate(problem, Assignment.of([0, 0], recompute=[1]))
    assert (memory.activations_bytes, memory.temp_bytes, step.total_s) == (100 * MB, 41 * MB, pytest.approx(6e-3))
    sol = solve_problem(problem)
    assert sol.assignment.choice == (0, 1) and sol.memory.total_bytes == 101 * MB
    assert sol.time.total_s == pytest.approx(7e-3)


def test_a_kept_resharded_copy_of_a_recomputed_output_is_held_whole():
    """b (a view the solver never recomputes) keeps a resharded copy of a's output: 8 MB, as large as a's own
    shard, so `saved_bytes` adds nothing and counts the copy as a's saved output. Recomputing a frees that
    output, not the copy: 8 MB stay, so a 5 MB budget fits nothing (the least is 8 MB, not 0)."""
    a = Node("a", (Option("a", compute_s=1e-3, recompute_s=1e-3, saved_bytes=10 * MB),), recomputable=True)
    b = Node("b", (Option("b"),))
    edge = Edge(0, 1, (0,), (0,), ((1e-3,),), replaced_bytes=((8 * MB,),))
    problem = Problem((a, b), (edge,), 5 * MB)
    assert evaluate(problem, Assignment.of([0, 0], recompute=[0]))[0].activations_bytes == 8 * MB
    assert evaluate(problem, Assignment.of([0, 0]))[0].activations_bytes == 10 * MB
    with pytest.raises(InfeasibleError) as err:
        solve_problem(problem)
    assert err.value.min_memory_bytes == pytest.approx(8 * MB)
    sol = solve_problem(dataclasses.replace(problem, budget_bytes=9 * MB))
    assert sol.assignment.recompute == (True, False) and sol.memory.activations_bytes == 8 * MB


def test_a_reshards_buffers_are_a_transient():
    """b's first option exchanges a's output over the mesh (all-to-all: 30 MB of buffers held at once), its
    second needs no reshard but computes 2 ms longer. Static 50 MB + 30 MB of buffers is over a 70 MB budget:
    the plan is the slower option, and the buffers are the transient of the faster one."""
    a = Node("a", (Option("a", compute_s=1e-3, param_bytes=50 * MB),))
    b = Node("b", (Option("exchange", compute_s=1e-3), Option("local", compute_s=3e-3)))
    edge = Edge(0, 1, (0,), (0, 1), ((0.5e-3, 0.0),), buffer_bytes=((30 * MB, 0.0),))
    problem = Problem((a, b), (edge,), 70 * MB)
    assert evaluate(problem, Assignment.of([0, 0]))[0].temp_bytes == 30 * MB
    assert evaluate(problem, Assignment.of([0, 1]))[0].temp_bytes == 0.0
    sol = solve_problem(problem)
    assert sol.assignment.choice == (0, 1) and sol.memory.total_bytes == 50 * MB
    assert solve_problem(dataclasses.replace(problem, budget_bytes=90 * MB)).assignment.choice == (0, 0)


def test_a_rebuilt_layer_holds_the_buffers_of_the_reshards_it_runs_again():
    """b gathers a's output inside its checkpoint region: 40 MB of buffers, the 10 MB copy b saves among them.
    Recomputed, backward's rebuild of b's layer runs the gather again before it rebuilds b's own 1 MB: 40 MB
    over a's 100 MB at most, by hand (without the buffers 11 MB, 111 MB in all, which would fit 135 MB). Kept,
    b's gather is 151 MB. So under 145 MB the plan is the gather recomputed (6 ms); under 135 MB b's second
    option (7 ms, 101 MB), which reshards nothing."""
    a = Node("a", (Option("a", compute_s=1e-3, saved_bytes=100 * MB),))
    b = Node("b", (Option("gather", compute_s=1e-3, recompute_s=1e-3, saved_bytes=1 * MB),
                   Option("split", compute_s=6e-3, recompute_s=1e-3, saved_bytes=1 * MB)), recomputable=True, region="h.0")
    edge = Edge(0, 1, (0,), (0, 1), ((2e-3, 0.0),), ((1e-3, 0.0),), ((10 * MB, 0.0),), buffer_bytes=((40 * MB, 0.0),))
    problem = Problem((a, b), (edge,), 145 * MB)
    memory, step = evaluate(problem, Assignment.of([0, 0], recompute=[1]))
    assert (memory.activations_bytes, memory.temp_bytes, step.total_s) == (100 * MB, 40 * MB, pytest.approx(6e-3))
    assert evaluate(problem, Assignment.of([0, 0]))[0].total_bytes == 151 * MB  # forward: the buffers alone
    sol = solve_problem(problem)
    assert sol.assignment.choice == (0, 0) and sol.assignment.recompute == (False, True)
    sol = solve_problem(dataclasses.replace(problem, budget_bytes=135 * MB))
    assert sol.assignment.choice == (0, 1) and sol.memory.total_bytes == 101 * MB
    assert sol.time.total_s == pytest.approx(7e-3)


def test_a_rebuild_holds_a_reshards_buffers_beside_what_it_rebuilt_before_it():
    """Layers h.0 (b1 then b2) and h.1 (c1 then c2) save 30 MB per node; a's 100 MB are kept. Only both layers
    recomputed fit 170 MB: backward rebuilds one layer at a time (60 MB). A 50 MB reshard into b1 runs
    before anything of h.0 is rebuilt: h.0's rebuild peaks at 60 MB, 160 MB in all, which fits. The same
    reshard into b2 runs beside b1's 30 MB: 80 MB, 180 MB in all, so b2 takes its slower option without the
    reshard. (Adding the buffers to the whole layer, 110 MB, would rule out the first plan too.)"""
    a = Node("a", (Option("a", compute_s=1e-3, saved_bytes=100 * MB),))
    two = (Option("gather", compute_s=1e-3, recompute_s=1e-3, saved_bytes=30 * MB),
           Option("split", compute_s=3e-3, recompute_s=1e-3, saved_bytes=30 * MB))
    one = (Option("b", compute_s=1e-3, recompute_s=1e-3, saved_bytes=30 * MB),)
    c1, c2 = (Node(name, one, recomputable=True, region="h.1") for name in ("c1", "c2"))
    for into, options, fits in ((1, (two, one), True), (2, (one, two), False)):
        b1, b2 = (Node(f"b{i + 1}", opts, recomputable=True, region="h.0") for i, opts in enumerate(options))
        gather = Edge(0, into, (0,), (0, 1), ((0.5e-3, 0.0),), buffer_bytes=((50 * MB, 0.0),))
        problem = Problem((a, b1, b2, c1, c2), (gather,), 170 * MB)
        every_layer = Assignment.of([0, 0, 0, 0, 0], recompute=[1, 2, 3, 4])
        assert evaluate(problem, every_layer)[0].total_bytes == (160 if fits else 180) * MB
        sol = solve_problem(problem)
        assert sol.assignment.recompute == (False, True, True, True, True)
        assert sol.assignment.choice[into] == (0 if fits else 1) and sol.memory.total_bytes == 160 * MB


def test_each_layer_with_recomputed_work_pays_one_checkpoint_region():
    """Layers h.0 (a1, a2) and h.1 (b) save 10 MB per node beside a's 100 MB and its 30 MB scratch (the step's
    largest transient, whatever is rebuilt): 141 MB needs two nodes recomputed. a1 and a2 cost 1.2 ms each to
    recompute, b 1 ms: without a region cost a1 + b (2.2 ms) beats a1 + a2 (2.4 ms). At 0.5 ms per region,
    a1 + b opens two regions (3.2 ms) and a1 + a2 one (2.9 ms). A tied class standing for 3 layers pays 3."""
    a = Node("a", (Option("a", compute_s=1e-3, saved_bytes=100 * MB, temp_bytes=30 * MB),))
    a1, a2 = (Node(n, (Option(n, compute_s=1e-3, recompute_s=1.2e-3, saved_bytes=10 * MB),), recomputable=True, region="h.0")
              for n in ("a1", "a2"))
    b = Node("b", (Option("b", compute_s=1e-3, recompute_s=1e-3, saved_bytes=10 * MB),), recomputable=True, region="h.1")
    problem = Problem((a, a1, a2, b), (), 141 * MB)
    recompute = solve_problem(problem).assignment.recompute
    assert recompute[3] and recompute[1] + recompute[2] == 1  # one of a1, a2 (equal) and b
    regions = dataclasses.replace(problem, region_s=0.5e-3)
    sol = solve_problem(regions)
    assert sol.assignment.recompute == (False, True, True, False)
    assert sol.time.recompute_s == pytest.approx(2.9e-3) == evaluate(regions, sol.assignment)[1].recompute_s
    assert evaluate(regions, Assignment.of([0] * 4, recompute=[1, 3]))[1].recompute_s == pytest.approx(3.2e-3)
    tied = dataclasses.replace(regions, nodes=(a, a1, a2, dataclasses.replace(b, copies=3)))
    assert evaluate(tied, Assignment.of([0] * 4, recompute=[3]))[1].recompute_s == pytest.approx(1e-3 + 3 * 0.5e-3)


def test_a_recomputed_node_pays_its_input_reshards_forward_again():
    """b's input reshard (2 ms: 1 ms forward, 1 ms backward) sits in b's checkpoint region: recomputing b
    (the only way to fit) runs its forward again, 0.5 + 1 ms of recompute by hand."""
    a = Node("a", (Option("a", compute_s=1e-3),))
    b = Node("b", (Option("b", compute_s=1e-3, recompute_s=0.5e-3, saved_bytes=100 * MB),), recomputable=True)
    edge = Edge((0), 1, (0,), (0,), ((2e-3,),), ((1e-3,),))
    problem = Problem((a, b), (edge,), 60 * MB)
    sol = solve_problem(problem)
    assert sol.assignment.recompute == (False, True)
    assert sol.time.recompute_s == pytest.approx(1.5e-3) and sol.time.comm_s == pytest.approx(2e-3)
    assert evaluate(problem, Assignment.of([0, 0]))[1].recompute_s == 0.0


def _relaxed_objective_ms(problem: Problem) -> float:
    """The LP relaxation's optimum (every variable continuous), the bound branch and bound starts from, in ms."""
    model = _Model(problem, Restrictions(), "time")
    model.add_memory_limit()
    for var in model.prob.variables():
        var.cat = pulp.LpContinuous
    model.prob.solve(make_solver("highs", 30.0, presolve=False, mip_rel_gap=1e-4)[0])
    return pulp.value(model.prob.objective)


def test_the_relaxation_charges_a_half_recomputed_node_half_its_rerun():
    """To fit, b must be recomputed by half in the relaxation (100 MB saved, 50 MB of room). Its input reshard's
    forward runs again in backward: 1 ms from a's first option, 3 ms from the other, which costs 5 ms more to
    run. The relaxation's bound is then a0, b, the reshard, half of b's recompute and half of its rerun, by
    hand. A big-M row (w >= forward . e - 3 ms (1 - y)) had let the half rerun go free: 0.5 ms lower."""
    a = Node("a", (Option("a0"), Option("a1", compute_s=5e-3)))
    b = Node("b", (Option("b", compute_s=1e-3, recompute_s=2e-3, saved_bytes=100 * MB),), recomputable=True)
    edge = Edge(0, 1, (0, 1), (0,), ((2e-3,), (6e-3,)), ((1e-3,), (3e-3,)))
    problem = Problem((a, b), (edge,), 50 * MB)
    assert _relaxed_objective_ms(problem) == pytest.approx(1 + 2 + 0.5 * (2 + 1), rel=1e-3)
    assert solve_problem(problem).time.total_s == pytest.approx(brute_force(problem)[0])


def test_the_relaxation_frees_a_half_recomputed_nodes_copy_by_half():
    """b keeps a resharded copy of a's output unless recomputed: 40 MB from a's first option, 120 MB from the
    other (5 ms slower). Kept, the plan needs 150 MB (a's 100, b's 10, the copy's 40) against 120: recomputing b
    frees 50 MB per unit (its own 10 and the copy's 40), so the relaxation recomputes it by 30 / 50, and its
    bound is b's 1 ms and 0.6 of its 2 ms recompute, by hand. A big-M row (s >= kept . e - 120 MB y) had freed
    the copy three times as fast: b recomputed by 0.23, a bound 0.74 ms lower."""
    a = Node("a", (Option("a0", saved_bytes=100 * MB), Option("a1", compute_s=5e-3, saved_bytes=100 * MB)))
    b = Node("b", (Option("b", compute_s=1e-3, recompute_s=2e-3, saved_bytes=10 * MB),), recomputable=True)
    edge = Edge(0, 1, (0, 1), (0,), ((0.0,), (0.0,)), None, ((40 * MB,), (120 * MB,)))
    problem = Problem((a, b), (edge,), 120 * MB)
    assert _relaxed_objective_ms(problem) == pytest.approx(1 + 0.6 * 2, rel=1e-3)
    assert solve_problem(problem).time.total_s == pytest.approx(brute_force(problem)[0])


def test_a_process_that_ran_highs_on_other_threads_still_solves():
    """HiGHS keeps one thread scheduler per process. pulp's own HiGHS class (all cores) solving first made every
    later one-thread solve refuse to start, reported as "the ILP found no plan in 30.0 s"."""
    other = pulp.LpProblem("other", pulp.LpMinimize)
    x = pulp.LpVariable("x", 0, 1, cat=pulp.LpInteger)
    other += x
    other += x >= 1
    _reset_scheduler(True)  # as in a fresh process (this one's solves made a one-thread scheduler)
    other.solve(pulp.HiGHS(msg=False, threads=2))
    assert x.varValue == 1
    p = chain_with_activations(budget_bytes=None)
    assert solve_problem(p).time.total_s == pytest.approx(brute_force(p)[0])


def test_a_solve_prints_nothing(capfd):
    """HiGHS printed its version banner to stdout on every solve (highspy registers a callback before any
    option can turn output off): in the middle of `autopar plan`'s report, once per rank per `parallelize`."""
    p = chain_with_activations(budget_bytes=None)
    capfd.readouterr()
    assert solve_problem(p).time.total_s == pytest.approx(brute_force(p)[0])
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


@pytest.mark.parametrize("budget_gib", [3.5, 3.0, 2.0, 1.0, 0.25])
def test_or_leanest_gives_the_fastest_plan_that_fits_or_else_the_leanest(budget_gib, monkeypatch):
    """How a textbook plan is priced (`or_leanest`), against brute force: the fastest plan within the budget,
    else the leanest plan. Over budget, the fastest plan's options are fitted to the budget first (recompute
    and ZeRO only); when that fits, the search within the budget starts from it; when it does not, the leanest
    plan is searched for, and when even it needs more than the budget it is the answer, without the search
    that proves nothing fits."""
    runs = _finding_nothing(monkeypatch, lambda model, bound, warm: True)
    p = chain_with_activations(budget_gib * GIB)
    sol = solve_problem(p, or_leanest=True)
    best = brute_force(p)
    if best is not None:
        assert sol.time.total_s == pytest.approx(best[0]) and sol.memory.total_bytes <= p.budget_bytes
    else:
        assert sol.memory.total_bytes == pytest.approx(least_memory(p)) and sol.memory.total_bytes > p.budget_bytes
    if budget_gib >= 3.5:  # the fastest plan fits
        assert runs == [("autopar_time", False, False)]
    elif best is not None:  # fitted, then searched from
        assert runs == [("autopar_time", False, False), ("autopar_time", True, False), ("autopar_time", True, True)]
    else:  # fitting fails, the leanest plan (searched from the fastest) does not fit either
        assert runs == [("autopar_time", False, False), ("autopar_time", True, False), ("autopar_memory", False, True)]
