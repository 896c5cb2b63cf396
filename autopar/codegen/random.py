"""Random ops (dropout masks) under the Megatron RNG-tracker rule.

Ranks that hold the same replicated activation must draw the same mask (else
the replicas diverge); ranks that hold different data (data-parallel shards, or
different shards of a sharded activation) must draw independent masks. The
runtime's `rng` module owns the generator state; codegen only routes each random
op through it, naming (by c10d group name) the mesh axes on which the op's output
is Shard. Partial axes are left out on purpose: a Partial activation is a sum of
per-rank terms, and dropout commutes with that sum only if every term is dropped
with the same mask.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from autopar.runtime.mesh import ProcessMesh
from autopar.solver.spec import Shard, Spec

aten = torch.ops.aten


def wrap(target: Any, args: tuple, kwargs: dict, out_specs: Sequence[Spec], mesh: ProcessMesh) -> tuple[Any, tuple, dict]:
    """(target, args, kwargs) of the node to emit: random ops go through the runtime's rng helper."""
    if not _draws(target, args, kwargs):
        return target, args, kwargs
    from autopar.runtime import rng  # the runtime's tracker: independent across differing shards, equal across replicas

    groups = tuple(mesh.group_name(k) for k, p in enumerate(out_specs[0].placements) if isinstance(p, Shard))
    return rng.random_op, (target, groups) + tuple(args), kwargs


def _draws(target: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op draws random numbers: ATen tags each op that does (`nondeterministic_seeded`: dropout,
    rand/randn/randint, randperm, multinomial, normal, ..., as `solver.regions` reads it too). Attention is
    tagged for its dropout, and draws only with `dropout_p` > 0 (`scaled_dot_product_attention(query, key,
    value, attn_mask=None, dropout_p=0.0, ...)`): without, it runs as it is."""
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    if target is aten.scaled_dot_product_attention.default:
        return kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) > 0
    return True
