"""Scaled-dot-product attention in the training IR: split by batch or by heads.

DTensor has no rule for `aten.scaled_dot_product_attention` (the op export
keeps whole for us) nor for the CPU flash kernel. Attention is independent
per (batch, head), so on each mesh axis q, k, v, the mask and the outputs are
all sharded on dim 0 (batch) or all on dim 1 (heads), or all replicated.
We do not shard the sequence: a causal mask and the softmax over keys couple
positions. Heads split contiguously keep grouped-query attention's
q-head -> kv-head mapping (q head h reads kv head h // group).
"""
from __future__ import annotations

import torch

from autopar.solver.spec import Placement, Replicate, Shard
from autopar.solver.strategies.expand import AxisRule, Rule, expand_over_mesh

aten = torch.ops.aten


def _mask_placement(mask: torch.Tensor, dim: int, size: int) -> Placement:
    """The mask follows q on `dim` when it has that dim at full size, else it broadcasts (Replicate)."""
    offset = 4 - mask.dim()  # masks broadcast from the right against (B, H, L, S)
    if dim - offset >= 0 and mask.shape[dim - offset] == size and size > 1:
        return Shard(dim - offset)
    return Replicate()


def sdpa_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule]:
    q = args[0]
    if q.dim() != 4:
        return []  # 3-D attention (no head dim) is left to the replicate fallback
    if op is aten.scaled_dot_product_attention.default:
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        outputs = 1
    else:  # _scaled_dot_product_flash_attention_for_cpu: (output, logsumexp (B, H, L))
        mask = kwargs.get("attn_mask")
        outputs = 2
    has_mask = isinstance(mask, torch.Tensor)
    one_axis: list[AxisRule] = [(Replicate(),) * (outputs + 3 + has_mask)]
    for dim in (0, 1):
        outs = (Shard(dim),) * outputs
        ins: tuple[Placement, ...] = (Shard(dim),) * 3
        if has_mask:
            ins += (_mask_placement(mask, dim, q.shape[dim]),)
        one_axis.append(outs + ins)
    return expand_over_mesh(one_axis, outputs, len(mesh_shape))


RULES = {
    aten.scaled_dot_product_attention.default: sdpa_rules,
    aten._scaled_dot_product_flash_attention_for_cpu.default: sdpa_rules,
}
