"""The solver's plain-data problem: options per (clustered) node, resharding edges, memory budget.

`autopar.solver.ilp` only ever sees a `Problem`, so it can be tested on
hand-built 3-5 node graphs. `build_problem` (below) makes one from
a traced graph, a profile and the strategies (merging followers and tying
repeated layers first, see `cluster.py`); the costs of a tied class are the sums
over its copies, so the ILP node stands for all of them at once.

Units: seconds for times (one training step, forward + backward), bytes per
device for memory.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZeroOption:
    """Keeping a parameter sharded over its replicated (data-parallel) axes between uses."""

    factor: int  # param, grad and optimizer bytes are divided by this much more
    comm_s: float  # extra per-step comm vs replicated storage (gathers in fwd and bwd; reduce-scatter for all-reduce)
    gathered_bytes: float  # the param gathered to its use spec while its consumers run (a transient)


@dataclass(frozen=True)
class Option:
    """One strategy of a node (or of a whole cluster / tied class: sums over its members)."""

    label: str
    compute_s: float = 0.0  # forward + backward compute
    comm_s: float = 0.0  # collectives inside the strategy, forward + backward
    recompute_s: float = 0.0  # forward compute paid again in backward when recomputed
    saved_bytes: float = 0.0  # activations kept for backward (freed by recompute)
    temp_bytes: float = 0.0  # largest transient while it runs (a max, not a sum, across a tied class)
    param_bytes: float = 0.0  # parameters and buffers under the use spec
    grad_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    zero: ZeroOption | None = None  # None: storage must equal the use spec

    @property
    def static_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Node:
    name: str
    options: tuple[Option, ...]
    recomputable: bool = False  # placeholders and nodes that save nothing are not

    def __post_init__(self) -> None:
        if not self.options:
            raise ValueError(f"node {self.name!r} has no options; every node needs at least one strategy")


@dataclass(frozen=True)
class Edge:
    """Resharding cost between producer `src` and consumer `dst`.

    Options are grouped into classes (options with the same relevant specs
    cost the same), so `cost_s[src_class[i]][dst_class[j]]` is the cost when
    src takes option i and dst option j. Grouping keeps the edge variables few.
    """

    src: int
    dst: int
    src_class: tuple[int, ...]
    dst_class: tuple[int, ...]
    cost_s: tuple[tuple[float, ...], ...]

    @staticmethod
    def dense(src: int, dst: int, cost_s: list[list[float]] | tuple[tuple[float, ...], ...]) -> "Edge":
        """One class per option: for hand-built problems."""
        rows = tuple(tuple(float(c) for c in row) for row in cost_s)
        return Edge(src, dst, tuple(range(len(rows))), tuple(range(len(rows[0]))), rows)

    def cost(self, i: int, j: int) -> float:
        return self.cost_s[self.src_class[i]][self.dst_class[j]]


@dataclass(frozen=True)
class Problem:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    budget_bytes: float | None = None  # per device; None: unconstrained

    def __post_init__(self) -> None:
        for e in self.edges:
            if e.src == e.dst:
                raise ValueError(f"edge {e.src}->{e.dst} is a self-loop; fold it into the node's option costs")
            if len(e.src_class) != len(self.nodes[e.src].options) or len(e.dst_class) != len(self.nodes[e.dst].options):
                raise ValueError(f"edge {self.nodes[e.src].name}->{self.nodes[e.dst].name}: class maps do not match option counts")

    def num_options(self) -> int:
        return sum(len(n.options) for n in self.nodes)


@dataclass(frozen=True)
class Assignment:
    """One decision per problem node: option index, recompute flag, ZeRO flag."""

    choice: tuple[int, ...]
    recompute: tuple[bool, ...]
    zero: tuple[bool, ...]

    @staticmethod
    def of(choice: tuple[int, ...] | list[int], recompute=(), zero=()) -> "Assignment":
        """Choices by index; `recompute` / `zero` are the node indices with the flag set."""
        n = len(choice)
        return Assignment(tuple(choice), tuple(i in set(recompute) for i in range(n)), tuple(i in set(zero) for i in range(n)))
