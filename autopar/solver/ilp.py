"""The joint ILP: sharding strategy, ZeRO storage and recomputation under a memory budget.

Variables (per problem node v, option s; edge k from u to v; option classes a, b;
option groups g of v with equal recompute (resp. ZeRO) effect):
  x[v,s] in {0,1}   v runs option s
  e[k,a,b] in [0,1] u's option is in class a and v's in class b (continuous: forced
                    integral by the equalities below once x is integral)
  y[v,g] in {0,1}   v runs an option of group g and its saved activations are recomputed
  z[v,g] in {0,1}   v (a parameter) runs an option of group g and is stored ZeRO-sharded
  T >= 0            the largest transient (temporary or gathered parameter)
  u[g] in [0,1]     some gradient is bucket-synced over axis group g (continuous: its only
                    rows push it up and its cost down, so it sits at max x of those options)
One y (z) per group rather than per option: y <= sum_{s in g} x[v,s] is the per-option
formulation summed over the group (the same LP bound) with far fewer binaries
(Llama tiny on 2x2: 571 -> 72).

Constraint families (each PuLP constraint is named after its family):
  onehot_{v}          sum_s x[v,s] = 1                              (`_add_strategy_vars`)
  edge_src_{k}_{a}    sum_b e[k,a,b] = sum_{s in a} x[u,s]           (`_add_edges`: the equality
  edge_dst_{k}_{b}    sum_a e[k,a,b] = sum_{s in b} x[v,s]            form, not McCormick products)
  recompute_{v}_{g}   y[v,g] <= sum_{s in g} x[v,s]                  (`_add_recompute`)
  together_{u}_{v}    sum_g y[u,g] <= sum_g y[v,g]  (v's backward keeps u's output: recomputing u
                      alone frees nothing; `Problem.recompute_with`)
  apart_{u}_{v}       sum_g y[u,g] + sum_g y[v,g] <= 1  (v reads u across a layer boundary: v's region
                      would save u's output as its input; `Problem.region_inputs`)
  cut_{k}             o[v] >= sum_g y[u,g] + sum_g y[v,g] - 1 - sum_{m joins} sum_g y[m,g] - sum_{w between} o[w]
                      (v opens another checkpoint region after u's, unless a node on a path between them is
                      recomputed too or one between them opened a region already; `Problem.region_cuts`;
                      o[v] >= 0 continuous, its region's cost pushes it down)
  zero_{v}_{g}        z[v,g] <= sum_{s in g} x[v,s]  (= under "always") (`_add_zero`)
  zero_saving_{k}     zs[k] <= sum_{a,b} saving[k,a,b] e[k,a,b]   (`_add_zero_savings`: the bucketed all-reduce
  zero_saving_gate_{k} zs[k] <= M sum_g z[src,g]   a consumer split over src's ZeRO axes pays, which src's ZeRO
                      reduce-scatter takes over; the objective subtracts zs[k]; M = max saving[k])
  sync_{g}_{v}        u[g] >= sum_{s syncs over g} x[v,s]            (`_add_sync_groups`)
  shared_sync_{k}_{j} m[k] >= sum_s t[j,s] x[v_j,s]   (a parameter k several nodes' prices send to the bucketed
                      sync, node v_j's part t[j,s]; the objective adds m[k] - sum_j t[j,.] x: paid once, the
                      largest; `Problem.shared_syncs`, `_add_shared_syncs`)
  An edge k into a node that may be recomputed gets f[k,g] = e AND "dst recomputed", per group g of its pairs
  (a,b) with equal amounts (forward, kept, buffers) (`_add_recomputed_edges`):
  recomputed_edge_{k}_{g}  f[k,g] <= sum of e[k,a,b] over the pairs of group g
  recomputed_edge_{k}  sum_g f[k,g] = sum_g y[dst,g]   (exact at integral points, no big-M)
                      The objective adds forward[k,g] f[k,g] (a recomputed node runs its input reshards again in
                      backward); the memory row adds kept[k,a,b] e[k,a,b] - kept[k,g] f[k,g] (a consumer that saves
                      a resharded input keeps the resharded copy unless it is recomputed; an edge into a node never
                      recomputed adds kept . e alone)
  replaced_{k}        r[k] >= sum_{a,b} replaced[k,a,b] e[k,a,b] - M (1 - sum_g y[src,g]) - M sum_g y[dst,g]
                      (`_add_replaced_outputs`: a recomputed producer's output is not kept, so a consumer that
                      keeps its resharded copy holds the part `kept` counts as the producer's too)
  temp_{v}            T >= sum_s temp[v,s] x[v,s]                    (`_add_temp`)
  gather_{v}          T >= sum_g gathered[v,g] z[v,g]
  param_grad_{k}      T >= sum_{a,b} grad[k,a,b] e[k,a,b] + sum_g (gathered + grad)[u,g] z[u,g] + sum_s temp[v,s] x[v,s]:
                      the backward step of consumer v of parameter u makes u's whole gradient at its input spec beside
                      its own gradients, where edge k reshards u (`Edge.grad_bytes`) or u is stored ZeRO (re-gathered
                      then: `ZeroOption.backward_bytes`), before the reduce to u's spec (where v is a view of u, the
                      step and its temp are those of the op past the view: `Edge.grad_step`)
  param_grad_summed_{k}  T >= sum_{a,b} summed[k,a,b] e[k,a,b] - M sum_g z[u,g]: a later use of a parameter another
                      use made the gradient of first (tied) adds its gradient to that one, at u's spec once its step
                      and reshard are done: its gradient and autograd's sum (`Edge.accumulated_bytes`), unless u is
                      stored ZeRO (M: the largest summed)
  optimizer_step      T >= c (sum_{v,s} param[v,s] x[v,s] - sum_g (1 - 1/f[v,g]) param[v,g] z[v,g]): the optimizer
                      step's scratch, c per byte of the stepped parameters' local blocks, summed over them under
                      foreach (one row), one row per parameter v otherwise (`optimizer_step_{v}`, `_add_optimizer_step`)
  reshard_buffers_{k} T >= sum_{a,b} buffers[k,a,b] e[k,a,b]        (a reshard's buffers, `Edge.buffer_bytes`;
                      left out where no option pair exceeds the least temp some node must have)
  Backward rebuilds a recomputed layer r's activations together (a tied class counts one layer's share);
  `_add_rebuilds` follows the rebuild through the layer's nodes v in graph order with a chain of C's:
  rebuilt_{r}_upto_{v}  C_v >= C_(node before v) + sum_g saved[v,g] / copies[v] y[v,g]
                      + sum_{k into v, g} kept[k,g] / copies[v] f[k,g]   (resharded inputs saved again)
                      starting from sum_{p in layer r, g} gathered[p,g] q[p,g]: the layer's ZeRO parameters,
                      gathered again by the rebuild and saved by it, where q >= z + R_r - 1, R_r >= each y of
                      layer r (continuous, pushed down by the memory row: q = z AND "r rebuilt")
  rebuild_reshard_{r}_{v}_{j}  T >= C_(node before v) + sum_g buffers[k,g] f[k,g]: the recompute runs a reshard
                      into v again, its buffers beside what the layer rebuilt so far (one row per edge k)
  (R_r also pays the layer's checkpoint region in the objective: `Problem.region_s` per layer it stands for)
  rebuild_{r}_grad_{v}  T >= C_(node before v) + sum_g saved[k,g] f[k,g] + flow[v,g] y[v,g]: backward's step
                      through v in the rebuilt layer holds what was rebuilt before v (later nodes' saved tensors
                      are freed by then; so are v's outputs, unless v's own backward keeps them: in flow), the
                      inputs v saved again, and the gradients of the step: the one arriving and those v makes for
                      its activation inputs (a gated MLP's product makes two of its own size beside the one arriving)
  rebuild_{r}         T >= C_last: the whole rebuilt layer
  host_{v}_{g}        h[v,g] <= sum_{s in g} x[v,s]: v's parameter keeps its optimizer state on the host and is
                      stepped there (`_add_host_tier`, where `Problem.host_budget_bytes` offers the tier and
                      `Restrictions.offload` is "free"); the objective adds its tier's copies and host step less the
                      device step (`Option.host`, `solver.offload.tier_cost`), the memory row takes its optimizer state
                      off, the optimizer_step row its scratch
  host_zero_{v}_{g}   hz[v,g] = h AND "v ZeRO-sharded" (hz <= h, hz <= sum_g z, hz >= h + sum_g z - 1; continuous):
                      under ZeRO the tier holds, moves and steps 1/factor, the device keeps no state (hz gives back what
                      z and h took twice)
  host_memory         sum host_bytes[v,g] h - (1 - 1/f) host_bytes[v,g] hz <= Problem.host_budget_bytes (per rank)
  lean_in_flight_{v}_{g}  G >= in_flight[v,g] (h - hz): under mixed precision h without ZeRO is ZeRO-Offload's layout
                      (`TierCost.layout`: the master and its gradient off the device, the bf16 copy's bytes over the link);
                      its gradient is on the device only in the sync's buckets, G the most in flight (in the memory row)
  host_zero_forced_{v}_{g}, lean_in_flight_forced_{v}_{g}: a tier the caller forced (`Option.forced_host`, `offload=`
                      names) priced as above with h = sum_{s in g} x[v,s] (no binary: 1 wherever v takes group g)
  memory              sum_{v,s} static[v,s] x - sum_g (1 - 1/f[v,g]) static[v,g] z
                      + saved[v,s] x - sum_g (saved[v,g] - held[v,g]) y + sum_k (kept . e - kept . f + r[k]) + T <= budget
                      (`add_memory_limit`; held: a recomputed region's inputs from other layers)
Objective (time of one step):
  sum (compute + comm)[v,s] x + zero_comm[v,g] z + recompute[v,g] y + sum cost[k,a,b] e[k,a,b] - sum_k zs[k]
  + sum_g sync_latency[g] u[g]   (one gradient bucket's latency per group used, `cost.sync_latency_s`)
  + sum_k forward . f[k] + sum_r region_s copies[r] R_r   (one checkpoint region per layer with recomputed nodes)
  + sum_v region_s copies[v] o[v]   (and one more per node that opens another, in each layer it stands for)
  + 1 us per GiB of the memory expression (a tie-break: equally fast plans -> the leaner one)
For the infeasible report the same model minimises the memory expression instead.

Solving: `anytime.solve_problem` runs this model without the memory row, then with it from a valid start
(`_Model.start_from`), within one time limit; `run` is one HiGHS solve (presolve on once the memory row is in,
see `backends.make_solver`).

Times are entered in milliseconds and bytes in GiB, or in a smaller power of two for a
model whose most replicated plan needs less (`memory_unit_bytes`), so coefficients stay
near 1 for the solver's tolerances; everything outside this module is seconds/bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Mapping

import pulp

from autopar.solver.clock import cpu_s
from autopar.solver.cost import GRAD_BUCKET_BYTES
from autopar.solver.evaluate import lean_gradient_bytes, recomputable_options
from autopar.solver.offload import TierCost, lean_in_flight_bytes
from autopar.solver.backends import Backend, make_solver
from autopar.solver.plan import MemoryBreakdown, SolverReport, TimeBreakdown
from autopar.solver.problem import Assignment, Option, Problem

_MS = 1e3
_GIB = float(2**30)
# Tie-break: among equally fast plans prefer the leaner one (1 us per GiB: far below any real time difference).
_TIE_MS_PER_GIB = 1e-3
_LEAST_COST_MS = 1e-9
# A solve started when the time is up still runs this long: enough to take a MIP start and report a bound
_LEAST_RUN_S = 0.05
# HiGHS' primal_solution_status of a solution in hand (kSolutionStatusFeasible)
_FEASIBLE = 2
# the memory row asks for this much less than the budget at most: 4e-6 of the memory unit (HiGHS' feasibility
# tolerance, see add_memory_limit), 4 KiB for a unit of 1 GiB
MEMORY_SLACK_BYTES = 4096.0
# HiGHS' own default relative MIP gap: "optimal" means within 0.01% of the best possible step time.
DEFAULT_GAP = 1e-4


def memory_unit_bytes(problem: Problem) -> float:
    """The unit bytes enter the model in: GiB, or the power of two at or below what the problem's most
    replicated plan needs (every node's largest option) when that is less.

    HiGHS' tolerances are absolute: a cost under 1e-7 counts as zero and a row may be exceeded by 1e-6.
    A tiny model in GiB (a few MB: 0.002) minimised its memory among plans the solver could not tell apart:
    Mixtral-tiny on 2x2 reported a least memory of 2.43 MB where a 1.34 MB plan exists (Qwen2-tiny: 1.06
    against 0.59 MB), and a memory-bound plan exceeded its budget by up to 905 bytes beyond the 4 KiB slack.
    """
    most = sum(max((o.static_bytes + o.saved_bytes for o in node.options), default=0.0) for node in problem.nodes)
    if most <= 0.0:
        return _GIB
    return min(_GIB, 2.0 ** math.floor(math.log2(most)))


@dataclass(frozen=True)
class Restrictions:
    """Narrowing of the search, used for baselines (pure DP, FSDP, Megatron) and fixed plans."""

    allowed: Mapping[int, frozenset[int]] = field(default_factory=dict)  # node -> option indices it may take
    zero: Literal["free", "never", "always"] = "free"  # "always": every param with a ZeRO option uses it
    recompute: Literal["free", "never"] = "free"
    zero_nodes: Mapping[int, bool] = field(default_factory=dict)  # node -> its ZeRO storage forced on or off
    # "free": each parameter's tier decided where the problem offers the host tier (`Problem.host_budget_bytes`)
    offload: Literal["never", "free"] = "never"


@dataclass(frozen=True)
class Solution:
    assignment: Assignment
    memory: MemoryBreakdown
    time: TimeBreakdown
    report: SolverReport


def _node_vars(table: Mapping[tuple[int, int], pulp.LpVariable], v: int, num_options: int) -> list[pulp.LpVariable]:
    """Node v's group binaries in a (node, option) -> variable table (`_Model.y` or `_Model.z`), each once, in
    option order (looked up per option: a scan of the whole table per call took 1.7 s of LLaMA-7B's model builds)."""
    return list({table[v, s]: None for s in range(num_options) if (v, s) in table})


class _Prob(pulp.LpProblem):
    """pulp's problem, whose `variables()` is found once per set of rows. pulp's walks every row and sorts the
    variables on each call, and its HiGHS path calls it three times a solve: 10 of 67 CPU-s of LLaMA-7B's search
    on 8 x 24 GB. Rows are only added (`+=`, none is edited in place) and pulp adds a dummy variable to a constant
    objective, so the row count and the objective's identity and length tell when the variables may have changed."""

    _found_for: tuple[int, int, int] | None = None

    def variables(self) -> list[pulp.LpVariable]:
        key = (len(self._constraints), id(self.objective), -1 if self.objective is None else len(self.objective))
        if key != self._found_for:
            self._found = super().variables()
            self._found_for = key
        return self._found


def _pair_terms(ev: list[list[pulp.LpVariable | None]], table: tuple[tuple[float, ...], ...], unit: float
                ) -> list[tuple[pulp.LpVariable, float]]:
    """An edge's per-class-pair amounts (`Edge.saved_bytes`, `forward_s`...) on its e[a][b], in ILP units; zeros and
    pairs the restrictions rule out left out."""
    return [(ev[a][b], c * unit) for a, row in enumerate(table) for b, c in enumerate(row) if c > 0 and ev[a][b] is not None]


def _affine(terms: list[tuple[pulp.LpVariable, float]]) -> pulp.LpAffineExpression:
    """Sum of coefficient * variable; a variable may appear several times (LpAffineExpression keeps only the last)."""
    total: dict[pulp.LpVariable, float] = {}
    for var, coef in terms:
        total[var] = total.get(var, 0.0) + coef
    return pulp.LpAffineExpression(list(total.items()))


class _Model:
    """The PuLP model of one Problem; `objective` picks time (the plan) or memory (the infeasible report)."""

    def __init__(self, problem: Problem, restrictions: Restrictions, objective: Literal["time", "memory"]):
        self.problem = problem
        self.restrictions = restrictions
        self.per_byte = 1.0 / memory_unit_bytes(problem)
        self.prob = _Prob(f"autopar_{objective}", pulp.LpMinimize)
        self.time_terms: list[tuple[pulp.LpVariable, float]] = []
        self.memory_terms: list[tuple[pulp.LpVariable, float]] = []
        self._add_strategy_vars()
        self._add_edges()
        self._add_recompute()
        self._add_recomputed_edges()
        self._add_replaced_outputs()
        self._add_zero()
        self._add_host_tier()
        self._add_zero_savings()
        self._add_sync_groups()
        self._add_shared_syncs()
        self._add_temp()
        if objective == "time":
            tie = _TIE_MS_PER_GIB / (self.per_byte * _GIB)  # per unit of the memory terms
            # Tie terms under 1e-9 ms are left out: below HiGHS' tolerances they tell no plans apart, and such
            # costs (7e-12 on Qwen2-tiny 2x2 at 1.2 MB) stalled HiGHS in a restart past its time limit
            terms = self.time_terms + [(var, c * tie) for var, c in self.memory_terms if abs(c * tie) >= _LEAST_COST_MS]
        else:
            terms = self.memory_terms
        self.prob += _affine(terms), "objective"
        self.variables = self.prob.variables()  # pulp finds them anew on every call: once here

    def _add_strategy_vars(self) -> None:
        self.x = []
        for v, node in enumerate(self.problem.nodes):
            allowed = self.restrictions.allowed.get(v)
            if allowed is not None and not allowed:
                raise ValueError(f"restrictions leave node {node.name!r} no option")
            xs = []
            for s, o in enumerate(node.options):
                # LpBinary would reset the bounds: a 0/1 integer whose upper bound 0 rules the option out.
                ub = 1 if allowed is None or s in allowed else 0
                var = pulp.LpVariable(f"x_{v}_{s}", lowBound=0, upBound=ub, cat=pulp.LpInteger)
                xs.append(var)
                self.time_terms.append((var, (o.compute_s + o.comm_s) * _MS))
                self.memory_terms.append((var, (o.static_bytes + o.saved_bytes) * self.per_byte))
            self.prob += pulp.lpSum(xs) == 1, f"onehot_{v}"
            self.x.append(xs)

    def _allowed(self, v: int) -> frozenset[int]:
        allowed = self.restrictions.allowed.get(v)
        return frozenset(range(len(self.problem.nodes[v].options))) if allowed is None else allowed

    def _add_edges(self) -> None:
        """Pairs of option classes that the restrictions rule out get no variable (None in e[k][a][b]): a baseline's
        or a fixed sharding's model is then a small part of the whole (LLaMA-7B on 4x2: 65k variables, most of
        them edge pairs)."""
        self.e: dict[int, list[list[pulp.LpVariable | None]]] = {}  # edge index -> e[k][a][b]
        for k, e in enumerate(self.problem.edges):
            if not any(c for row in e.cost_s for c in row) and e.saved_bytes is None and e.zero_saving_s is None \
                    and e.replaced_bytes is None and e.buffer_bytes is None and e.grad_bytes is None and e.accumulated_bytes is None:
                continue  # free in every combination, saves and holds nothing, no ZeRO saving: no variables needed
            rows, cols = len(e.cost_s), len(e.cost_s[0])
            src = {e.src_class[s] for s in self._allowed(e.src)}
            dst = {e.dst_class[s] for s in self._allowed(e.dst)}
            ev = [[pulp.LpVariable(f"e_{k}_{a}_{b}", lowBound=0, upBound=1) if a in src and b in dst else None
                   for b in range(cols)] for a in range(rows)]
            self.e[k] = ev
            for a in sorted(src):
                members = [self.x[e.src][s] for s, c in enumerate(e.src_class) if c == a]
                self.prob += pulp.lpSum(var for var in ev[a] if var is not None) == pulp.lpSum(members), f"edge_src_{k}_{a}"
            for b in sorted(dst):
                members = [self.x[e.dst][s] for s, c in enumerate(e.dst_class) if c == b]
                self.prob += pulp.lpSum(ev[a][b] for a in range(rows) if ev[a][b] is not None) == pulp.lpSum(members), \
                    f"edge_dst_{k}_{b}"
            self.time_terms.extend((ev[a][b], c * _MS) for a, row in enumerate(e.cost_s) for b, c in enumerate(row)
                                   if c and ev[a][b] is not None)

    def _groups(self, v: int, key) -> dict:
        """Options of node v that may be chosen, grouped by `key(option)` (None: no variable needed), in index order."""
        allowed = self.restrictions.allowed.get(v)
        groups: dict = {}
        for s, o in enumerate(self.problem.nodes[v].options):
            k = key(o)
            if k is not None and (allowed is None or s in allowed):
                groups.setdefault(k, []).append(s)
        return groups

    def _add_recompute(self) -> None:
        # One binary per group of options that save and recompute the same amounts, not per option:
        # y <= sum of the group's x is the same polytope projected (as tight), with far fewer binaries.
        self.y: dict[tuple[int, int], pulp.LpVariable] = {}  # (node, option) -> its group's variable
        if self.restrictions.recompute == "never":
            return
        may = recomputable_options(self.problem)
        for v in range(len(self.problem.nodes)):
            # the gradient through the node is in the key too: a rebuilt layer counts its widest node's
            groups = self._groups(v, lambda o: (o.saved_bytes, o.recompute_s, o.grad_flow_bytes, o.held_input_bytes))
            groups = {key: [s for s in members if s in may[v]] for key, members in groups.items()}
            groups = {key: members for key, members in groups.items() if members}
            for g, ((saved, recompute_s, _, held), members) in enumerate(groups.items()):
                y = pulp.LpVariable(f"y_{v}_{g}", cat=pulp.LpBinary)
                self.prob += y <= pulp.lpSum(self.x[v][s] for s in members), f"recompute_{v}_{g}"
                self.y.update(((v, s), y) for s in members)
                self.time_terms.append((y, recompute_s * _MS))
                self.memory_terms.append((y, (held - saved) * self.per_byte))
        for u, v in self.problem.recompute_with:
            if self._recomputed(u):
                self.prob += pulp.lpSum(self._recomputed(u)) <= pulp.lpSum(self._recomputed(v)), f"together_{u}_{v}"
        for u, v in self.problem.region_inputs:
            if self._recomputed(u) and self._recomputed(v):
                self.prob += pulp.lpSum(self._recomputed(u)) + pulp.lpSum(self._recomputed(v)) <= 1, f"apart_{u}_{v}"
        opens: dict[int, pulp.LpVariable] = {}  # v -> "v opens another region" (continuous, pushed down by its cost)
        for k, cut in enumerate(self.problem.region_cuts):  # in graph order of `second`: `between`'s are made
            u, v = cut.first, cut.second
            if not (self.problem.region_s and self._recomputed(u) and self._recomputed(v)):
                continue
            if v not in opens:
                opens[v] = pulp.LpVariable(f"opens_{v}", lowBound=0)
                self.time_terms.append((opens[v], self.problem.region_s * self.problem.nodes[v].copies * _MS))
            joined = [y for m in cut.joins for y in self._recomputed(m)]
            self.prob += (opens[v] >= pulp.lpSum(self._recomputed(u)) + pulp.lpSum(self._recomputed(v)) - 1
                          - pulp.lpSum(joined) - pulp.lpSum(opens[m] for m in cut.between if m in opens), f"cut_{k}")

    def _recomputed(self, v: int) -> list[pulp.LpVariable]:
        """Node v's recompute binaries (one per option group; their sum is 1 when v is recomputed)."""
        return _node_vars(self.y, v, len(self.problem.nodes[v].options))

    def _add_recomputed_edges(self) -> None:
        """What an edge into a recomputed node v costs or holds, on f = e[k,a,b] AND "v recomputed": the recompute
        runs the edge's reshard again (`Edge.forward_s`, in time); a kept v keeps the resharded copy it saves
        (`Edge.saved_bytes`), a recomputed one does not (memory: kept . e - kept . f); and backward's rebuild of
        v's layer saves that copy again and runs the reshard's buffers (`_add_rebuilds` reads `rebuilt_saves`
        and `rebuilt_holds`).

        Linearised without a big-M: per distinct (forward, kept, buffers) amount one f <= the sum of the e of
        the pairs with that amount, the f's summing to v's recompute flag. Equal to the product at integral
        points, and as tight as the product's own polytope projected: a fractional recompute flag takes the
        amounts of the pairs e actually weighs, where a big-M row (w >= forward . e - M (1 - y)) let a half
        recomputed node rerun its reshards for nothing. (Most pairs share a few amounts: far fewer variables
        than one per pair. A big-M row per edge for the rebuild's terms had stalled an 8x8 solve past 30 s.)"""
        self.rebuilt_saves: dict[int, list[tuple[pulp.LpVariable, float]]] = {}  # v -> (f, copy saved again)
        self.rebuilt_holds: dict[int, list[list[tuple[pulp.LpVariable, float]]]] = {}  # v -> per edge (f, buffers)
        self.rebuilt_grads: dict[int, list[tuple[pulp.LpVariable, float]]] = {}  # v -> (f, parameter gradient made)
        for k, ev in self.e.items():
            e = self.problem.edges[k]
            node = self.problem.nodes[e.dst]
            if e.saved_bytes is not None:
                self.memory_terms.extend(_pair_terms(ev, e.saved_bytes, self.per_byte))  # kept unless v is recomputed
            recomputed = self._recomputed(e.dst)
            if not recomputed:
                continue
            rebuilt = node.region is not None  # backward rebuilds v's layer: its reshards' buffers count there
            amounts: dict[tuple[float, float, float, float], list[pulp.LpVariable]] = {}
            for a, row in enumerate(ev):
                for b, var in enumerate(row):
                    if var is None:
                        continue
                    amount = tuple(0.0 if table is None else table[a][b]
                                   for table in (e.forward_s, e.saved_bytes, e.buffer_bytes if rebuilt else None,
                                                 e.grad_bytes if rebuilt else None))
                    amounts.setdefault(amount, []).append(var)
            if set(amounts) == {(0.0, 0.0, 0.0, 0.0)}:
                continue  # recomputing v changes nothing of this edge
            fs, held = [], []
            for g, ((forward_s, kept, buffers, grads), members) in enumerate(amounts.items()):
                f = pulp.LpVariable(f"recomputed_edge_{k}_{g}", lowBound=0)
                self.prob += f <= pulp.lpSum(members), f"recomputed_edge_{k}_{g}"
                fs.append(f)
                if forward_s > 0:
                    self.time_terms.append((f, forward_s * _MS))
                if kept > 0:
                    self.memory_terms.append((f, -kept * self.per_byte))
                    if rebuilt:
                        self.rebuilt_saves.setdefault(e.dst, []).append((f, kept / node.copies * self.per_byte))
                if buffers > 0:
                    held.append((f, buffers * self.per_byte))
                if grads > 0:
                    self.rebuilt_grads.setdefault(e.dst, []).append((f, grads * self.per_byte))
            self.prob += pulp.lpSum(fs) == pulp.lpSum(recomputed), f"recomputed_edge_{k}"
            if held:
                self.rebuilt_holds.setdefault(e.dst, []).append(held)

    def _add_replaced_outputs(self) -> None:
        """A recomputed producer's output is not kept; a consumer that keeps its resharded copy (not recomputed)
        then holds all of the copy, not only what `saved_bytes` adds to the producer's shard (`Edge.replaced_bytes`)."""
        for k, ev in self.e.items():
            e = self.problem.edges[k]
            src_y = self._recomputed(e.src)
            if e.replaced_bytes is None or not src_y:
                continue
            terms = _pair_terms(ev, e.replaced_bytes, self.per_byte)
            if not terms:
                continue
            big_m = max(c for _, c in terms)
            w = pulp.LpVariable(f"r_{k}", lowBound=0)
            off = big_m * (1 - pulp.lpSum(src_y)) + big_m * pulp.lpSum(self._recomputed(e.dst))
            self.prob += w >= pulp.LpAffineExpression(terms) - off, f"replaced_{k}"
            self.memory_terms.append((w, 1.0))

    def _add_zero(self) -> None:
        # Grouped like recompute: options with the same ZeRO saving, price and gathered size share a binary.
        self.z: dict[tuple[int, int], pulp.LpVariable] = {}
        self.gathered: dict[int, list[tuple[pulp.LpVariable, float]]] = {}  # node -> (z, gathered GiB)
        self.zero_backward: dict[int, list[tuple[pulp.LpVariable, float]]] = {}  # node -> (z, `backward_bytes` GiB)
        self.zero_grads: dict[int, list[tuple[pulp.LpVariable, float]]] = {}  # node -> (z, its whole gradient GiB)
        if self.restrictions.zero == "never":
            return
        for v, node in enumerate(self.problem.nodes):
            forced = self.restrictions.zero_nodes.get(v)
            if forced is False:
                continue
            def key(o: Option):
                if o.zero is None or o.zero.factor <= 1:
                    return None
                return ((1 - 1 / o.zero.factor) * o.static_bytes, o.zero.comm_s - o.zero.update_saving_s, o.zero.gathered_bytes,
                        o.zero.grad_bytes)
            for g, ((saving, net_s, gathered, grad), members) in enumerate(self._groups(v, key).items()):
                z = pulp.LpVariable(f"z_{v}_{g}", cat=pulp.LpBinary)
                chosen = pulp.lpSum(self.x[v][s] for s in members)
                self.prob += (z == chosen if self.restrictions.zero == "always" or forced else z <= chosen), f"zero_{v}_{g}"
                self.z.update(((v, s), z) for s in members)
                self.time_terms.append((z, net_s * _MS))
                self.memory_terms.append((z, -saving * self.per_byte))
                self.gathered.setdefault(v, []).append((z, gathered * self.per_byte))
                self.zero_backward.setdefault(v, []).append((z, (gathered + grad) * self.per_byte))
                self.zero_grads.setdefault(v, []).append((z, grad * self.per_byte))

    def _add_host_tier(self) -> None:
        """h[v,g]: v's parameter (an option of group g) keeps its optimizer state on the host and is stepped there
        (`solver.offload`): the device holds no optimizer state for it and runs no step; the step pays the host
        tier's copies and host step (`TierCost.step_s`). Under ZeRO storage every part of that is 1/factor, so
        hz[v,g] = h AND "v ZeRO-sharded" (continuous, exact at integral points by its three rows) carries the
        difference: the device keeps the 1/factor of the state ZeRO would have kept, the tier moves and steps
        1/factor, and the device step ZeRO saved is not saved twice. host_memory: the tier's host bytes per rank
        within `Problem.host_budget_bytes`. Under mixed precision h alone (not hz) takes ZeRO-Offload's layout
        (`TierCost.layout`): the master and its gradient off the device too, the copies' bytes over the link, and
        G >= in-flight bytes (h - hz) per parameter (`lean_in_flight`): the largest lean gradient in flight.
        A tier the caller forced (`Option.forced_host`) is priced alike with h = the sum of its group's x (fixed to 1
        wherever the parameter is), its device state and step out of the option's numbers already."""
        self.h: dict[tuple[int, int], pulp.LpVariable] = {}
        self.host_terms: list[tuple[pulp.LpVariable, float]] = []
        self.unstepped: dict[int, list[tuple[pulp.LpVariable, float]]] = {}  # node -> its step scratch taken off
        self._in_flight: pulp.LpVariable | None = None  # G, made with the first lean tier
        offered = self.restrictions.offload != "never" and self.problem.host_budget_bytes is not None
        lean_total = lean_gradient_bytes(self.problem, offered)
        for v, node in enumerate(self.problem.nodes):
            zs = _node_vars(self.z, v, len(node.options))
            forced = self._groups(v, lambda o: o.forced_host and (o.forced_host, o.zero.factor if o.zero else 1))
            for g, ((tier, factor), members) in enumerate(forced.items()):
                self._add_tier(f"forced_{v}_{g}", v, [self.x[v][s] for s in members], tier, factor, zs, lean_total)
            if not offered:
                continue
            def key(o: Option):
                if o.host is None:
                    return None
                return o.host, o.update_s, o.optimizer_bytes, o.param_bytes, o.zero
            for g, ((tier, update_s, optimizer_bytes, param_bytes, zero), members) in enumerate(self._groups(v, key).items()):
                h = pulp.LpVariable(f"h_{v}_{g}", cat=pulp.LpBinary)
                self.prob += h <= pulp.lpSum(self.x[v][s] for s in members), f"host_{v}_{g}"
                self.h.update(((v, s), h) for s in members)
                self._add_tier(f"{v}_{g}", v, [h], tier, zero.factor if zero else 1, zs, lean_total,
                               update_s, optimizer_bytes, param_bytes, zero.update_saving_s if zero else 0.0)
        if self.host_terms and self.problem.host_budget_bytes is not None:
            self.prob += _affine(self.host_terms) <= self.problem.host_budget_bytes * self.per_byte, "host_memory"

    def _add_tier(self, name: str, v: int, h: list[pulp.LpVariable], tier: TierCost, factor: float,
                  zs: list[pulp.LpVariable], lean_total: float, update_s: float = 0.0, optimizer_bytes: float = 0.0,
                  param_bytes: float = 0.0, update_saving_s: float = 0.0) -> None:
        """The terms and rows of one host tier of node v on h (the sum of `h`: 1 when the tier is v's): its step,
        the device bytes it frees and holds in flight, its host bytes; under ZeRO storage (hz) its float32 layout of
        1/factor. `update_s`, `optimizer_bytes`, `param_bytes`, `update_saving_s`: what the device's step and state
        would be without it (0 for a forced tier, out of the option already)."""
        def on(coef: float) -> list[tuple[pulp.LpVariable, float]]:
            return [(var, coef) for var in h]
        lean = tier.layout(1)
        self.time_terms.extend(on((lean.step_s - update_s) * _MS))
        self.memory_terms.extend(on(-(optimizer_bytes + lean.lean_bytes_saved) * self.per_byte))
        self.host_terms.extend(on(tier.host_bytes * self.per_byte))
        if param_bytes:
            self.unstepped.setdefault(v, []).extend(on(-param_bytes))
        both = self._host_and_zero(name, h, zs) if factor > 1 and zs else None
        flight = lean_in_flight_bytes(lean, GRAD_BUCKET_BYTES, lean_total) * self.per_byte
        if flight > 0:
            if self._in_flight is None:
                self._in_flight = pulp.LpVariable("G", lowBound=0)
                self.memory_terms.append((self._in_flight, 1.0))
            self.prob += self._in_flight >= flight * (pulp.lpSum(h) - (both if both is not None else 0)), f"lean_in_flight_{name}"
        if both is None:
            return
        rest = 1 - 1 / factor
        self.time_terms.append((both, (update_saving_s + tier.layout(factor).step_s - lean.step_s) * _MS))
        self.memory_terms.append((both, (rest * optimizer_bytes + lean.lean_bytes_saved) * self.per_byte))
        self.host_terms.append((both, -rest * tier.host_bytes * self.per_byte))
        if param_bytes:
            self.unstepped[v].append((both, rest * param_bytes))

    def _host_and_zero(self, name: str, h: list[pulp.LpVariable], zs: list[pulp.LpVariable]) -> pulp.LpVariable:
        """hz = h AND "v ZeRO-sharded" (continuous, exact at integral points by its three rows)."""
        both = pulp.LpVariable(f"hz_{name}", lowBound=0, upBound=1)
        self.prob += both <= pulp.lpSum(h), f"host_zero_{name}_h"
        self.prob += both <= pulp.lpSum(zs), f"host_zero_{name}_z"
        self.prob += both >= pulp.lpSum(h) + pulp.lpSum(zs) - 1, f"host_zero_{name}"
        return both

    def _add_zero_savings(self) -> None:
        """A ZeRO parameter's reduce-scatter takes over the bucketed all-reduce of its gradient that a consumer
        split over its ZeRO axes pays (`Edge.zero_saving_s`): a saving on the edge, gated by the parameter's z."""
        for k, ev in self.e.items():
            e = self.problem.edges[k]
            zs = _node_vars(self.z, e.src, len(self.problem.nodes[e.src].options)) if e.zero_saving_s is not None else []
            if not zs:
                continue
            terms = _pair_terms(ev, e.zero_saving_s, _MS)
            if not terms:  # no pair the restrictions leave saves anything
                continue
            saving = pulp.LpVariable(f"zs_{k}", lowBound=0)
            self.prob += saving <= pulp.LpAffineExpression(terms), f"zero_saving_{k}"
            self.prob += saving <= max(c for _, c in terms) * pulp.lpSum(zs), f"zero_saving_gate_{k}"
            self.time_terms.append((saving, -1.0))

    def _add_sync_groups(self) -> None:
        for g, (axes, latency_s) in enumerate(self.problem.sync_latency_s):
            u = pulp.LpVariable(f"u_{g}", lowBound=0, upBound=1)
            self.time_terms.append((u, latency_s * _MS))
            for v, node in enumerate(self.problem.nodes):
                members = [s for s, o in enumerate(node.options) if axes in o.sync_groups]
                if members:
                    self.prob += u >= pulp.lpSum(self.x[v][s] for s in members), f"sync_{g}_{v}"

    def _add_shared_syncs(self) -> None:
        for k, shared in enumerate(self.problem.shared_syncs):
            once = pulp.LpVariable(f"shared_sync_{k}", lowBound=0)  # pushed down to the largest consumer's part
            self.time_terms.append((once, _MS))
            for j, (v, seconds) in enumerate(shared.terms):
                terms = [(self.x[v][s], t) for s, t in enumerate(seconds) if t]
                self.prob += once >= pulp.LpAffineExpression(terms), f"shared_sync_{k}_{j}"
                self.time_terms.extend((x, -t * _MS) for x, t in terms)

    def _add_temp(self) -> None:
        self.temp = pulp.LpVariable("T", lowBound=0)
        self.memory_terms.append((self.temp, 1.0))
        for v, node in enumerate(self.problem.nodes):
            if any(o.temp_bytes > 0 for o in node.options):
                terms = [(self.x[v][s], o.temp_bytes * self.per_byte) for s, o in enumerate(node.options) if o.temp_bytes > 0]
                self.prob += self.temp >= pulp.LpAffineExpression(terms), f"temp_{v}"
        for v, terms in self.gathered.items():  # at most one of a node's z is 1: one row per node
            self.prob += self.temp >= pulp.LpAffineExpression(terms), f"gather_{v}"
        for k, e in enumerate(self.problem.edges):  # a consumer's step making a resharded or ZeRO parameter's gradient
            grads = _pair_terms(self.e[k], e.grad_bytes, self.per_byte) if e.grad_bytes is not None and k in self.e else []
            summed = _pair_terms(self.e[k], e.accumulated_bytes, self.per_byte) if e.accumulated_bytes is not None and k in self.e else []
            if not (grads or summed or e.src in self.zero_backward):
                continue
            own = [(self.x[e.grad_maker][s], o.temp_bytes * self.per_byte)
                   for s, o in enumerate(self.problem.nodes[e.grad_maker].options) if o.temp_bytes > 0]
            if grads or e.src in self.zero_backward:
                self.prob += self.temp >= _affine(self.zero_backward.get(e.src, []) + grads + own), f"param_grad_{k}"
            if summed:  # a later use's gradient summed into the first's, unless the parameter is stored ZeRO (z = 1)
                big_m = max(c for _, c in summed)
                off = [(z, -big_m) for z, _ in self.zero_grads.get(e.src, [])]
                self.prob += self.temp >= _affine(summed + off), f"param_grad_summed_{k}"
        self._add_optimizer_step()
        # a reshard's buffers (`Edge.buffer_bytes`); rows that no plan's T can bind (each node's least temp) left out
        floor = max((min(o.temp_bytes for o in node.options) for node in self.problem.nodes), default=0.0) * self.per_byte
        for k, ev in self.e.items():
            e = self.problem.edges[k]
            terms = _pair_terms(ev, e.buffer_bytes, self.per_byte) if e.buffer_bytes is not None else []
            if terms and max(c for _, c in terms) > floor:
                self.prob += self.temp >= pulp.LpAffineExpression(terms), f"reshard_buffers_{k}"
        self._add_rebuilds()

    def _add_optimizer_step(self) -> None:
        """optimizer_step: T >= the optimizer step's scratch (`Problem.step_scratch_per_param_byte` per byte of a
        stepped parameter's local block; ZeRO storage steps 1/factor of it), of every parameter at once under
        foreach, else of each parameter alone. The step runs after backward, when the activations are gone, but
        the memory row adds T to them: the scratch is counted as one more transient beside them, an over-count
        by at most the smaller of the two (a row of its own beside the static bytes alone made the MIP of a
        tight GPT-2 budget on 2x2 stop at its time limit with a 69% gap)."""
        per_byte = self.problem.step_scratch_per_param_byte * self.per_byte
        if per_byte <= 0:
            return
        terms: dict[int, list[tuple[pulp.LpVariable, float]]] = {}  # parameter node -> its scratch
        for v, node in enumerate(self.problem.nodes):
            for s, o in enumerate(node.options):
                if o.optimizer_bytes > 0:  # a frozen parameter is not stepped
                    terms.setdefault(v, []).append((self.x[v][s], o.param_bytes * per_byte))
        for z, (v, s) in {z: vs for vs, z in self.z.items()}.items():  # one saving per binary (its options share it)
            o = self.problem.nodes[v].options[s]
            if o.optimizer_bytes > 0 and o.zero is not None:
                terms[v].append((z, -(1 - 1 / o.zero.factor) * o.param_bytes * per_byte))
        for v, taken in self.unstepped.items():  # a parameter on the host tier is stepped there
            terms[v].extend((var, b * per_byte) for var, b in taken)
        if self.problem.step_scratch_foreach:
            rows = {"optimizer_step": [t for v_terms in terms.values() for t in v_terms]}
        else:
            rows = {f"optimizer_step_{v}": v_terms for v, v_terms in terms.items()}
        for name, row in rows.items():
            if row:
                self.prob += self.temp >= pulp.LpAffineExpression(row), name

    def _add_rebuilds(self) -> None:
        """What backward holds while it rebuilds a recomputed layer (see `evaluate`), as a chain over the layer's
        nodes in graph order: C_v >= C_(v before) + what v rebuilds (its saved bytes, the resharded inputs it saves
        again). The chain starts at the layer's ZeRO parameters, gathered again by the rebuild and saved by it.
        A reshard the recompute runs for v holds its buffers beside C_(before v); backward's step through v holds
        its gradients beside C_(before v) and the inputs v saved again. A row per reshard with the whole prefix in
        it would be long; the chain keeps every row short."""
        layers: dict[str, list[int]] = {}  # layer -> its nodes with recompute variables, in graph order
        for v in sorted({v for v, _ in self.y}):
            if self.problem.nodes[v].region is not None:
                layers.setdefault(self.problem.nodes[v].region, []).append(v)
        gathered: dict[str, list[tuple[pulp.LpVariable, float]]] = {}  # layer -> its parameters' (z, gathered GiB)
        for v, zs in self.gathered.items():
            gathered.setdefault(self.problem.nodes[v].region, []).extend(zs)
        zero_feeds: dict[int, list[int]] = {}  # consumer -> the parameters with ZeRO options it makes the gradient of
        for e in self.problem.edges:
            feeds = zero_feeds.setdefault(e.grad_maker, [])
            if e.src in self.zero_grads and e.src not in feeds:  # once per parameter, through however many edges
                feeds.append(e.src)
        for r, (region, nodes) in enumerate(layers.items()):
            ys = {v: {self.y[v, s]: o for s, o in enumerate(self.problem.nodes[v].options) if (v, s) in self.y} for v in nodes}
            # "layer r rebuilt", linearised from below (the memory row and the region's cost push it down)
            any_y = pulp.LpVariable(f"rebuilt_{r}", lowBound=0, upBound=1)
            for j, y in enumerate(y for v in nodes for y in ys[v]):
                self.prob += any_y >= y, f"rebuilt_{r}_{j}"
            if self.problem.region_s:
                copies = max(self.problem.nodes[v].copies for v in nodes)
                self.time_terms.append((any_y, self.problem.region_s * copies * _MS))
            before: list[tuple[pulp.LpVariable, float]] = []  # what the rebuild holds so far
            for j, (z, b) in enumerate(gathered.get(region, ())):  # q = z AND "layer r rebuilt"
                both = pulp.LpVariable(f"regather_{r}_{j}", lowBound=0)
                self.prob += both >= z + any_y - 1, f"regather_{r}_{j}"
                before.append((both, b))
            for v in nodes:
                node = self.problem.nodes[v]
                for j, edge_terms in enumerate(self.rebuilt_holds.get(v, ())):  # the recompute reshards v's input
                    self.prob += self.temp >= _affine(before + edge_terms), f"rebuild_reshard_{r}_{v}_{j}"
                # backward's step through v: the layer rebuilt before v, what v saved again, its gradients (on v's y),
                # the whole gradients it makes of parameters resharded into it (on f) or stored ZeRO (on z AND v's y)
                flow = [(y, o.grad_flow_bytes * self.per_byte) for y, o in ys[v].items() if o.grad_flow_bytes > 0]
                flow += self.rebuilt_grads.get(v, []) + self._zero_grads_into(v, list(ys[v]), zero_feeds)
                if flow:
                    self.prob += self.temp >= _affine(before + self.rebuilt_saves.get(v, []) + flow), f"rebuild_{r}_grad_{v}"
                made = [(y, o.saved_bytes / node.copies * self.per_byte) for y, o in ys[v].items() if o.saved_bytes > 0]
                made += self.rebuilt_saves.get(v, [])
                if made:
                    c = pulp.LpVariable(f"rebuilt_{r}_upto_{v}", lowBound=0)
                    self.prob += c >= _affine(before + made), f"rebuilt_{r}_upto_{v}"
                    before = [(c, 1.0)]
            self.prob += self.temp >= _affine(before), f"rebuild_{r}"

    def _zero_grads_into(self, v: int, ys: list[pulp.LpVariable], feeds: Mapping[int, list[int]]
                         ) -> list[tuple[pulp.LpVariable, float]]:
        """Per ZeRO group of a parameter feeding v (`feeds`: consumer -> those parameters): (w, its whole gradient)
        with w = z AND "v recomputed" (continuous, exact at integral points: w >= z + y - 1, pushed down by the memory row)."""
        terms = []
        for src in feeds.get(v, []):
            for j, (z, grad) in enumerate(self.zero_grads[src]):
                if grad <= 0:
                    continue
                w = pulp.LpVariable(f"rebuilt_zero_grad_{v}_{src}_{j}", lowBound=0)
                self.prob += w >= z + pulp.lpSum(ys) - 1, f"rebuilt_zero_grad_{v}_{src}_{j}"
                terms.append((w, grad))
        return terms

    def add_memory_limit(self) -> None:
        """The budget row (kept out of the model until the unconstrained optimum is known not to fit)."""
        if self.problem.budget_bytes is not None:
            # HiGHS may overshoot a row by its MIP feasibility tolerance (1e-6 units: in GiB ~1 KiB; seen: 1,034 bytes
            # over the row): ask for 4e-6 units less
            slack_bytes = MEMORY_SLACK_BYTES / (self.per_byte * _GIB)
            self.prob += _affine(self.memory_terms) <= (self.problem.budget_bytes - slack_bytes) * self.per_byte, "memory"

    def drop_memory_limit(self) -> None:
        """The budget row taken out again (`relax` adds it for one LP)."""
        self.prob._constraints.pop("memory", None)

    def start_from(self, a: Assignment) -> None:
        """A MIP start: every integer variable as `a` sets it (the solver completes the continuous ones; what an
        earlier solve left is cleared). Where `a` takes an option the restrictions rule out, the node is left for
        HiGHS to complete; recompute and ZeRO are set only where the model has their variables."""
        for var in self.variables:
            var.varValue = None
        for v, xs in enumerate(self.x):
            if xs[a.choice[v]].upBound == 0:  # an option the restrictions rule out: HiGHS completes this node
                continue
            for s, var in enumerate(xs):
                var.setInitialValue(1 if s == a.choice[v] else 0)
        offload = a.offload or (False,) * len(a.choice)
        for table, flags in ((self.y, a.recompute), (self.z, a.zero), (self.h, offload)):
            for (v, _), var in table.items():
                var.setInitialValue(0)
            for (v, s), var in table.items():
                if s == a.choice[v] and flags[v]:
                    var.setInitialValue(1)

    def assignment(self) -> Assignment:
        choice = tuple(max(range(len(xs)), key=lambda s: xs[s].varValue or 0.0) for xs in self.x)
        recompute = tuple((self.y.get((v, c)) is not None and (self.y[v, c].varValue or 0) > 0.5) for v, c in enumerate(choice))
        zero = tuple((self.z.get((v, c)) is not None and (self.z[v, c].varValue or 0) > 0.5) for v, c in enumerate(choice))
        offload = tuple((self.h.get((v, c)) is not None and (self.h[v, c].varValue or 0) > 0.5) for v, c in enumerate(choice))
        return Assignment(choice, recompute, zero, offload if any(offload) else ())


@dataclass(frozen=True)
class Outcome:
    """How one solve of a `_Model` ended."""

    status: Literal["optimal", "time_limit", "infeasible", "none"]  # none: the time limit passed with no solution
    backend: str
    solve_s: float
    gap: float | None  # relative gap left when it is worth reporting (above HiGHS' default 1e-4)
    bound: float | None = None  # the best objective any solution can reach, as the solver proved it (model units)

    @property
    def found(self) -> bool:
        return self.status in ("optimal", "time_limit")


def run(
    model: _Model, backend: Backend, time_limit_s: float, presolve: bool = False, mip_rel_gap: float = DEFAULT_GAP,
    warm_start: bool = False, settled_s: float | None = None,
) -> Outcome:
    """Solve (`warm_start`: from the assignment `_Model.start_from` set) for at most `time_limit_s`. `settled_s`: a
    plan found is as good as optimal once the search proves no plan's step below this (a caller whose choice no
    plan slower than it changes): the search stops there, "optimal"."""
    stop_at = None if settled_s is None else units_of_step(model, settled_s)
    solver, used = make_solver(backend, max(time_limit_s, _LEAST_RUN_S), presolve, mip_rel_gap, warm_start,
                               stop_at_bound=stop_at)
    began = cpu_s()
    model.prob.solve(solver)
    solve_s = cpu_s() - began
    sol = model.prob.sol_status
    gap = bound = None
    if used == "highs":
        info = model.prob.solverModel.getInfo()
        bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else None
        if info.primal_solution_status != _FEASIBLE:  # pulp reads an interrupted search as feasible, found or not
            sol = pulp.LpSolutionInfeasible if sol == pulp.LpSolutionInfeasible else pulp.LpSolutionNoSolutionFound
        if sol in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            gap = info.mip_gap if info.mip_gap > DEFAULT_GAP else None
    settled = stop_at is not None and bound is not None and bound >= stop_at
    if sol == pulp.LpSolutionOptimal or (settled and sol == pulp.LpSolutionIntegerFeasible):  # within mip_rel_gap
        return Outcome("optimal", used, solve_s, gap, bound)
    if sol == pulp.LpSolutionIntegerFeasible:  # stopped by the time limit with a plan in hand
        return Outcome("time_limit", used, solve_s, gap, bound)
    if sol == pulp.LpSolutionInfeasible:
        return Outcome("infeasible", used, solve_s, None, bound)
    return Outcome("none", used, solve_s, None, bound)



@dataclass(frozen=True)
class Relaxed:
    """The LP relaxation of a `_Model` with the memory row: its least objective, and each node's heaviest option."""

    objective: float  # in model units (ms), the tie-break included: a bound as `Outcome.bound` is
    bound_s: float  # a lower bound of the step of every plan within the budget
    choice: tuple[int, ...]  # per node, the option the relaxation weighs most: a sharding to round to


def relax(model: _Model, backend: Backend, time_limit_s: float) -> Relaxed | None:
    """The LP relaxation of `model` with the memory row (None: no budget, not solved in time, or not HiGHS). The
    model is left as it was, without the row."""
    budget = model.problem.budget_bytes
    if budget is None:
        return None
    solver, used = make_solver(backend, time_limit_s, presolve=False, mip_rel_gap=DEFAULT_GAP, relaxation=True)
    if used != "highs":
        return None
    model.add_memory_limit()
    try:
        model.prob.solve(solver)
        highs = model.prob.solverModel
        if highs.getModelStatus().name != "kOptimal":  # infeasible (the search proves that itself) or interrupted
            return None
        objective = highs.getInfo().objective_function_value
    finally:
        model.drop_memory_limit()
    choice = tuple(max(range(len(xs)), key=lambda s: xs[s].varValue or 0.0) for xs in model.x)
    return Relaxed(objective, (objective - _most_tie_ms(model)) / _MS * (1 - 1e-6), choice)


def _most_tie_ms(model: _Model) -> float:
    """The most the objective's tie-break adds to a plan's step within the budget: 1 us per GiB of memory."""
    return _TIE_MS_PER_GIB * (model.problem.budget_bytes or 0.0) / _GIB


def units_of_step(model: _Model, step_s: float) -> float:
    """The objective at or above which every plan's step is at least `step_s` (the tie-break at its most; HiGHS'
    tolerances are relative)."""
    return (step_s * _MS + _most_tie_ms(model)) * (1 + 1e-6)
