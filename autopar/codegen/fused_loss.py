"""Cross-entropy's sum run as one `nll_loss_forward` again, where the trace spelled it out.

Core-ATen decomposition writes `nll_loss_forward(logp, target, reduction=mean, ignore_index)` as
a mask, two `where`s, an `unsqueeze`/`gather`/`squeeze` to pick each row's target, a `neg` and
two sums (the losses' and the kept rows' count), then their quotient. The solver needs the sum
and the count apart: a global mean all-reduces both (`runtime.deferred_loss`). Run as written,
the sum is nine calls in forward and five autograd nodes in backward where eager runs one of each.
So codegen puts the sum back as `nll_loss_forward(logp, target, None, reduction=sum,
ignore_index)[0]`, the same value: the sum over the rows whose target is not `ignore_index` of
`-logp[row, target[row]]` (its second output, the count, is not used: the graph's own count stays,
in the dtype the trace chose). Measured on one rank of gpt2-tiny (DDP's plan, train steps
interleaved with DDP's): about 1% of the step.

The pass reads the lowered graph, so it only fires where the whole chain runs on local tensors
(no collective between its nodes) and nothing else reads its intermediate values.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

aten = torch.ops.aten

_REDUCTION_SUM = 2  # torch's Reduction enum: none 0, mean 1, sum 2


def _is(node: object, *ops: torch._ops.OpOverload) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in ops


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]


def _zero(node: object) -> bool:
    """`scalar_tensor(0)`: what the decomposition fills ignored rows with."""
    return _is(node, aten.scalar_tensor.default) and node.args[0] == 0


def _match(total: fx.Node) -> tuple[fx.Node, fx.Node, int, list[fx.Node]] | None:
    """(logp, target, ignore_index, the chain's nodes) when `total` sums an unfolded cross-entropy."""
    if total.kwargs or len(total.args) > 2:
        return None  # a dtype or keepdim: not the plain sum the decomposition writes
    whole = _is(total, aten.sum.dim_IntList) and len(total.args) == 2 and not total.args[1]
    if not (_is(total, aten.sum.default) or whole):
        return None  # `dim` [] or None: a sum over everything
    kept = total.args[0]
    if not (_is(kept, aten.where.self) and _only_user(kept, total) and _zero(kept.args[2])):
        return None
    mask, neg = kept.args[0], kept.args[1]
    if not (_is(neg, aten.neg.default) and _only_user(neg, kept)):
        return None
    squeeze = neg.args[0]
    if not (_is(squeeze, aten.squeeze.dims, aten.squeeze.dim) and _only_user(squeeze, neg)
            and list(squeeze.args[1:]) in ([[1]], [1])):
        return None
    gather = squeeze.args[0]
    if not (_is(gather, aten.gather.default) and _only_user(gather, squeeze) and gather.args[1] == 1
            and not gather.kwargs.get("sparse_grad", False) and len(gather.args) == 3):
        return None
    logp, index = gather.args[0], gather.args[2]
    if not (_is(index, aten.unsqueeze.default) and _only_user(index, gather) and index.args[1] == 1):
        return None
    safe = index.args[0]  # the target with ignored rows set to class 0
    if not (_is(safe, aten.where.self) and _only_user(safe, index) and safe.args[0] is mask and _zero(safe.args[2])):
        return None
    target = safe.args[1]
    if not (_is(mask, aten.ne.Scalar) and mask.args[0] is target and isinstance(mask.args[1], int)):
        return None
    return logp, target, mask.args[1], [total, kept, neg, squeeze, gather, index, safe]


def fuse_cross_entropy_sums(graph: fx.Graph) -> int:
    """Replace each unfolded cross-entropy sum in `graph` by one `nll_loss_forward`; returns how many."""
    count = 0
    for node in list(graph.nodes):
        found = _match(node)
        if found is None:
            continue
        logp, target, ignore_index, chain = found
        with graph.inserting_before(node):
            fused = graph.call_function(aten.nll_loss_forward.default, (logp, target, None, _REDUCTION_SUM, ignore_index))
            value = graph.call_function(operator.getitem, (fused, 0))
        node.replace_all_uses_with(value)
        fills = {chain[1].args[2], chain[-1].args[2]}  # the two scalar_tensor(0) nodes
        for dead in chain:  # consumers first: each is unused once the one after it is gone
            graph.erase_node(dead)
        for fill in fills:
            if not fill.users:
                graph.erase_node(fill)
        count += 1
    return count
