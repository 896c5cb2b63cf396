"""Top-level solving: one mesh (`solve`), every shape of N devices (`solve_for_devices`), and the textbook plans.

    plan = solve(traced, profile(traced), make_mesh(4, (2, 2)), memory_budget_bytes=40 * 2**30)
    plan, per_shape = solve_for_devices(traced, profile(traced), 8)   # tries (8,), (2, 4), (4, 2)

On each mesh (`search_mesh`): the problem is built with repeated blocks tied (one block plus the interfaces, not
N copies); the textbook plans are priced on it (`textbook.py`) and, with the leanest plan by construction, start
the anytime search (`anytime.solve_problem`), so that its plan is never slower than the fastest textbook plan
that fits and a budget is called infeasible only when the leanest plan provably does not fit; then recompute
and ZeRO are decided per layer where the budget binds (`layers.py`). `time_limit_s` bounds all of it, over
every mesh shape tried. Last, the simplest plan within the cost model's measured error of the fastest is chosen
(`robust.py`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Literal, Mapping, Sequence

from autopar.errors import InfeasibleError, SearchTimeoutError
from autopar.profiler.profile import optimizer_cost
from autopar.profiler.types import ConcreteProfile, GraphProfile
from autopar.solver.clock import cpu_s
from autopar.solver.anytime import Outpaced, fit_memory, fits, solve_problem
from autopar.solver.descent import descend
from autopar.solver.assemble import budget_of, build_for, to_plan
from autopar.solver.ilp import Restrictions, Solution
from autopar.solver.layers import per_layer
from autopar.solver.mesh import Mesh, Precision, candidate_shapes, make_mesh
from autopar.solver.plan import Plan
from autopar.solver.problem import BuiltProblem
from autopar.solver.robust import ROBUST_MARGIN, Candidate, simplest_within
from autopar.solver.spec import Spec
from autopar.solver.textbook import BASELINES, baseline_results, leanest_start, params_allowed, textbooks
from autopar.tracer import TracedGraph

log = logging.getLogger(__name__)

# Of a mesh's time: up to where the textbook plans end, and the anytime search (the per-layer decisions take the rest)
_TEXTBOOK_SHARE = 0.15
_TIED_SHARE = 0.85
_DESCENTS = 2  # the fastest starts that fit improved one axis at a time
# The search stops once its plan is proven within half the cost model's measured error of the best possible step
# (`robust.ROBUST_MARGIN`): a plan faster by less would not be chosen over a simpler one anyway. Llama tiny on 2x2
# at 60% of its need: proven within 5% in 16 CPU s, 2.8% in 24 and not within 2% in 30.
SEARCH_GAP = ROBUST_MARGIN / 2


Progress = Callable[[str], None]


def _quiet(step: str) -> None:
    """Progress told to no one."""


@dataclass(frozen=True)
class ShapeResult:
    """What one logical mesh shape would give: its best plan's predicted step time, or why it has none."""

    shape: tuple[int, ...]
    step_s: float | None
    memory_bytes: float | None
    error: str = ""  # set when no plan fits this shape, or it was not searched
    searched: bool = True  # False: the time limit was spent before this shape's turn (`solve_for_devices`)
    textbook_s: float | None = None  # the fastest textbook plan that fits on this shape (None: none fits)
    bound_s: float | None = None  # set when the search stopped at a proof that no plan here beats `solve_for_devices`' own


@dataclass(frozen=True)
class MeshSearch:
    """One mesh's answer: the searched plan on the problem it lives on, and the textbook plans on the tied problem."""

    mesh: Mesh
    built: BuiltProblem  # the searched plan's problem (tied in runs of layers when decided per layer)
    solution: Solution
    tied: BuiltProblem
    textbooks: Mapping[str, Solution]  # fitting or not (`anytime.fits`); a textbook found in no time is left out
    setup_s: float = 0.0  # CPU seconds the problem and the textbook plans took, before the search
    bound_s: float | None = None  # the search stopped here: no plan on this mesh is faster (`cutoff_s`)


