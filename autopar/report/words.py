"""Sharding specs in words: "column-parallel over tp, ZeRO-sharded over dp", "batch over dp".

A spec string like `S(0)R` is exact but opaque; the report says what it means for the tensor in
question. A parameter's words depend on its layout, which the plan records
(`ParamDecision.layout`, read off the graph by `tracer.param_layouts`): an `nn.Linear` weight is
(out, in), so splitting dim 0 is Megatron's column-parallel and dim 1 row-parallel; a Hugging Face
`Conv1D` weight is (in, out), the other way round; an embedding table is (vocabulary, hidden).
Every report (plan, show, explain, diff, --json, --html) words a plan through these functions.
"""
from __future__ import annotations

from typing import Sequence

from autopar.solver.plan import ParamDecision
from autopar.solver.spec import Partial, Replicate, Shard, Spec
from autopar.tracer.param_layouts import Layout

_DIM_WORDS: dict[str, dict[int, str]] = {
    "out_in": {0: "column-parallel", 1: "row-parallel"},
    "in_out": {1: "column-parallel", 0: "row-parallel"},
    "embedding": {0: "vocab-parallel", 1: "hidden-split"},
    "conv": {0: "output-channel split", 1: "input-channel split"},
}

LAYOUT_WORDS: dict[str, str] = {
    "out_in": "stored out x in, as nn.Linear",
    "in_out": "stored in x out, as Hugging Face's Conv1D",
    "embedding": "a lookup table, vocabulary x hidden",
    "conv": "a convolution's out channels x in channels x kernel",
    "vector": "one dim",
    "other": "not a matmul weight",
    "": "not recorded in this plan file",
}

LEGEND = ("Specs have one placement per mesh axis, in mesh order ({axes}): S(d) = split along tensor dim d over that "
          "axis, R = replicated (whole on every device), P = partial sums (each device holds a term; their sum over "
          "the axis is the tensor). A strategy reads (input specs) -> output spec.")

OLD_PLAN_FILE = ("this plan file does not record parameter layouts: a split parameter is named by the dim it splits "
                 "(whether that is column- or row-parallel depends on the layout); re-plan with --save to get them")
NO_TIMELINE = "this plan file does not record the memory timeline: the HTML page has no chart; re-plan with --save to get it"

BASELINE_WORDS = {"data_parallel": "pure data parallel", "zero3": "ZeRO-3 / FSDP", "megatron": "Megatron TP + DP"}


def baseline_words(name: str) -> str:
    return BASELINE_WORDS.get(name, name.replace("_", " "))


def collective_words(kind: str) -> str:
    """'all_reduce' -> 'all-reduce', as the collective is usually written."""
    return kind.replace("_", "-")


def _dim_words(layout: Layout, dim: int, ndim: int | None) -> str:
    if layout == "vector" or (layout == "" and ndim == 1):
        return "sharded"
    return _DIM_WORDS.get(layout, {}).get(dim, f"split on dim {dim}")


def _join_by_phrase(pairs: Sequence[tuple[str, str]]) -> str:
    """[("column-parallel", "dp"), ("column-parallel", "tp")] -> "column-parallel over dp+tp"."""
    by_phrase: dict[str, list[str]] = {}
    for phrase, axis in pairs:
        by_phrase.setdefault(phrase, []).append(axis)
    return ", ".join(f"{phrase} over {'+'.join(axes)}" for phrase, axes in by_phrase.items())


def param_words(p: ParamDecision, axis_names: Sequence[str], ndim: int | None = None) -> str:
    """How a parameter is used and stored, e.g. "column-parallel over tp, ZeRO-sharded over dp". `ndim`: its rank,
    which words a plan file without layouts by (`Fingerprint.param_shapes`)."""
    pairs = [(_dim_words(p.layout, use.dim, ndim), name) for name, use in zip(axis_names, p.use.placements) if isinstance(use, Shard)]
    pairs += [("ZeRO-sharded", name) for name, use, store in zip(axis_names, p.use.placements, p.storage.placements)
              if isinstance(store, Shard) and store != use]
    return _join_by_phrase(pairs) or "replicated"


def activation_words(spec: Spec | None, axis_names: Sequence[str]) -> str:
    """How an activation is laid out, e.g. "batch over dp, dim 2 over tp", "batch over dp+tp", "partial sums over tp"."""
    if spec is None:
        return "-"
    pairs = [("partial sums" if isinstance(p, Partial) else "batch" if p.dim == 0 else f"dim {p.dim}", name)
             for name, p in zip(axis_names, spec.placements) if isinstance(p, (Shard, Partial))]
    return _join_by_phrase(pairs) or "replicated"


def placement_kind(spec: Spec) -> str:
    """A coarse class for colour-coding: 'replicated', 'data', 'tensor', 'partial'."""
    if spec.has_partial():
        return "partial"
    if all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in spec.placements):
        return "replicated" if spec.is_replicate() else "data"
    return "tensor"
