"""Vocabulary-parallel embedding: the table sharded by rows, the lookup a Partial sum.

DTensor's own vocabulary-parallel rule uses a `_MaskPartial` placement outside our
vocabulary, so the adapter drops it. Here a rank holding rows [lo, hi) of the
table looks up only the indices in its range and writes zeros elsewhere; the
ranks' outputs then sum to the full lookup (each index lives on exactly one
rank), i.e. the output is Partial. The lookup is rank dependent, so
`localize.local_call` lowers it to `localize.masked_embedding` with this rank's
row range. Per mesh axis (output; weight, indices):
  (R; R, R)              replicated
  (S(d); R, S(d))        split the batch/sequence of indices (DTensor's rule)
  (S(last); S(1), R)     split the embedding dim (DTensor's rule)
  (P; S(0), R)           split the vocabulary (this rule)
"""
from __future__ import annotations

import torch

from autopar.solver.spec import Partial, Replicate, Shard
from autopar.solver.strategies.expand import AxisRule, Rule, expand_over_mesh

aten = torch.ops.aten


def embedding_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    weight, indices = args[0], args[1]
    scale_grad_by_freq = args[3] if len(args) > 3 else kwargs.get("scale_grad_by_freq", False)
    sparse = args[4] if len(args) > 4 else kwargs.get("sparse", False)
    if weight.dim() != 2 or scale_grad_by_freq or sparse:
        return None  # per-shard word counts / sparse grads: leave to DTensor
    out_ndim = indices.dim() + 1
    # DTensor's rules first, in its order (keeps the strategy order plans were made with), then ours
    one_axis: list[AxisRule] = [(Shard(out_ndim - 1), Shard(1), Replicate())]
    one_axis += [(Shard(d), Replicate(), Shard(d)) for d in range(indices.dim())]
    one_axis.append((Replicate(), Replicate(), Replicate()))
    one_axis.append((Partial(), Shard(0), Replicate()))
    return expand_over_mesh(one_axis, 1, len(mesh_shape))


RULES = {aten.embedding.default: embedding_rules}