def _restrictions(traced: TracedGraph, profile: GraphProfile | ConcreteProfile, built: BuiltProblem) -> Restrictions:
    """The search's: the host tier decided per parameter where the problem offers it."""
    if optimizer_cost(profile.optimizer).whole_params:
        # its update reads whole parameters (`OptimizerCost.whole_params`): each is used and stored whole, so
        # its gradient is summed whole on every rank; activations may still be split
        return Restrictions(params_allowed(traced, built, Spec.is_replicate), zero="never", offload="free")
    return Restrictions(offload="free")


def search_mesh(traced: TracedGraph, profile: GraphProfile | ConcreteProfile, mesh: Mesh, budget_bytes: float,
                time_limit_s: float = 30.0, backend: Literal["highs", "cbc"] = "highs",
                sizes: Mapping[str, int] | None = None, progress: Progress = _quiet,
                host_budget_bytes: float | None = None, cutoff_s: float | None = None,
                margin: float | None = None) -> MeshSearch:
    """The fastest plan on `mesh` within `budget_bytes` found in `time_limit_s` (see the module docstring);
    InfeasibleError when none fits (SearchTimeoutError when that is not proven). `progress` is told each step.
    `host_budget_bytes`: each parameter's tier decided too, the host tier holding this much per rank at most
    (`solver.offload`; None: every parameter's optimizer state on the device). `cutoff_s`: a searched plan of this
    step or slower is of no use to the caller; unless a textbook plan that fits beats it, the search first proves
    whether any plan can (`anytime.Outpaced`), and stops there with the fastest textbook plan that fits when none
    can (`MeshSearch.bound_s`; Outpaced when no textbook plan fits either). `margin`: the plan is chosen among this
    mesh's alone, by `robust.simplest_within` with this margin (`solve`): a searched plan not faster than the
    fastest textbook plan that fits by more than it would not be chosen, so the search stops once it proves none is
    (`anytime.solve_problem`'s `settled_s`).

    1. The problem, tied (`build_for`), and the textbook plans on it (`textbook.textbooks`).
    2. The anytime search (`anytime.solve_problem`) from the textbook plans and the leanest plan by construction;
       on a mesh of several axes the fastest starts that fit are improved one axis at a time first (`descent.py`).
    3. Recompute and ZeRO decided per layer where the budget binds (`layers.py`), when the time left is more than
       the tied problem took to build."""
    began = cpu_s()
    left_s = lambda until: time_limit_s * until - (cpu_s() - began)  # noqa: E731
    shape = "x".join(map(str, mesh.shape))
    progress(f"mesh {shape}: building the problem")
    tied = build_for(traced, profile, mesh, budget_bytes, sizes, host_budget_bytes=host_budget_bytes)
    build_s = cpu_s() - began
    log.debug("solver: %s: problem built in %.2f s (%d graph nodes -> %d problem nodes)", mesh,
              cpu_s() - began, tied.num_graph_nodes, len(tied.problem.nodes))
    problem, restrictions = tied.problem, _restrictions(traced, profile, tied)
    free = replace(problem, budget_bytes=None)
    names = ("data_parallel",) if restrictions.zero == "never" else BASELINES
    progress(f"mesh {shape}: pricing the textbook plans")
    books = textbooks(traced, tied, names, left_s(_TEXTBOOK_SHARE), backend, mesh.shape)
    setup_s = cpu_s() - began
    lean_base = books.get("zero3") or books.get("data_parallel")
    lean = [leanest_start(problem, lean_base, restrictions)] if lean_base else []

    def descended(fitting: Sequence[Solution], seconds: float) -> list[Solution]:
        """The fastest fitting starts' shardings improved one mesh axis at a time without the budget (`descent.py`:
        on a mesh of several axes the joint search is slow to find what descent finds in a second; with the memory
        row in, each of its steps is as hard as the whole), recompute and ZeRO then fitted to the budget."""
        if sum(n > 1 for n in mesh.shape) < 2:
            return []
        progress(f"mesh {shape}: improving {min(len(fitting), _DESCENTS)} plans one mesh axis at a time")
        began_s, out = cpu_s(), []
        for k, start in enumerate(fitting[:_DESCENTS]):
            share = (seconds - (cpu_s() - began_s)) / (min(len(fitting), _DESCENTS) - k)
            faster = descend(tied, mesh.shape, start.assignment, restrictions, share / 2, backend, free, SEARCH_GAP)
            if faster.time.total_s < start.time.total_s:
                fitted = fit_memory(problem, faster.assignment.choice, restrictions, backend, share / 2)
                out += [fitted] if fitted is not None else []
        return out

    fitting = sorted((b for b in books.values() if fits(problem, b)), key=lambda b: b.time.total_s)
    if cutoff_s is not None and fitting and fitting[0].time.total_s < cutoff_s:
        cutoff_s = None  # a plan here beats it: the search goes on as without one
    settled_s = fitting[0].time.total_s / (1 + margin) if margin is not None and fitting else None
    progress(f"mesh {shape}: searching (up to {max(left_s(_TIED_SHARE), 0):.0f} s)")
    try:
        sol = solve_problem(problem, left_s(_TIED_SHARE), backend, restrictions, SEARCH_GAP,
                            starts=[b.assignment for b in books.values()] + lean, improve=descended, cutoff_s=cutoff_s,
                            settled_s=settled_s)
    except Outpaced as beaten:
        log.info("solver: %s: %s", mesh, beaten)
        if not fitting:
            raise
        return MeshSearch(mesh, tied, fitting[0], tied, books, setup_s, beaten.bound_s)
    built = tied
    if left_s(1.0) > build_s:  # else the problem in runs of layers (larger than the tied one) would not even be built
        progress(f"mesh {shape}: deciding recompute and ZeRO per layer")
        built, sol = per_layer(traced, profile, mesh, tied, sol, restrictions, left_s(1.0), backend, sizes, SEARCH_GAP)
    log.info("solver: %s: est. step %.1f ms, %s in %.1f s", mesh, sol.time.total_s * 1e3, sol.report.status,
             cpu_s() - began)
    return MeshSearch(mesh, built, sol, tied, books, setup_s)


