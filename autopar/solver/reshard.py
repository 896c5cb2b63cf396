"""Resharding: the cheapest sequence of collectives from one spec to another.

    steps = reshard_steps(Spec.parse("S(0)R"), Spec.parse("RS(1)"), (8, 16, 4), mesh)
    seconds = reshard_cost(src, dst, shape, itemsize=4, mesh=mesh)

One step changes the placement on ONE mesh axis:
  all_gather      S(d) -> R        all_reduce      P -> R
  reduce_scatter  P -> S(d)        all_to_all      S(i) -> S(j)
  slice           R -> S(d)        (local, no communication)
  partial         R -> P           (local: coordinate 0 keeps the value, others zeros)
A tensor dim sharded over several mesh axes is split outer axis first
(DTensor's default order: rank (i, j) of S(0)S(0) holds chunk i*n_j + j), so
a step may only touch the innermost axis sharding that dim; otherwise the
result would be a strided shard, which is not in our vocabulary.
The cheapest path is a shortest path (Dijkstra) over the even specs of the
tensor (at most (ndim+2)^axes states), priced by the alpha-beta ring model in
`autopar.solver.cost`; multi-axis orders (e.g. gather the inner axis before
the outer) fall out of it. One search from a source prices every destination,
and it is shared by all tensors of the same shape class (ndim, bytes, which
mesh-axis products divide each dim): planning GPT-2 asks ~3,000 distinct
(src, dst, shape) questions but only a few hundred searches.

Backward: the gradient flows dst -> src with Partial read as Replicate (the
all-reduce a Replicate input's Partial gradient needs is charged to the op
that consumes it, see `cost.strategy_cost`). `reshard_cost(..., with_backward=True)`
adds it: all_gather forward costs a (free) slice backward, slice forward
costs an all_gather backward, all_reduce forward nothing backward.
"""
from __future__ import annotations

import functools
import heapq
import math
from typing import Sequence

from autopar.solver.cost import collective_time_s
from autopar.solver.mesh import Mesh
from autopar.solver.reshard_types import CollectiveStep
from autopar.solver.spec import Partial, Replicate, Shard, Spec

__all__ = ["reshard_steps", "reshard_cost", "reshard_buffer_bytes", "step_bytes", "step_time_s", "apply_step"]

_STEP_PENALTY_S = 1e-9  # breaks ties towards fewer steps


def apply_step(spec: Spec, step: CollectiveStep) -> Spec:
    new = {"all_gather": Replicate(), "all_reduce": Replicate(), "partial": Partial()}.get(step.kind)
    pls = list(spec.placements)
    pls[step.mesh_axis] = new if new is not None else Shard(step.dst_dim)  # type: ignore[arg-type]
    return Spec(tuple(pls))


# Inside the search a spec is a tuple of ints, one per mesh axis (hashing our frozen
# dataclasses dominated the search): Shard(d) -> d, Replicate -> _R, Partial -> _P.
_R, _P = -1, -2
State = tuple[int, ...]


def _encode(spec: Spec) -> State:
    return tuple(p.dim if isinstance(p, Shard) else _P if isinstance(p, Partial) else _R for p in spec.placements)


@functools.lru_cache(maxsize=None)
def _neighbours(state: State, ndim: int) -> tuple[tuple[CollectiveStep, State], ...]:
    """Every single step out of `state`, with the state it leads to (a fixed order: it decides ties)."""
    def ok(a: int, d: int) -> bool:  # no axis after `a` shards dim d
        return d not in state[a + 1:]

    def to(a: int, c: int) -> State:
        return state[:a] + (c,) + state[a + 1:]

    out: list[tuple[CollectiveStep, State]] = []
    for a, c in enumerate(state):
        if c == _R:
            out += [(CollectiveStep("slice", a, dst_dim=d), to(a, d)) for d in range(ndim) if ok(a, d)]
            out.append((CollectiveStep("partial", a), to(a, _P)))
        elif c == _P:
            out.append((CollectiveStep("all_reduce", a), to(a, _R)))
            out += [(CollectiveStep("reduce_scatter", a, dst_dim=d), to(a, d)) for d in range(ndim) if ok(a, d)]
        elif ok(a, c):
            out.append((CollectiveStep("all_gather", a, src_dim=c), to(a, _R)))
            out += [(CollectiveStep("all_to_all", a, src_dim=c, dst_dim=d), to(a, d))
                    for d in range(ndim) if d != c and ok(a, d)]
    return tuple(out)


def step_bytes(step: CollectiveStep, spec_before: Spec, shape: Sequence[int], itemsize: int, mesh: Mesh) -> float:
    """Bytes of one rank's local tensor before the step (the collective formulas' input)."""
    local = spec_before.local_shape(shape, mesh.shape)
    return float(math.prod(local) * itemsize)


def step_time_s(step: CollectiveStep, spec_before: Spec, shape: Sequence[int], itemsize: int, mesh: Mesh) -> float:
    return _step_time(step, step_bytes(step, spec_before, shape, itemsize, mesh), mesh)


