"""Megatron-style tensor parallel plans for the zoo's transformer blocks, applied with `parallelize_module`.

Column-parallel q/k/v (or fused qkv) and MLP up projections, row-parallel output
projections: one all-reduce in forward and one in backward per attention and per
MLP (Megatron-LM, Shoeybi et al. 2019, section 3). Attention then runs on this
rank's heads only, so each block's attention must know its local head count:
LLaMA reads it from attributes, GPT-2 and BERT get a forward that infers it from
the local width (what torchtitan does by adjusting `n_heads` per TP rank).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from autopar.errors import AutoparError

COL, ROW = ColwiseParallel, RowwiseParallel
# per model family: block-relative module path -> style
PLANS: dict[str, dict[str, type]] = {
    "gpt2": {"attn.c_attn": COL, "attn.c_proj": ROW, "mlp.c_fc": COL, "mlp.c_proj": ROW},
    "llama": {"self_attn.q_proj": COL, "self_attn.k_proj": COL, "self_attn.v_proj": COL, "self_attn.o_proj": ROW,
              "mlp.gate_proj": COL, "mlp.up_proj": COL, "mlp.down_proj": ROW},
    "bert": {"attention.self.query": COL, "attention.self.key": COL, "attention.self.value": COL,
             "attention.output.dense": ROW, "intermediate.dense": COL, "output.dense": ROW},
}


def _gpt2_attention(self, x: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    hs = self.n_embd // self.n_head
    q, k, v = self.c_attn(x).chunk(3, dim=2)  # (B, T, C/tp) each: c_attn rows were grouped per rank
    q = q.view(B, T, -1, hs).transpose(1, 2)  # (B, nh/tp, T, hs)
    k = k.view(B, T, -1, hs).transpose(1, 2)
    v = v.view(B, T, -1, hs).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
    y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C/tp)
    return self.resid_dropout(self.c_proj(y))


def _bert_self_attention(self, x: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    hs = self.head_size
    q = self.query(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nh/tp, T, hs)
    k = self.key(x).view(B, T, -1, hs).transpose(1, 2)
    v = self.value(x).view(B, T, -1, hs).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
    return y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C/tp)


def _group_qkv_rows(linear: nn.Linear, tp: int) -> None:
    """Reorder a fused (q; k; v) projection's rows to (q0 k0 v0; q1 k1 v1; ...) so that column
    sharding over `tp` ranks gives each rank the q, k and v rows of the same heads."""
    with torch.no_grad():
        for p in (linear.weight, linear.bias):
            if p is not None:
                p.copy_(p.reshape(3, tp, -1, *p.shape[1:]).transpose(0, 1).reshape(p.shape))


def _localize_attention(family: str, block: nn.Module, tp: int) -> None:
    if family == "gpt2":
        attn = block.attn
        _check_heads(attn.n_head, tp)
        _group_qkv_rows(attn.c_attn, tp)
        attn.forward = types.MethodType(_gpt2_attention, attn)
    elif family == "llama":
        attn = block.self_attn
        _check_heads(attn.n_kv_heads, tp)
        attn.n_heads //= tp
        attn.n_kv_heads //= tp
    elif family == "bert":
        attn = block.attention.self
        _check_heads(attn.n_heads, tp)
        attn.head_size = attn.query.in_features // attn.n_heads
        attn.forward = types.MethodType(_bert_self_attention, attn)


def _check_heads(n_heads: int, tp: int) -> None:
    if n_heads % tp:
        raise AutoparError(f"tensor parallel degree {tp} does not divide the {n_heads} (kv) heads; use --tp that divides it")


def apply_tensor_parallel(family: str, blocks: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Shard every block's linears over `tp_mesh` (in place); the rest of the model stays replicated."""
    if family not in PLANS:
        raise AutoparError(f"no tensor parallel plan for model family {family!r}; known: {sorted(PLANS)}")
    tp = tp_mesh.size()
    for block in blocks:
        _localize_attention(family, block, tp)
        parallelize_module(block, tp_mesh, {path: style() for path, style in PLANS[family].items()})