def solve(
    traced: TracedGraph,
    profile: GraphProfile | ConcreteProfile,
    mesh: Mesh,
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 30.0,
    backend: Literal["highs", "cbc"] = "highs",
    sizes: Mapping[str, int] | None = None,
    baselines: bool = False,
    margin: float = ROBUST_MARGIN,
    progress: Progress = _quiet,
    host_budget_bytes: float | None = None,
) -> Plan:
    """The fastest plan on `mesh` within the budget (default: the device memory), or the simplest within `margin`
    of it (`robust.py`; 0: the fastest); with `baselines`, the textbook plans priced on the same problem too
    (`Plan.baselines`). `progress` is told each step (`report.console.phase`). `host_budget_bytes`: the host
    tier offered, this many bytes per rank (`search_mesh`)."""
    found = search_mesh(traced, profile, mesh, budget_of(mesh, memory_budget_bytes), time_limit_s, backend, sizes,
                        progress, host_budget_bytes, margin=margin)
    return _chosen(traced, [found], baselines, margin)


def solve_for_devices(
    traced: TracedGraph,
    profile: GraphProfile | ConcreteProfile,
    num_devices: int,
    hardware: str = "h100",
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 30.0,
    backend: Literal["highs", "cbc"] = "highs",
    sizes: Mapping[str, int] | None = None,
    baselines: bool = False,
    margin: float = ROBUST_MARGIN,
    progress: Progress = _quiet,
    precision: Precision | None = None,
    host_budget_bytes: float | None = None,
) -> tuple[Plan, list[ShapeResult]]:
    """Try every logical shape of `num_devices` devices within `time_limit_s` in all (each shape gets an equal
    share of what is left); keep the fastest plan, or the simplest within `margin` of it (`baselines`: priced on
    its shape; `precision`: the math mode of its float32 matmuls, `make_mesh`'s). Each shape after a plan is in
    hand is searched against what its plan must beat to be chosen (`_cutoff_s`): its textbook plans are priced,
    and its search stops once the LP relaxation proves no plan on it beats that (`ShapeResult.bound_s`; LLaMA-7B
    on 8 x 24 GB: meshes 2x4 and 4x2 in 3-4 CPU s each, against mesh 8's plan)."""
    began = cpu_s()
    shapes = candidate_shapes(num_devices)
    found: list[MeshSearch] = []
    results: list[ShapeResult] = []
    errors: list[InfeasibleError] = []
    for k, shape in enumerate(shapes):
        share_s = max(0.0, time_limit_s - (cpu_s() - began)) / (len(shapes) - k)
        if found and share_s < max(f.setup_s for f in found):
            # a plan is in hand and this shape's share would not even build its problem and price its textbook
            # plans (as long as the costliest shape searched took): it would run past the time limit to no avail
            # (LLaMA-7B on 4x2 at 24 GB: 11 CPU-s from a share of 4 s, no plan found)
            results.append(ShapeResult(shape, None, None, "not searched: the time limit was spent on the shapes "
                                       "before it; raise time_limit_s to search it", searched=False))
            continue
        mesh = make_mesh(num_devices, shape, hardware, precision=precision)
        try:
            search = search_mesh(traced, profile, mesh, budget_of(mesh, memory_budget_bytes), share_s, backend, sizes,
                                 lambda step: progress(f"{step} ({k + 1} of {len(shapes)} shapes)"), host_budget_bytes,
                                 _cutoff_s(found, sum(n > 1 for n in shape), margin))
        except InfeasibleError as err:
            results.append(ShapeResult(shape, None, err.min_memory_bytes, str(err)))
            errors.append(err)
            continue
        except Outpaced as beaten:
            results.append(ShapeResult(shape, None, None, f"{beaten}, which a plan on this shape must beat to be chosen",
                                       bound_s=beaten.bound_s))
            continue
        books = [b.time.total_s for b in search.textbooks.values() if fits(search.tied.problem, b)]
        results.append(ShapeResult(shape, search.solution.time.total_s, search.solution.memory.total_bytes,
                                   textbook_s=min(books, default=None), bound_s=search.bound_s))
        found.append(search)
        fastest_s = min(f.solution.time.total_s for f in found)
        # a shape no candidate of which can be chosen any more is let go (its problems are large)
        found = [f for f in found if _fastest_candidate_s(f) <= fastest_s * (1 + margin)]
    for r in results:
        outcome = (f"{r.step_s * 1e3:.1f} ms" if r.step_s is not None else r.error if r.bound_s is not None
                   else "no plan fits" if r.searched else "not searched")
        log.info("solver: mesh %s: %s", "x".join(map(str, r.shape)), outcome)
    if not found:
        raise _least_need(errors)
    return _chosen(traced, found, baselines, margin), results


