"""Facts about a traced graph that both the profile and the memory model need.

A *tensor reference* is `(producer node name, output index)`. Views (outputs
that share storage with an input, read off the fake tensors' storages in
`node.meta["val"]`) and `getitem` on multi-output ops are resolved to the
reference that owns the storage (its *base*), so a tensor reached through a
chain of views is one tensor.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import sympy
import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.tracer import TracedGraph, output_vals, tensor_args
from autopar.tracer.nodes import differentiable

Ref = tuple[str, int]

# Ops whose output never needs a gradient even when the input does.
_NO_GRAD_OPS = {torch.ops.aten.detach.default}


@dataclass(frozen=True)
class GraphFacts:
    requires_grad: dict[str, bool]  # node name -> its (float) output needs a gradient in training
    base: dict[Ref, Ref]  # every tensor reference -> the reference that owns its storage
    aliases: dict[str, tuple[bool, ...]]  # node name -> per output: shares storage with an input
    used_outputs: dict[str, tuple[bool, ...]]  # node name -> per output: read by some other node
    arg_refs: dict[str, tuple[Ref, ...]]  # node name -> the reference of each tensor_args(node) entry


def _sid(val: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(val.untyped_storage())


def analyze(traced: TracedGraph, elided: frozenset[str] = frozenset()) -> GraphFacts:
    """Requires-grad, storage bases and argument references; nodes in `elided` are copies eager skips (aliases)."""
    rg: dict[str, bool] = {}
    base: dict[Ref, Ref] = {}
    aliases: dict[str, tuple[bool, ...]] = {}
    used: dict[str, tuple[bool, ...]] = {}
    arg_refs: dict[str, tuple[Ref, ...]] = {}
    out_node = next(n for n in reversed(traced.graph.nodes) if n.op == "output")
    for node in traced.graph.nodes:
        vals = output_vals(node)
        if node.op == "placeholder":
            val = node.meta.get("val")
            rg[node.name] = node.name in traced.param_fqns and differentiable(val) \
                and val.requires_grad  # a frozen parameter takes no gradient
            if vals:
                base[(node.name, 0)] = (node.name, 0)
                aliases[node.name] = (False,)
        elif node.op == "call_function":
            args = tensor_args(node)
            arg_refs[node.name] = tuple(_ref(a) for a in args)
            floating = any(differentiable(v) for v in vals)
            if node.target is operator.getitem:
                src = (node.args[0].name, node.args[1])
                rg[node.name] = floating and rg.get(src[0], False)
                base[(node.name, 0)] = base.get(src, src)
                aliases[node.name] = (True,)
                continue
            rg[node.name] = floating and node.target not in _NO_GRAD_OPS and any(rg.get(a.name, False) for a in args)
            arg_sids = [(_sid(a.meta["val"]), ref) for a, ref in zip(args, arg_refs[node.name])]
            flags = []
            for i, v in enumerate(vals):
                owner = None
                if node.name in elided:
                    owner = arg_refs[node.name][0]
                elif v is not None:
                    sid = _sid(v)
                    owner = next((ref for s, ref in arg_sids if s == sid), None)
                flags.append(owner is not None)
                base[(node.name, i)] = base.get(owner, owner) if owner is not None else (node.name, i)
            aliases[node.name] = tuple(flags)
    for node in traced.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        vals = output_vals(node)
        if isinstance(node.meta.get("val"), (tuple, list)):
            hit = {u.args[1] for u in node.users if u.target is operator.getitem}
            used[node.name] = tuple(i in hit for i in range(len(vals)))
        else:
            used[node.name] = (bool(node.users) or node in out_node.all_input_nodes,) * len(vals)
    return GraphFacts(rg, base, aliases, used, arg_refs)


def _ref(arg: fx.Node) -> Ref:
    """The reference a node argument denotes (getitem nodes denote an element of their source)."""
    return (arg.name, 0)


def tensor_bytes(val: torch.Tensor) -> sympy.Expr:
    """numel * itemsize as a sympy expression (in the trace's symbols when the shape is symbolic).

    Built from the dims' sympy expressions rather than by SymInt arithmetic
    (`val.numel()`), which asks the shape environment to simplify and guard on
    every product: that was a third of a cold `profile()` of GPT-2 small.
    """
    return _nbytes(tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in val.shape), val.element_size())


@functools.lru_cache(maxsize=4096)
def _nbytes(dims: tuple, itemsize: int) -> sympy.Expr:
    return sympy.Mul(sympy.Integer(itemsize), *dims)
