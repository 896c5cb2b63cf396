"""Sharding specs in words: "column-parallel over tp, ZeRO-sharded over dp", "batch over dp".

A spec string like `S(0)R` is exact but opaque; the report says what it means
for the tensor in question. Parameter words depend on the parameter's layout:
an `nn.Linear` weight is (out, in), so splitting dim 0 is Megatron's
column-parallel and dim 1 row-parallel; a Hugging Face `Conv1D` weight is
(in, out), the other way round; an embedding table is (vocab, hidden).
"""
from __future__ import annotations

from typing import Literal, Mapping, Sequence

from torch import fx

from autopar.solver.plan import ParamDecision
from autopar.solver.spec import Partial, Replicate, Shard, Spec

Layout = Literal["linear", "conv1d", "embedding", "vector", "other"]

_LINEAR_DIM_WORDS = {0: "column-parallel", 1: "row-parallel"}
_CONV1D_DIM_WORDS = {1: "column-parallel", 0: "row-parallel"}
_EMBEDDING_DIM_WORDS = {0: "vocab-parallel", 1: "hidden-split"}
_EMBEDDING_NAMES = ("wte", "wpe", "embed", "tok_emb", "pos_emb")


def guess_layout(fqn: str, ndim: int | None) -> Layout:
    """Layout from the name and rank alone (used when no traced graph is at hand, e.g. `autopar show`)."""
    if ndim == 1:
        return "vector"
    if ndim == 2:
        return "embedding" if any(k in fqn for k in _EMBEDDING_NAMES) else "linear"
    return "other"


def graph_layouts(gm_graph: fx.Graph, param_fqns: Mapping[str, str]) -> dict[str, Layout]:
    """Layouts read off how the graph consumes each parameter (exact, unlike `guess_layout`)."""
    out: dict[str, Layout] = {}
    for node in gm_graph.nodes:
        if node.op != "placeholder" or node.name not in param_fqns:
            continue
        targets = {str(u.target) for u in node.users}
        ndim = getattr(node.meta.get("val"), "ndim", None)
        if any("embedding" in t for t in targets):
            out[param_fqns[node.name]] = "embedding"
        elif ndim == 2 and any(t.startswith(("aten.t.", "aten.permute.", "aten.transpose.")) for t in targets):
            out[param_fqns[node.name]] = "linear"  # (out, in), transposed before the matmul
        elif ndim == 2 and any(t.startswith(("aten.mm.", "aten.addmm.")) for t in targets):
            out[param_fqns[node.name]] = "conv1d"  # (in, out), used as is
        else:
            out[param_fqns[node.name]] = guess_layout(param_fqns[node.name], ndim)
    return out


def _dim_words(layout: Layout, dim: int) -> str:
    table = {"linear": _LINEAR_DIM_WORDS, "conv1d": _CONV1D_DIM_WORDS, "embedding": _EMBEDDING_DIM_WORDS}.get(layout, {})
    return table.get(dim, "sharded" if layout == "vector" else f"split on dim {dim}")


def param_words(p: ParamDecision, axis_names: Sequence[str], layout: Layout) -> str:
    """How a parameter is used and stored, e.g. "column-parallel over tp, ZeRO-sharded over dp"."""
    parts = []
    for name, use in zip(axis_names, p.use.placements):
        if isinstance(use, Shard):
            parts.append(f"{_dim_words(layout, use.dim)} over {name}")
    zero_axes = [name for name, use, store in zip(axis_names, p.use.placements, p.storage.placements) if isinstance(store, Shard) and store != use]
    if zero_axes:
        parts.append(f"ZeRO-sharded over {'+'.join(zero_axes)}")
    return ", ".join(parts) or "replicated"


def activation_words(spec: Spec | None, axis_names: Sequence[str]) -> str:
    """How an activation is laid out, e.g. "batch over dp, dim 2 over tp", "batch over dp+tp", "partial sums over tp"."""
    if spec is None:
        return "-"
    by_what: dict[str, list[str]] = {}  # one phrase per tensor dim (or Partial), listing every axis that splits it
    for name, p in zip(axis_names, spec.placements):
        if isinstance(p, Shard):
            by_what.setdefault("batch" if p.dim == 0 else f"dim {p.dim}", []).append(name)
        elif isinstance(p, Partial):
            by_what.setdefault("partial sums", []).append(name)
    return ", ".join(f"{what} over {'+'.join(axes)}" for what, axes in by_what.items()) or "replicated"


def placement_kind(spec: Spec) -> str:
    """A coarse class for colour-coding: 'replicated', 'data', 'tensor', 'partial'."""
    if spec.has_partial():
        return "partial"
    if all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in spec.placements):
        return "replicated" if spec.is_replicate() else "data"
    return "tensor"