def _least_need(errors: list[InfeasibleError]) -> InfeasibleError:
    """The error to raise when no shape has a plan: one that names the least need; a proven one over a timeout."""
    proven = [e for e in errors if not isinstance(e, SearchTimeoutError)]
    pool = [e for e in (proven if len(proven) == len(errors) else errors) if e.min_memory_bytes is not None] or errors
    return min(pool, key=lambda e: e.min_memory_bytes or float("inf"))


def _cutoff_s(found: list[MeshSearch], axes: int, margin: float) -> float | None:
    """What a searched plan on a mesh of `axes` axes of more than one device must beat to change the choice among
    the plans `found` so far (None: nothing found yet): the plan that would be chosen now, by `margin` when that is
    on a mesh of fewer axes (simpler, it is chosen over any plan within `margin` of it), else outright (of one
    simplicity the faster is chosen). A faster plan that still would not be chosen may narrow the margin's window
    around the fastest; the search does not go after such plans."""
    if not found:
        return None
    choice, _ = simplest_within(list(_candidates(found)), margin)
    if choice.simplicity[0] > axes:
        return None
    return choice.step_s / (1 + margin) if choice.simplicity[0] < axes else choice.step_s


def _fastest_candidate_s(search: MeshSearch) -> float:
    books = [b.time.total_s for b in search.textbooks.values() if fits(search.tied.problem, b)]
    return min([search.solution.time.total_s, *books])


