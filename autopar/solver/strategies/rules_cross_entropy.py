"""Vocabulary-parallel cross-entropy: log-softmax and the label lookup over a split vocabulary.

The decomposed cross-entropy is `_log_softmax(logits, 1)` then `gather(logp, 1,
labels)` (then sums; see `rules_reduction`). DTensor splits neither over the
class dim: its softmax rule replicates the softmax dim, and its gather rule for
a split gather dim uses the `_MaskPartial` placement our vocabulary drops. So a
column-parallel LM head had to all-gather its logits, the largest activation of
a language model. Per mesh axis:

_log_softmax (output; input):
  (R; R)        replicated
  (S(d); S(d))  any dim; for the softmax dim the lowering exchanges each row's max
                and sum of exponentials (`autopar.runtime.vocab_parallel`)

gather (output; input, index), gathering along `dim`:
  (R; R, R)
  (S(d); S(d), S(d))  d != dim, index and input of equal size there (DTensor's rule)
  (S(dim); R, S(dim)) the index split along `dim`, every rank has the whole input
                      (not for other dims: there gather reads the input positionally)
  (P; S(dim), R)      the input's `dim` split: a rank looks up only the indices in
                      its block, zeros elsewhere (`localize.masked_gather`); the
                      ranks' terms sum to the lookup
"""
from __future__ import annotations

import torch

from autopar.solver.spec import Partial, Replicate, Shard
from autopar.solver.strategies.expand import AxisRule, Rule, expand_over_mesh

aten = torch.ops.aten


def log_softmax_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    x = args[0]
    one_axis: list[AxisRule] = [(Replicate(), Replicate())]
    one_axis += [(Shard(d), Shard(d)) for d in range(x.dim())]
    return expand_over_mesh(one_axis, 1, len(mesh_shape))


def gather_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    x, dim, index = args[0], args[1], args[2]
    sparse_grad = args[3] if len(args) > 3 else kwargs.get("sparse_grad", False)
    if sparse_grad or x.dim() != index.dim() or x.dim() == 0:
        return None  # leave the unusual forms to DTensor
    dim %= x.dim()
    one_axis: list[AxisRule] = [(Replicate(), Replicate(), Replicate())]
    one_axis += [(Shard(d), Shard(d), Shard(d)) for d in range(x.dim()) if d != dim and x.shape[d] == index.shape[d]]
    one_axis.append((Shard(dim), Replicate(), Shard(dim)))
    one_axis.append((Partial(), Shard(dim), Replicate()))
    return expand_over_mesh(one_axis, 1, len(mesh_shape))


RULES = {aten._log_softmax.default: log_softmax_rules, aten.gather.default: gather_rules}
