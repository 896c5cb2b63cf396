"""Attention as eager runs it: a shape-only causal mask becomes `is_causal=True`.

Hugging Face's `create_causal_mask` returns None in eager for a plain causal
mask, and attention then runs with `is_causal=True` on the grouped k, v
(`transformers.masking_utils._ignore_causal_mask_sdpa`,
`transformers.integrations.sdpa_attention.use_gqa_in_sdpa`). Under export the
same code materialises a boolean (B, 1, T, T) mask and `repeat_kv` copies of k
and v. Left in, the generated module would build and keep what eager never
does: the CPU kernel turns the mask into a float (B, 1, T, T) tensor its
backward saves, per layer, and GQA's k, v are copied n_rep times.

`canonicalize_attention(gm)` rewrites every `scaled_dot_product_attention` whose
mask is boolean, depends on no input data (only on shapes) and evaluates to the
causal pattern at the traced sizes: the mask is dropped for `is_causal=True`, a
`repeat_kv` chain on k and v is dropped for `enable_gqa=True`, and the nodes
that only built them become dead and are removed. The result is what eager
runs, so the profiler prices the graph as it is and codegen lowers the same.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import fx
from torch.fx.node import map_arg

log = logging.getLogger(__name__)
aten = torch.ops.aten

_SDPA = aten.scaled_dot_product_attention.default
_MASK_POS = 3  # attn_mask in sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def canonicalize_attention(gm: fx.GraphModule) -> int:
    """Rewrite causal-masked attention in place (see the module docstring); returns how many nodes changed."""
    graph = gm.graph
    causal: dict[fx.Node, bool] = {}
    changed = 0
    for node in list(graph.nodes):
        if node.target is not _SDPA or len(node.args) > _MASK_POS + 1 or node.kwargs.get("is_causal", False):
            continue  # positional dropout/is_causal/scale after the mask: leave such calls as they are
        mask = node.args[_MASK_POS] if len(node.args) > _MASK_POS else node.kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node):
            continue
        if mask not in causal:
            causal[mask] = _is_data_free_causal(mask)
        if not causal[mask]:
            continue
        q, k, v = node.args[:_MASK_POS]
        kwargs = {key: val for key, val in node.kwargs.items() if key != "attn_mask"}
        k0, v0 = _unrepeated_kv(k), _unrepeated_kv(v)
        if k0 is not None and v0 is not None:
            k, v, kwargs = k0, v0, {**kwargs, "enable_gqa": True}
        node.args, node.kwargs = (q, k, v), {**kwargs, "is_causal": True}
        changed += 1
    if changed:
        graph.eliminate_dead_code()  # the mask builders and repeat_kv copies no one reads any more
        gm.recompile()
        log.info("tracer: %d attention calls use is_causal=True instead of a materialised mask", changed)
    return changed


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
        index = {n: i for i, n in enumerate(mask.graph.nodes)}
        value = _evaluate(sorted(order, key=index.__getitem__), mask)
    except Exception as err:  # a construct we cannot replay: keep the mask (correct, only slower)
        log.debug("tracer: cannot evaluate mask %s (%s); it is kept", mask.name, err)
        return False
    if not isinstance(value, torch.Tensor) or value.shape[-1] != value.shape[-2]:
        return False
    t = value.shape[-1]
    return torch.equal(value, torch.ones(t, t, dtype=torch.bool).tril().expand_as(value))


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