def _candidates(found: list[MeshSearch]) -> dict[Candidate, tuple[MeshSearch, BuiltProblem, Solution]]:
    """The plans the search may answer with: each mesh's searched plan and its textbook plans that fit."""
    candidates: dict[Candidate, tuple[MeshSearch, BuiltProblem, Solution]] = {}
    for search in found:
        axes = sum(n > 1 for n in search.mesh.shape)
        candidates[Candidate("searched", search.solution.time.total_s, (axes, len(BASELINES)))] = \
            (search, search.built, search.solution)
        for name, book in search.textbooks.items():
            if fits(search.tied.problem, book):
                candidates[Candidate(name, book.time.total_s, (axes, BASELINES.index(name)))] = (search, search.tied, book)
    return candidates


def _chosen(traced: TracedGraph, found: list[MeshSearch], baselines: bool, margin: float) -> Plan:
    """The plan to answer with: the simplest candidate (a textbook plan that fits, the searched plan, on any shape
    searched) within `margin` of the fastest; a note says so when that is not the fastest, and what the plan is
    worth when the time limit stopped the search."""
    candidates = _candidates(found)
    choice, fastest = simplest_within(list(candidates), margin)
    search, built, sol = candidates[choice]
    searched = search.solution.report
    # the report of the search that found it, the gap against the bound that search proved no plan beats
    bound_s = search.solution.time.total_s * (1 - (searched.gap or 0.0))
    gap = 1 - bound_s / sol.time.total_s
    sol = replace(sol, report=replace(searched, gap=gap if gap > 1e-4 else None))
    plan = to_plan(traced, search.mesh, built, sol)
    notes = list(plan.notes)
    if choice != fastest:
        notes.append(f"chose {_describe(choice, search.mesh)} ({choice.step_s * 1e3:.4g} ms a step) over "
                     f"{_describe(fastest, candidates[fastest][0].mesh)} ({fastest.step_s * 1e3:.4g} ms), which the cost "
                     f"model predicts {choice.step_s / fastest.step_s:.3f}x faster: a gain inside its measured error "
                     f"of {margin:.0%}, where the simpler plan is the safer bet")
    if sol.report.status in ("time_limit", "leanest"):
        notes.append(_worth(sol, search))
    if baselines:
        plan = replace(plan, baselines=baseline_results(search.tied.problem, search.textbooks))
    return replace(plan, notes=tuple(notes))


def _describe(c: Candidate, mesh: Mesh) -> str:
    what = {"data_parallel": "pure data parallel", "zero3": "ZeRO-3", "megatron": "Megatron TP + DP"}.get(c.name, "the searched plan")
    return f"{what} on mesh {'x'.join(map(str, mesh.shape))}"


def _worth(sol: Solution, search: MeshSearch) -> str:
    """What a plan the time limit stopped the search at is worth: its gap, and its rank against the textbook plans."""
    gap = sol.report.gap or 0.0
    worth = f"within {gap:.1%} of the best possible step" if gap < 1 else "not yet bounded by the search"
    fitting = {n: b.time.total_s for n, b in search.textbooks.items() if fits(search.tied.problem, b)}
    if not fitting:
        rank = "no textbook plan fits the budget"
    else:
        name, best_s = min(fitting.items(), key=lambda kv: kv[1])
        rank = f"{best_s / sol.time.total_s:.2f}x as fast as the fastest textbook plan that fits ({name})"
    return f"the search stopped at its time limit: this plan is {worth} and {rank}; more time may find a faster one"
