"""Input checks that every rank runs on its own part, without a collective.

`F.one_hot(labels, n)` exports two checks on its input, each a reduction to one
boolean and `_assert_async`:

    _assert_async(logical_not(any(logical_not(labels >= 0))), "one_hot: Class values must be non-negative.")

The reduction `any` has a sharding rule only for a whole input, so with the
labels split by batch the solver had to gather them (or the whole batch) for
a check that holds on the full tensor exactly when it holds on every rank's
part. This pass writes each such check, "every element of `condition` is
true", as one op, `autopar::check_all(condition, message)`: its rule accepts
the condition split any way or whole (never as partial sums), and each rank
checks the elements it holds (`torch._assert_async` of their `all()`, as the
exported check would). Checks of any other form are left as exported.
"""
from __future__ import annotations

import logging

import torch
from torch import fx

log = logging.getLogger(__name__)
aten = torch.ops.aten


@torch.library.custom_op("autopar::check_all", mutates_args=())
def check_all(condition: torch.Tensor, message: str) -> None:
    """Raise `message` (asynchronously on a GPU, as `torch._assert_async`) unless every element is true."""
    torch._assert_async(condition.all(), message)


@check_all.register_fake
def _(condition: torch.Tensor, message: str) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.autopar.check_all.default)  # no output, yet never dead code

_ASSERTS = (aten._assert_async.msg, aten._assert_async.default)
_ANY = (aten.any.default, aten.any.dims, aten.any.dim)


def localize_checks(gm: fx.GraphModule) -> int:
    """Rewrite every `_assert_async` of `gm` that checks all elements of one tensor; returns how many."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ASSERTS:
            continue
        condition = _all_of(node.args[0])
        if condition is None:
            continue
        message = node.args[1] if len(node.args) > 1 else "assertion failed"
        with graph.inserting_before(node):
            check = graph.call_function(torch.ops.autopar.check_all.default, (condition, message))
        check.meta = {**node.meta, "val": None}
        chain = [node.args[0]]
        graph.erase_node(node)
        while chain:  # the reductions and negations no one reads now
            x = chain.pop()
            if isinstance(x, fx.Node) and x is not condition and not x.users:
                chain.extend(x.all_input_nodes)
                graph.erase_node(x)
        rewritten += 1
    if rewritten:
        gm.recompile()
        log.info("tracer: %d input checks made rank-local", rewritten)
    return rewritten


def _all_of(node: object) -> fx.Node | None:
    """p when `node` computes "every element of p is true" as export writes it: not(any(not(p))) over all dims."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.logical_not.default:
        reduced = node.args[0]
        if isinstance(reduced, fx.Node) and reduced.target in _ANY and _over_all_dims(reduced):
            inner = reduced.args[0]
            if isinstance(inner, fx.Node) and inner.target is aten.logical_not.default:
                return inner.args[0] if isinstance(inner.args[0], fx.Node) else None
    return None


def _over_all_dims(reduction: fx.Node) -> bool:
    """The reduction leaves one element (no dims named, or every dim of its input)."""
    if reduction.target is aten.any.default:
        return True
    dims = reduction.args[1] if len(reduction.args) > 1 else reduction.kwargs.get("dim")
    ndim = reduction.args[0].meta["val"].dim()
    if dims is None or dims == []:
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % max(ndim, 1) for d in dims) == list(range(ndim))
