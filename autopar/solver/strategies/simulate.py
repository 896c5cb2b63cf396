"""Simulate every rank of a mesh in one process: shard, run locally, reassemble.

This is the numeric proof's engine (tests/solver/test_strategies_numeric.py,
tests/solver/test_reshard.py) and a debugging aid: it needs no process group.
Per-rank values are a dict {mesh coordinate: local tensor}.

- `shard`: a full tensor -> per-rank shards for a spec (Partial: random
  terms that sum to the value, so a strategy that wrongly treats a Partial
  input as complete is caught).
- `assemble`: per-rank outputs -> the full tensor (concatenate shards, sum
  partials), checking that ranks which should hold the same replica agree.
- `run_collective`: a `CollectiveStep` by its math on the per-rank shards.
Axes sharding one dim split it outer axis first (DTensor's order), as in
`localize.block_index`.
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable, Sequence

import torch
from torch.fx import Node
from torch.utils import _pytree as pytree

from autopar.solver.reshard_types import CollectiveStep
from autopar.solver.spec import Partial, Replicate, Shard, Spec
from autopar.solver.strategies.dtensor_adapter import simulated_mesh
from autopar.solver.strategies.localize import local_call, needs_groups
from autopar.tracer.nodes import differentiable, is_tensor_node

Ranks = dict[tuple[int, ...], torch.Tensor]


def coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _random_terms(x: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if x.dtype == torch.bool:
        raise ValueError("a bool tensor cannot be Partial (no sum)")
    if differentiable(x):
        terms = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for _ in range(n - 1)]
    else:
        terms = [torch.randint(-3, 4, x.shape, generator=gen, dtype=x.dtype) for _ in range(n - 1)]
    return terms + [x - sum(terms)] if terms else [x]


def shard(full: torch.Tensor, spec: Spec, mesh_shape: Sequence[int], gen: torch.Generator | None = None) -> Ranks:
    gen = gen or torch.Generator().manual_seed(0)
    level: dict[tuple[int, ...], torch.Tensor] = {(): full}
    for p, n in zip(spec.placements, mesh_shape):
        nxt: dict[tuple[int, ...], torch.Tensor] = {}
        for prefix, t in level.items():
            if isinstance(p, Shard):
                parts = list(torch.chunk(t, n, dim=p.dim))
            elif isinstance(p, Partial):
                parts = _random_terms(t, n, gen)
            else:
                parts = [t] * n
            for c, part in enumerate(parts):
                nxt[prefix + (c,)] = part.contiguous()
        level = nxt
    return level


def assemble(ranks: Ranks, spec: Spec, mesh_shape: Sequence[int], check: Callable[..., None] | None = None) -> torch.Tensor:
    """Inverse of `shard`; `check(a, b, msg=...)` compares replicas (default: assert_close with
    1e-4 tolerances: replicas of a sum of random Partial terms differ by float rounding)."""
    check = check or functools.partial(torch.testing.assert_close, rtol=1e-4, atol=1e-4)
    level = dict(ranks)
    for axis in reversed(range(len(mesh_shape))):
        p, n = spec.placements[axis], mesh_shape[axis]
        nxt: dict[tuple[int, ...], torch.Tensor] = {}
        for prefix in {c[:axis] for c in level}:
            parts = [level[prefix + (i,)] for i in range(n)]
            if isinstance(p, Shard):
                nxt[prefix] = torch.cat(parts, dim=p.dim)
            elif isinstance(p, Partial):
                nxt[prefix] = sum(parts[1:], parts[0].clone())
            else:
                for other in parts[1:]:
                    check(other, parts[0], msg=lambda m: f"replicas on mesh axis {axis} disagree ({spec}): {m}")
                nxt[prefix] = parts[0]
        level = nxt
    return level[()]


def _groups(mesh_shape: Sequence[int], axis: int) -> list[list[tuple[int, ...]]]:
    """Coordinates that talk in a collective over `axis`: same coordinate elsewhere."""
    others = [range(n) if a != axis else range(1) for a, n in enumerate(mesh_shape)]
    groups = []
    for base in itertools.product(*others):
        groups.append([base[:axis] + (i,) + base[axis + 1:] for i in range(mesh_shape[axis])])
    return groups


def run_collective(ranks: Ranks, step: CollectiveStep, mesh_shape: Sequence[int]) -> Ranks:
    """The math of one collective over one mesh axis, on every group of that axis."""
    out: Ranks = {}
    for group in _groups(mesh_shape, step.mesh_axis):
        parts = [ranks[c] for c in group]
        n = len(parts)
        for i, c in enumerate(group):
            if step.kind == "all_gather":
                out[c] = torch.cat(parts, dim=step.src_dim)
            elif step.kind == "all_reduce":
                out[c] = sum(parts[1:], parts[0].clone())
            elif step.kind == "reduce_scatter":
                out[c] = torch.chunk(sum(parts[1:], parts[0].clone()), n, dim=step.dst_dim)[i].contiguous()
            elif step.kind == "partial":
                out[c] = parts[i] if i == 0 else torch.zeros_like(parts[i])
            elif step.kind == "slice":
                out[c] = torch.chunk(parts[i], n, dim=step.dst_dim)[i].contiguous()
            elif step.kind == "all_to_all":
                # rank i sends its block j (split on dst_dim) to rank j, which concatenates on src_dim
                out[c] = torch.cat([torch.chunk(p, n, dim=step.dst_dim)[i] for p in parts], dim=step.src_dim).contiguous()
            else:
                raise ValueError(f"unknown collective kind {step.kind!r}")
    return out


def replicate_spec(ndim: int) -> Spec:
    return Spec((Replicate(),) * ndim)


def run_strategy(node, strategy, full_inputs: Sequence[torch.Tensor], mesh_shape: Sequence[int],
                 gen: torch.Generator | None = None, check: Callable[..., None] | None = None) -> list[torch.Tensor | None]:
    """Run `node`'s ATen op on every rank's local shards under `strategy`; return the reassembled outputs.

    Inputs are sharded per `strategy.input_specs`, shape arguments localized
    with `localize.local_call`, outputs reassembled per `strategy.output_specs`.
    """
    gen = gen or torch.Generator().manual_seed(0)
    sharded = [shard(x, s, mesh_shape, gen) for x, s in zip(full_inputs, strategy.input_specs)]
    if needs_groups(node, strategy):
        per_rank = _run_with_collectives(node, strategy, sharded, mesh_shape)
    else:
        per_rank = {c: _call(*local_call(node, strategy, mesh_shape, c), [s[c] for s in sharded]) for c in coordinates(mesh_shape)}
    results: list[torch.Tensor | None] = []
    for i, spec in enumerate(strategy.output_specs):
        outs = {c: o[i] for c, o in per_rank.items()}
        if not all(isinstance(o, torch.Tensor) for o in outs.values()):
            results.append(None)
            continue
        results.append(assemble(outs, spec, mesh_shape, check))
    return results


def _call(target, args: tuple, kwargs: dict, local_inputs: Sequence) -> tuple:
    """Run one rank's local call, its tensor arguments replaced by `local_inputs` in order."""
    local = iter(local_inputs)

    def sub(a):
        if is_tensor_node(a):
            return next(local)
        if isinstance(a, Node):  # SymInt-valued node: its (static) value
            return a.meta.get("val")
        return a

    args, kwargs = pytree.tree_map(sub, (args, kwargs))
    out = target(*args, **kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _run_with_collectives(node, strategy, sharded: list[Ranks], mesh_shape: Sequence[int]) -> dict[tuple[int, ...], tuple]:
    """All ranks at once, for a lowering with collectives inside the node (torch's LocalTensorMode
    carries every rank's tensor through each op; see `dtensor_adapter.simulated_mesh`). The call is
    built for rank 0's coordinate: such lowerings take group names, not rank-dependent arguments."""
    coords = coordinates(mesh_shape)
    with simulated_mesh(mesh_shape) as (group_names, to_ranks, from_ranks), torch.no_grad():
        target, args, kwargs = local_call(node, strategy, mesh_shape, coords[0], group_names)
        inputs = [to_ranks({r: s[c] for r, c in enumerate(coords)}) for s in sharded]
        outs = [from_ranks(o) for o in _call(target, args, kwargs, inputs)]
    return {c: tuple(o[r] for o in outs) for r, c in enumerate(coords)}
