"""How a model's loss adds up over micro-batches, read off its traced graph.

    split = split_loss(traced)   # LossSplit("count", total="sum_2", count="_to_copy") for cross-entropy
    # each micro-batch's last stage returns `total` (and `count`); the step's loss is sum(totals) / divisor

A pipeline runs the model on micro-batches and sums their gradients. That equals one device's step
only when the loss of the whole batch is a sum of the micro-batches' parts over one divisor:

- "count": `total / count`, the count a sum over the batch that carries no gradient (cross-entropy's
  number of labels not ignored): the divisor is the count summed over every micro-batch;
- "mean": a mean over all elements of a batch-sized tensor: each micro-batch's mean is returned and
  the divisor is the number of micro-batches (they are of equal sizes);
- "sum": a sum over all elements: the divisor is 1.

Gradients are those of the parts' sum, divided by the divisor once the step's micro-batches are done
(`runtime`): backward never waits for a count that later micro-batches add to. Any other loss (a mean
plus a term computed once per batch, a ratio of two sums that both carry gradients) would change
under micro-batches, and the model gets no pipeline (`LossError` says why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx

from autopar.errors import AutoparError
from autopar.tracer import TracedGraph

aten = torch.ops.aten

LossKind = Literal["count", "mean", "sum"]

# A count's own conversions (cross-entropy counts labels as an integer sum, then casts it to the loss's dtype).
_CASTS = (aten._to_copy.default, aten.clone.default, aten.alias.default)
_FULL_SUMS = (aten.sum.default, aten.sum.dim_IntList)
_FULL_MEANS = (aten.mean.default, aten.mean.dim)


class LossError(AutoparError):
    """The model's loss does not add up over micro-batches, so no pipeline can train it as one device."""


@dataclass(frozen=True)
class LossSplit:
    kind: LossKind
    total: str  # the node each micro-batch's last stage returns as its part of the loss
    count: str | None = None  # kind "count": the node giving the micro-batch's count


def split_loss(traced: TracedGraph) -> LossSplit:
    """How `traced`'s loss adds up over micro-batches, or `LossError` naming the loss's op and the forms that do."""
    if traced.loss_index is None or traced.output_names[traced.loss_index] is None:
        raise LossError(f"{traced.model_name or 'the model'} returns no loss (a float scalar): a pipeline trains a "
                        "model that returns its loss")
    loss = traced.node(traced.output_names[traced.loss_index])
    params = set(traced.param_fqns)
    if loss.target is aten.div.Tensor and all(isinstance(a, fx.Node) for a in loss.args[:2]):
        total, count = loss.args[:2]
        if _full_sum(total) and _full_sum(_uncast(count)) and not _reads(count, params):
            return LossSplit("count", total.name, count.name)
    if loss.target in _FULL_MEANS and _whole(loss):
        return LossSplit("mean", loss.name)
    if _full_sum(loss):
        return LossSplit("sum", loss.name)
    raise LossError(f"the loss is {loss.format_node()}, which does not add up over micro-batches: a pipeline needs a "
                    "loss that is a mean over the batch (`.mean()`, F.mse_loss), a sum, or a sum over a count of "
                    "the batch (F.cross_entropy); compute other terms outside the model or train without pp")


def _uncast(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _CASTS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _full_sum(node: fx.Node) -> bool:
    """A sum of every element of its input into a scalar."""
    return node.op == "call_function" and node.target in _FULL_SUMS and _whole(node)


def _whole(node: fx.Node) -> bool:
    """The reduction leaves a 0-dim value (over all dims, `dim=[]` or every dim)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _reads(node: fx.Node, placeholders: set[str]) -> bool:
    """Whether `node` is computed from any of `placeholders` (a count computed from weights carries their gradient)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.op == "placeholder" and n.name in placeholders:
            return True
        stack.extend(n.all_input_nodes)
    return False
