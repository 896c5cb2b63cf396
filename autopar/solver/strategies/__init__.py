"""Every sharding strategy of every node of a traced graph.

    strategies = enumerate_strategies(traced, mesh)   # {node name: (Strategy, ...)}

Sources, in priority order: our own rules (attention, all-dim sums, means,
vocabulary-parallel embedding and cross-entropy, channel-parallel convolutions,
batch norm over a split batch, factory ops), DTensor's registries (through
`dtensor_adapter`, the only module that touches DTensor internals), and a
replicate-only fallback with a warning naming the op. Every emitted strategy is even (sharded dims divide by their
mesh axes), uses only Replicate / Shard / Partial(sum), and is deduplicated.

Conventions the ILP and codegen rely on
- `Strategy.input_specs[i]` is about `autopar.tracer.tensor_args(node)[i]`,
  except for `getitem` of a multi-output node: its single input spec is the
  producer's output `node.args[1]` (see `strategy_inputs`).
- placeholders (parameters, buffers, user inputs): `input_specs == ()`, one
  strategy per even spec without Partial.
- `output` gets no entry.
"""
from __future__ import annotations

import logging
import operator
import time
from typing import Any, Callable

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopar.gc_pause import gc_paused
from autopar.solver.mesh import Mesh
from autopar.solver.spec import Spec, Strategy
from autopar.solver.strategies import (
    rules_attention, rules_batch_norm, rules_checks, rules_conv, rules_cross_entropy, rules_embedding, rules_moe,
    rules_random, rules_reduction)
from autopar.solver.strategies.dtensor_adapter import candidate_specs, dtensor_rules, is_even
from autopar.solver.strategies.expand import Rule
from autopar.solver.strategies.rules_factory import FACTORIES, factory_rules
from autopar.tracer import TracedGraph, output_vals, tensor_args

log = logging.getLogger(__name__)

__all__ = ["enumerate_strategies", "node_strategies", "strategy_inputs", "candidate_specs", "replicated_ops"]

_OUR_RULES: dict[Any, Callable[..., list[Rule] | None]] = {
    **rules_attention.RULES, **rules_batch_norm.RULES, **rules_checks.RULES, **rules_conv.RULES,
    **rules_cross_entropy.RULES, **rules_embedding.RULES, **rules_random.RULES, **rules_reduction.RULES}
_CACHE: dict[tuple, tuple[Strategy, ...]] = {}
_WARNED: set[str] = set()
_UNRULED: dict[tuple, str] = {}  # cache key of a node with no rule -> why (`replicated_ops`)


@gc_paused
def enumerate_strategies(traced: TracedGraph, mesh: Mesh) -> dict[str, tuple[Strategy, ...]]:
    start = time.perf_counter()
    out: dict[str, tuple[Strategy, ...]] = {}
    for node in traced.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            out[node.name] = _getitem_strategies(node, out, mesh.shape)
        else:
            out[node.name] = node_strategies(node, mesh.shape)
    log.info("strategies: %d nodes, %d strategies in %.3f s",
             len(out), sum(len(v) for v in out.values()), time.perf_counter() - start)
    return out


def strategy_inputs(node: fx.Node) -> tuple[tuple[fx.Node, int], ...]:
    """What each input spec of `node`'s strategies refers to: (producer node, producer output index)."""
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        return ((src, int(node.args[1])),) if isinstance(src, fx.Node) and isinstance(src.meta.get("val"), (tuple, list)) else ()
    return tuple((a, 0) for a in tensor_args(node))


def node_strategies(node: fx.Node, mesh_shape: tuple[int, ...]) -> tuple[Strategy, ...]:
    """Strategies of one non-getitem node (cached by op, argument shapes and mesh shape)."""
    key = _cache_key(node, mesh_shape)
    hit = _CACHE.get(key)
    if hit is None:
        hit, why = _compute(node, mesh_shape)
        _CACHE[key] = hit
        if why is not None:
            _UNRULED[key] = why
    return hit


def _getitem_strategies(node: fx.Node, done: dict[str, tuple[Strategy, ...]], mesh_shape: tuple[int, ...]) -> tuple[Strategy, ...]:
    src, idx = node.args[0], int(node.args[1])
    if not isinstance(src, fx.Node) or src.name not in done:
        return _replicate_only(len(tensor_args(node)), len(output_vals(node)), len(mesh_shape))
    if not isinstance(src.meta.get("val"), (tuple, list)):  # getitem on a list-valued non-tuple: treat as opaque
        return _replicate_only(len(tensor_args(node)), len(output_vals(node)), len(mesh_shape))
    specs = dict.fromkeys(s.output_specs[idx] for s in done[src.name])
    return tuple(Strategy((spec,), (spec,)) for spec in specs)


def _concrete(x: Any) -> Any:
    """fake tensors -> meta tensors of concrete (hinted) shape; SymInts -> ints."""
    if isinstance(x, fx.Node):
        x = x.meta.get("val")
    if isinstance(x, torch.Tensor):
        shape = tuple(_int(s) for s in x.shape)
        return torch.empty_strided(shape, tuple(_int(s) for s in x.stride()), dtype=x.dtype, device="meta")
    if isinstance(x, torch.SymInt):
        return _int(x)
    return x


def _int(s: Any) -> int:
    if isinstance(s, torch.SymInt):
        return int(s.node.hint) if s.node.has_hint() else int(s.node.expr)
    return int(s)