def _step_time(step: CollectiveStep, local_bytes: float, mesh: Mesh) -> float:
    axis = mesh.axes[step.mesh_axis]
    if step.kind == "slice":  # a local copy of the kept block
        return local_bytes / axis.size / mesh.mem_bandwidth_bytes_per_s
    if step.kind == "partial":  # zero-fill on all but one rank
        return local_bytes / mesh.mem_bandwidth_bytes_per_s
    if step.kind == "all_gather":  # formula takes the gathered (full over this axis) size
        return collective_time_s("all_gather", local_bytes * axis.size, axis)
    if step.kind == "reduce_scatter":  # input is the full (partial) tensor on each rank
        return collective_time_s("reduce_scatter", local_bytes, axis)
    return collective_time_s(step.kind, local_bytes, axis)


# ---------------------------------------------------------------- shape classes
# A path's cost depends on the tensor's shape only through its total bytes (each
# state's local bytes = total / shard factor, exactly, for even specs) and through
# which specs are even (which products of mesh axis sizes divide each dim). Tensors
# with equal (ndim, bytes, divisibility) share one shortest-path table.
ShapeClass = tuple[int, int, tuple[tuple[bool, ...], ...]]


@functools.lru_cache(maxsize=None)
def _axis_products(mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Product of the mesh sizes of every non-empty subset of axes (bit i of the index + 1: axis i)."""
    return tuple(math.prod(n for a, n in enumerate(mesh_shape) if mask >> a & 1) for mask in range(1, 1 << len(mesh_shape)))


@functools.lru_cache(maxsize=65536)
def shape_class(shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, ...]) -> ShapeClass:
    products = _axis_products(mesh_shape)
    divisible = tuple(tuple(size % f == 0 for f in products) for size in shape)
    return len(shape), math.prod(shape) * itemsize, divisible


def _even_in_class(state: State, cls: ShapeClass) -> bool:
    ndim, _, divisible = cls
    masks = [0] * ndim
    for a, c in enumerate(state):
        if c >= 0:
            if c >= ndim:
                return False
            masks[c] |= 1 << a
    return all(m == 0 or divisible[d][m - 1] for d, m in enumerate(masks))


def reshard_steps(src: Spec, dst: Spec, shape: tuple[int, ...], mesh: Mesh, itemsize: int = 4) -> tuple[CollectiveStep, ...]:
    """The cheapest step sequence turning `src` into `dst` (empty when equal)."""
    return _search(src, dst, tuple(shape), mesh, itemsize)[1]


def _search(src: Spec, dst: Spec, shape: tuple[int, ...], mesh: Mesh, itemsize: int) -> tuple[float, tuple[CollectiveStep, ...]]:
    mesh_shape = mesh.shape
    if len(src.placements) != len(mesh_shape) or len(dst.placements) != len(mesh_shape):
        raise ValueError(f"specs {src} and {dst} need one placement per axis of mesh {mesh}")
    cls = shape_class(shape, itemsize, mesh_shape)
    s, d = _encode(src), _encode(dst)
    for spec, state in ((src, s), (dst, d)):
        if not _even_in_class(state, cls):
            raise ValueError(f"spec {spec} does not divide shape {shape} evenly over mesh {mesh_shape}")
    if s == d:
        return 0.0, ()
    found = _paths_from(s, cls, mesh).get(d)
    if found is None:  # unreachable: gathering everything, then slicing / zeroing, always works for even specs
        raise AssertionError(f"no resharding path from {src} to {dst} for shape {shape}")
    return found


@functools.lru_cache(maxsize=16384)
def _paths_from(src: State, cls: ShapeClass, mesh: Mesh) -> dict[State, tuple[float, tuple[CollectiveStep, ...]]]:
    """Dijkstra from `src` to every even spec of the shape class: {state: (cost with tie penalties, steps)}.

    One search serves every destination; the path kept for a spec is the one the
    single-destination search would return (same push order, strict improvements only)."""
    sizes = mesh.shape
    ndim, nbytes, _ = cls
    best = {src: 0.0}
    done: dict[State, tuple[float, tuple[CollectiveStep, ...]]] = {}
    heap: list[tuple[float, int, State, tuple[CollectiveStep, ...]]] = [(0.0, 0, src, ())]
    tie = 0
    while heap:
        cost, _, state, path = heapq.heappop(heap)
        if state in done or cost > best.get(state, math.inf):
            continue
        done[state] = (cost, path)
        local_bytes = float(nbytes // math.prod(n for c, n in zip(state, sizes) if c >= 0))
        for step, nxt in _neighbours(state, ndim):
            if nxt in done or not _even_in_class(nxt, cls):
                continue
            c = cost + _step_time(step, local_bytes, mesh) + _STEP_PENALTY_S
            if c < best.get(nxt, math.inf):
                best[nxt] = c
                tie += 1
                heapq.heappush(heap, (c, tie, nxt, path + (step,)))
    return done


def _grad_spec(spec: Spec) -> Spec:
    return Spec(tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements))


@functools.lru_cache(maxsize=65536)
def reshard_cost(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int, mesh: Mesh, with_backward: bool = True) -> float:
    """Seconds to reshard forward (and the gradient back, unless `with_backward=False`: integer tensors)."""
    shape = tuple(shape)
    fwd, steps = _search(src, dst, shape, mesh, itemsize)
    fwd -= _STEP_PENALTY_S * len(steps)
    if not with_backward:
        return fwd
    gsrc, gdst = _grad_spec(dst), _grad_spec(src)
    bwd, bsteps = _search(gsrc, gdst, shape, mesh, itemsize)
    return fwd + bwd - _STEP_PENALTY_S * len(bsteps)


# ---------------------------------------------------------------- buffers
# What the runtime allocates for one step (`runtime.collectives` over `runtime.comm`), in a rank's local bytes:
# every collective moves a flat buffer, and `kernels.layout` copies chunks between the flat buffer and a tensor
# dim only when a dim of size > 1 precedes it (otherwise it is a view).

def _moves(local_shape: Sequence[int], dim: int) -> bool:
    """Whether laying chunks along `dim` out of (or into) a flat buffer takes a copy (`kernels.layout`)."""
    return any(n > 1 for n in local_shape[:dim])


def _step_buffers(step: CollectiveStep, shape_in: tuple[int, ...], shape_out: tuple[int, ...], itemsize: int
                  ) -> tuple[float, float]:
    """(forward, backward): the most bytes one step allocates at once. Forward: besides its input, its output
    included; backward: besides the gradient of its output, the gradient of its input included."""
    b_in, b_out = math.prod(shape_in) * itemsize, math.prod(shape_out) * itemsize
    kind = step.kind
    if kind == "all_gather":  # flat gathered buffer, then laid out along src_dim
        forward = b_out * (2 if _moves(shape_out, step.src_dim) else 1)
        # backward: this rank's chunk (`all_gather`) or a reduce-scatter of the gradient (`all_gather_rs`,
        # when the step takes over a gradient all-reduce): the larger of the two
        return forward, b_in + (b_out if _moves(shape_out, step.src_dim) else 0)
    if kind == "reduce_scatter":  # chunks to the front, then the flat reduce-scatter; backward all-gathers
        return ((b_in if _moves(shape_in, step.dst_dim) else 0) + b_out,
                b_in * (2 if _moves(shape_in, step.dst_dim) else 1))
    if kind == "all_to_all":  # staging (chunks of dst_dim to the front), received buffer, laid out along src_dim
        forward = max((b_in if _moves(shape_in, step.dst_dim) else 0) + b_out,
                      b_out + (b_out if _moves(shape_out, step.src_dim) else 0))
        backward = max((b_out if _moves(shape_out, step.src_dim) else 0) + b_in,
                       b_in + (b_in if _moves(shape_in, step.dst_dim) else 0))
        return forward, backward
    if kind == "slice":  # a copy of the kept chunk; backward all-gathers the gradient
        return b_out, b_in * (2 if _moves(shape_in, step.dst_dim) else 1)
    return b_out, 0.0  # all_reduce, partial: a new tensor forward; the gradient passes through backward


@functools.lru_cache(maxsize=65536)
def reshard_buffer_bytes(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int, mesh: Mesh,
                         with_backward: bool = True) -> float:
    """The most bytes a rank holds at once while it reshards one tensor src -> dst, forward or backward: each
    step's buffers (`_step_buffers`) plus the previous step's result, which lives until the step is done.
    Forward counts its final output and not its input; backward counts the gradient it hands back and not the
    gradient it starts from. A transient of the consumer the memory model must see: gathering an attention
    matrix and exchanging it over another axis holds three such matrices at once (bert's tightest plan).
    `with_backward=False`: forward only (integer tensors get no gradient)."""
    steps = reshard_steps(src, dst, tuple(shape), mesh, itemsize)
    spec, shapes = src, [src.local_shape(shape, mesh.shape)]
    for step in steps:
        spec = apply_step(spec, step)
        shapes.append(spec.local_shape(shape, mesh.shape))
    forward = backward = 0.0
    for t, step in enumerate(steps):  # the previous step's output is alive while this one runs
        held = math.prod(shapes[t]) * itemsize if t > 0 else 0
        forward = max(forward, held + _step_buffers(step, shapes[t], shapes[t + 1], itemsize)[0])
    held = 0  # the gradient of this step's output: not counted while it is the one backward starts from
    for t in reversed(range(len(steps) if with_backward else 0)):
        made = _step_buffers(steps[t], shapes[t], shapes[t + 1], itemsize)[1]
        backward = max(backward, held + made)
        if made:  # a new gradient for the step's input (all_reduce and partial pass theirs through)
            held = math.prod(shapes[t]) * itemsize
    return float(max(forward, backward))
