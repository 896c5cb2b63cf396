"""Where the model stops gradients, the traced graph stops them too.

The graph is run eagerly under autograd, so a gradient stop must be an op in
it. Export loses both of the ways a forward writes one:
- `x.detach()` (a straight-through estimator's `z + (q - z).detach()`, a
  stop-gradient target) is in the exported graph, but the core-ATen
  decompositions turn it into `alias`, through which gradients flow. The
  tracer keeps it whole (`capture._KEEP_WHOLE`).
- A `with torch.no_grad():` block (an EMA teacher's targets, a codebook
  lookup) is exported as `wrap_with_set_grad_enabled(False, body, *inputs)`,
  and the decompositions inline the body as ordinary ops. Before they run,
  this pass detaches every tensor the block reads (`detach_no_grad_inputs`):
  what the block computes from detached inputs is what it computes under
  no_grad, needs no gradient, and keeps nothing for backward.
- A `with torch.inference_mode():` block (or `@torch.inference_mode()`) is
  not in the exported graph at all: export records grad-mode switches, and
  inference mode is a dispatch key it does not see. While export runs,
  `inference_mode_as_no_grad` makes the block switch the grad mode the way
  inference mode does (off inside `inference_mode()`, on inside
  `inference_mode(False)`), so it is exported as a no_grad block and detached
  like one. Eager forbids an inference tensor in a computation autograd
  records, so a forward that trains uses the block's results through a
  `.clone()`, a plain tensor with no gradient history: the same values and
  gradients as under no_grad.

Measured before the fix: each construct gave gradients off by up to 3.9 on a
4-unit linear layer (the graph differentiated through the stop).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import fx

aten = torch.ops.aten
_GRAD_MODE_BLOCK = torch.ops.higher_order.wrap_with_set_grad_enabled


def detach_no_grad_inputs(gm: fx.GraphModule) -> int:
    """Detach the tensor inputs of every `torch.no_grad()` block in `gm` (export's graph before its
    decompositions, nested graph modules included); returns how many blocks."""
    blocks = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in list(module.graph.nodes):
            if node.op == "call_function" and node.target is _GRAD_MODE_BLOCK and node.args[0] is False:
                enabled, body, *inputs = node.args
                with module.graph.inserting_before(node):
                    inputs = [_detached(module.graph, x) for x in inputs]
                node.args = (enabled, body, *inputs)
                blocks += 1
        module.recompile()
    return blocks


def _detached(graph: fx.Graph, x: object) -> object:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return x
    out = graph.call_function(aten.detach.default, (x,))
    out.meta = {**x.meta, "val": val.detach()}
    return out


@contextlib.contextmanager
def inference_mode_as_no_grad() -> Iterator[None]:
    """Inside, `torch.inference_mode(mode)` sets the grad mode to `not mode` for its block and restores it
    after, which export records (the module docstring says why). Only while export runs: nothing else in
    the process uses inference mode then, and the class is restored on the way out."""
    cls = torch.autograd.grad_mode.inference_mode
    original_enter, original_exit = cls.__enter__, cls.__exit__

    def enter(self: Any) -> None:
        self._autopar_grad_was = torch.is_grad_enabled()
        torch.set_grad_enabled(not self.mode)

    def exit(self: Any, *exc_info: Any) -> None:
        torch.set_grad_enabled(self._autopar_grad_was)

    cls.__enter__, cls.__exit__ = enter, exit
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = original_enter, original_exit