def _cache_key(node: fx.Node, mesh_shape: tuple[int, ...]) -> tuple:
    """Everything the strategies depend on: op, argument structure, shapes/strides/dtypes, constants, mesh.

    A hand-rolled walk over (args, kwargs) rather than pytree: this runs for every node,
    and on repeated layers it is all the work there is."""
    outs = tuple(None if v is None else (tuple(_int(s) for s in v.shape), v.dtype) for v in output_vals(node))
    return (node.op, str(node.target), _arg_key(node.args), _arg_key(node.kwargs), outs, mesh_shape)


def _arg_key(x: Any) -> Any:
    if isinstance(x, fx.Node):
        x = x.meta.get("val")
    if isinstance(x, torch.Tensor):
        return ("T", tuple(_int(s) for s in x.shape), tuple(_int(s) for s in x.stride()), x.dtype)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__,) + tuple(_arg_key(e) for e in x)
    if isinstance(x, dict):
        return ("dict",) + tuple((k, _arg_key(v)) for k, v in x.items())
    if isinstance(x, torch.SymInt):
        return _int(x)
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype)) else repr(x)


def _compute(node: fx.Node, mesh_shape: tuple[int, ...]) -> tuple[tuple[Strategy, ...], str | None]:
    """The strategies, and why the op has none but replicate when no rule covers it (else None)."""
    n_in, outs = len(tensor_args(node)), output_vals(node)
    if node.op in ("placeholder", "get_attr"):
        val = _concrete(node)
        if not isinstance(val, torch.Tensor):
            return (Strategy((), ()),), None
        return tuple(Strategy((), (s,)) for s in candidate_specs(val.shape, mesh_shape, partial=False)), None
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return _replicate_only(n_in, len(outs), len(mesh_shape)), None  # sym_size, operator.* on SymInts, ...
    op = node.target
    args = pytree.tree_map(_concrete, node.args)
    kwargs = pytree.tree_map(_concrete, node.kwargs)
    rules: list[Rule] | None = None
    why = None
    try:
        if op in FACTORIES and outs and outs[0] is not None:
            rules = factory_rules(op, args, kwargs, mesh_shape, _concrete(outs[0]))
        if rules is None and op in _OUR_RULES:
            rules = _OUR_RULES[op](op, args, kwargs, mesh_shape)
        if rules is None and str(op) in rules_moe.RULES_BY_NAME:  # another library's custom op
            rules = rules_moe.RULES_BY_NAME[str(op)](op, args, kwargs, mesh_shape)
        if rules is None:
            rules = dtensor_rules(op, args, kwargs, mesh_shape)
    except Exception as err:  # a rule that raises on unusual args must not stop planning
        why, rules = f"its sharding rule raised {type(err).__name__}: {err}", []
    if rules is None:
        why, rules = "no sharding rule (ours or DTensor's)", []
    if why is not None:
        _warn_once(str(op), why)
    return _finalize(rules, node, n_in, outs, mesh_shape), why


def _finalize(rules: list[Rule], node: fx.Node, n_in: int, outs: tuple, mesh_shape: tuple[int, ...]) -> tuple[Strategy, ...]:
    in_shapes = [tuple(_int(s) for s in a.meta["val"].shape) for a in tensor_args(node)]
    # a bool tensor cannot be a Partial sum: no strategy may ask for or produce one
    bools = [a.meta["val"].dtype == torch.bool for a in tensor_args(node)]
    out_bools = [v is not None and v.dtype == torch.bool for v in outs]
    out_shapes = [None if v is None else tuple(_int(s) for s in v.shape) for v in outs]
    ndim = len(mesh_shape)
    rep = Spec.replicate(ndim)
    seen: dict[Strategy, None] = {Strategy((rep,) * n_in, (rep,) * len(outs)): None}  # always valid
    for ins, os in rules:
        if len(ins) != n_in or len(os) < len(outs):
            continue
        os = tuple(rep if shape is None else s for s, shape in zip(os, out_shapes))
        if any(b and s.has_partial() for b, s in zip(bools + out_bools, ins + os)):
            continue
        if all(is_even(s, sh, mesh_shape) for s, sh in zip(ins, in_shapes)) and all(
            sh is None or is_even(s, sh, mesh_shape) for s, sh in zip(os, out_shapes)
        ):
            seen.setdefault(Strategy(tuple(ins), os), None)
    return tuple(seen)


def _replicate_only(n_in: int, n_out: int, mesh_ndim: int) -> tuple[Strategy, ...]:
    rep = Spec.replicate(mesh_ndim)
    return (Strategy((rep,) * n_in, (rep,) * n_out),)


def _warn_once(op: str, why: str) -> None:
    if op not in _WARNED:
        _WARNED.add(op)
        log.warning("strategies: %s has %s; it will run replicated (all inputs gathered)", op, why)


def replicated_ops(graph: fx.Graph, mesh_shape: tuple[int, ...]) -> dict[str, tuple[str, list[fx.Node]]]:
    """The ops of `graph` that no rule covers on `mesh_shape` (each node's own arguments: a rule may raise on
    some only), so planned replicated: op -> (why, its nodes). After `enumerate_strategies(graph's, mesh)`."""
    out: dict[str, tuple[str, list[fx.Node]]] = {}
    for node in graph.nodes:
        why = _UNRULED.get(_cache_key(node, mesh_shape)) if node.op == "call_function" else None
        if why is not None:
            out.setdefault(str(node.target), (why, []))[1].append(node)
    return out
