"""transformers' mixture-of-experts matmul, `transformers::grouped_mm_fallback(input, weight, offs)`:
input (tokens, d_in) sorted by expert, weight (experts, d_in, d_out), offs the experts' cumulative
token counts; each expert's tokens times its (d_in, d_out) matrix.

Without a rule it ran replicated: every rank computed every expert for every token. Megatron's
two splits hold inside each expert's matmul, whatever the routing, so per mesh axis
(output; input, weight, offs):
  (R; R, R, R)
  (S(1); R, S(2), R)   each expert's output features split: column parallel
  (P; S(1), S(1), R)   each expert's input features split: row parallel, a partial sum
  (P; P, R, R)         linear in the input
The tokens are not split: `offs` counts the global batch's tokens. (Expert parallelism, which
sends each token to its expert's rank, is not built.) The rules are keyed by the op's name:
transformers registers it when its MoE module is imported, and autopar does not import it.
"""
from __future__ import annotations

from autopar.solver.spec import Partial, Replicate, Shard
from autopar.solver.strategies.expand import AxisRule, Rule, expand_over_mesh


def grouped_mm_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    one_axis: list[AxisRule] = [
        (Replicate(), Replicate(), Replicate(), Replicate()),
        (Shard(1), Replicate(), Shard(2), Replicate()),
        (Partial(), Shard(1), Shard(1), Replicate()),
        (Partial(), Partial(), Replicate(), Replicate()),
    ]
    return expand_over_mesh(one_axis, 1, len(mesh_shape))


RULES_BY_NAME = {"transformers.grouped_mm_fallback.default": grouped_mm_rules}
