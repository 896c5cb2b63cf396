"""Where eager execution of the model differs from the traced core-ATen graph.

The profile prices what a real training step runs, and the traced graph is not
quite that program: `run_decompositions()` splits some ops, and export takes
code paths that eager skips. Each difference found here is one that moves the
measured peak of live tensor storage by whole activations:

- Causal masks: Hugging Face's `create_causal_mask` materialises a boolean
  (B, 1, T, T) mask under export, while in eager it returns None for a plain
  causal mask and attention runs with `is_causal=True`
  (`transformers.masking_utils._ignore_causal_mask_sdpa`). Passing the mask also
  makes the CPU kernel convert it to a float (B, 1, T, T) tensor that its
  backward keeps, per layer. A boolean mask that depends on no input data (only
  on shapes) and evaluates to the causal pattern is dropped: the attention is
  priced as `is_causal=True` and the nodes that only build the mask are *skipped*.
  Without a mask HF also hands attention the grouped k, v (`enable_gqa=True`,
  `transformers.integrations.sdpa_attention.use_gqa_in_sdpa`), so its
  `repeat_kv` copies are skipped too.

Copies that eager does not make (`clone` after dropout with p=0 or after a
kernel that already returns contiguous memory) need the probes' strides and are
found in `profile.elided_copies`.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import fx
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)
aten = torch.ops.aten

_SDPA = aten.scaled_dot_product_attention.default
_MASK_POS = 3  # attn_mask in sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@dataclass(frozen=True)
class EagerCall:
    """The op eager runs for a node: its target and arguments (fx.Node leaves are graph values)."""

    target: Any
    args: tuple
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EagerGraph:
    calls: Mapping[str, EagerCall]  # node name -> the op eager runs in its place
    skipped: frozenset[str]  # nodes eager never runs



def eager_graph(graph: fx.Graph) -> EagerGraph:
    """Every difference above, found on `graph` (a traced core-ATen graph)."""
    calls: dict[str, EagerCall] = {}
    masks: dict[fx.Node, bool] = {}  # mask node -> it is a data-free causal mask
    for node in graph.nodes:
        if node.target is not _SDPA:
            continue
        mask = node.args[_MASK_POS] if len(node.args) > _MASK_POS else node.kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node):
            continue
        if mask not in masks:
            masks[mask] = _is_data_free_causal(mask)
        if masks[mask] and not node.kwargs.get("is_causal", False) and len(node.args) <= _MASK_POS + 1:
            kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
            q, k, v = node.args[:_MASK_POS]
            k0, v0 = _unrepeated_kv(k), _unrepeated_kv(v)
            if k0 is not None and v0 is not None:  # without a mask HF passes grouped k, v (`use_gqa_in_sdpa`)
                k, v, kwargs = k0, v0, {**kwargs, "enable_gqa": True}
            calls[node.name] = EagerCall(_SDPA, (q, k, v), {**kwargs, "is_causal": True})
    return EagerGraph(calls, _mask_only_nodes(graph, calls))


def _unrepeated_kv(node: Any) -> fx.Node | None:
    """x for HF's `repeat_kv(x)` = view(clone(expand(unsqueeze(x[:, :]))), (B, Hkv * n, T, D)), else None."""
    chain = (aten.view.default, aten.clone.default, aten.expand.default, aten.unsqueeze.default)
    for target in chain:
        if not isinstance(node, fx.Node) or node.target is not target or len(node.users) != 1:
            return None
        node = node.args[0]
    while isinstance(node, fx.Node) and node.target is aten.slice.Tensor and len(node.users) == 1:
        if node.args[2:] not in ((), (0,), (0, sys.maxsize)):
            return None  # a real slice, not `x[:, :]`
        node = node.args[0]
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return node if isinstance(val, torch.Tensor) and val.dim() == 4 else None


def _mask_only_nodes(graph: fx.Graph, calls: Mapping[str, EagerCall]) -> frozenset[str]:
    """Tensor nodes whose every use is by an attention whose eager call dropped them, or by another such node."""
    skipped: set[str] = set()
    taken = {a.name for call in calls.values() for a in pytree.tree_leaves((call.args, dict(call.kwargs)))
             if isinstance(a, fx.Node)}  # read by an eager call (an unrepeated k, v), whatever the graph says
    for node in reversed(graph.nodes):
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor) or not node.users:
            continue
        if node.name in taken:
            continue
        if all(_drops(user, node, calls) or user.name in skipped or _metadata_only(user) for user in node.users):
            skipped.add(node.name)
    return frozenset(skipped)


def _drops(user: fx.Node, node: fx.Node, calls: Mapping[str, EagerCall]) -> bool:
    """`user` is an attention whose eager call no longer takes `node`."""
    call = calls.get(user.name)
    if call is None or user.target is not _SDPA:
        return False
    return node not in call.args and node not in call.kwargs.values()


def _metadata_only(user: fx.Node) -> bool:
    """A node that reads no tensor data and makes no tensor (e.g. `sym_size`)."""
    val = user.meta.get("val")
    return user.op == "call_function" and (val is None or isinstance(val, (torch.SymInt, int)))


def _is_data_free_causal(mask: fx.Node) -> bool:
    """A boolean mask built from shapes alone (no input's data) that is lower-triangular-true."""
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.dim() < 2:
        return False
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op != "call_function":
            return False  # reads a placeholder's data (input, parameter, buffer)
        order.append(node)
        if node.target is not aten.sym_size.int:  # sym_size reads only the shape
            stack.extend(node.all_input_nodes)
    try:
        value = _evaluate(sorted(order, key=_position(mask.graph)), mask)
    except Exception as err:  # a construct we cannot replay: keep the mask (the conservative price)
        log.debug("profiler: cannot evaluate mask %s (%s); it is priced as built", mask.name, err)
        return False
    if not isinstance(value, torch.Tensor) or value.shape[-1] != value.shape[-2]:
        return False
    t = value.shape[-1]
    return torch.equal(value, torch.ones(t, t, dtype=torch.bool).tril().expand_as(value))


def _position(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _evaluate(nodes: list[fx.Node], out: fx.Node) -> Any:
    """Replay shape-only nodes on CPU at the sizes the graph was traced with (the symbols' hints)."""
    env: dict[fx.Node, Any] = {}
    for node in nodes:
        if node.target is aten.sym_size.int:
            env[node] = _hint(node.args[0].meta["val"].shape[node.args[1]])
            continue
        args = map_arg(node.args, env.__getitem__)
        kwargs = map_arg(node.kwargs, env.__getitem__)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": "cpu"}  # the trace is on meta; replay for real
        env[node] = node.target(*args, **kwargs)
    return env[out]


def _hint(size: Any) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)

