"""Where the model stops gradients, the traced graph stops them too.

The graph is run eagerly under autograd, so a gradient stop must be an op in
it. Export loses each of the ways a forward writes one:
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
  `stops_visible_to_export` makes the block switch the grad mode the way
  inference mode does (off inside `inference_mode()`, on inside
  `inference_mode(False)`), so it is exported as a no_grad block and detached
  like one. Eager forbids an inference tensor in a computation autograd
  records, so a forward that trains uses the block's results through a
  `.clone()`, a plain tensor with no gradient history: the same values and
  gradients as under no_grad.
- `t.detach_()` is exported as `detach_`, which the decompositions drop: it
  becomes `detach`, whose output every later use of `t` already reads.
- `w.data` read in the forward (an older layer's way to use a weight without
  its gradient) is a tensor export did not create, and the trace failed with
  "a fake tensor in the exported program constant's list" at no line. While
  export runs, a read from the model's code is `w.detach()`: the same values,
  no gradient. torch's own reads are unchanged.
- `w.data = value` in the forward (MoCo moves its momentum encoder so) is no op
  export sees: the graph read the old `w` and never changed it, silently (the
  key encoder stood still). While export runs, such a write from the model's
  code of a value shaped like `w` is `w.copy_(value)` under no_grad: an
  in-place change export records, which the parallel module writes back (a
  frozen parameter's, a buffer's). On a tensor that takes a gradient (a
  trained parameter), or with another shape or dtype, it is refused at its line.

Measured before the fixes: `detach` and no_grad blocks gave gradients off by up
to 3.9 on a 4-unit linear layer, `detach_` by up to 3.4 (the graph
differentiated through the stop); an inference-mode block let a student learn
through its own soft targets.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
from torch import fx

from autopar.errors import TraceError
from autopar.tracer.source_lines import calling_line, in_library

aten = torch.ops.aten
_GRAD_MODE_BLOCK = torch.ops.higher_order.wrap_with_set_grad_enabled


def detach_no_grad_inputs(gm: fx.GraphModule) -> int:
    """Detach the tensor inputs of every `torch.no_grad()` block in `gm` (export's graph before its
    decompositions, nested graph modules included), and write `detach_` as `detach`; returns how many blocks."""
    blocks = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in list(module.graph.nodes):
            if node.op == "call_function" and node.target is aten.detach_.default:
                node.target = aten.detach.default
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
def stops_visible_to_export(model_name: str) -> Iterator[None]:
    """Inside, `torch.inference_mode(mode)` sets the grad mode to `not mode` for its block and restores it
    after, `t.data` read by the model's code is `t.detach()`, and `t.data = v` is `t.copy_(v)`: export
    records each (the module docstring says why). Only while export runs; the classes are restored on the way out."""
    inference_mode = torch.autograd.grad_mode.inference_mode
    original_enter, original_exit = inference_mode.__enter__, inference_mode.__exit__
    data = torch._C.TensorBase.__dict__["data"]  # the C getter and setter `torch.Tensor` inherits

    def enter(self: Any) -> None:
        self._autopar_grad_was = torch.is_grad_enabled()
        torch.set_grad_enabled(not self.mode)

    def exit(self: Any, *exc_info: Any) -> None:
        torch.set_grad_enabled(self._autopar_grad_was)

    def read_data(self: torch.Tensor) -> torch.Tensor:
        if in_library(sys._getframe(1).f_code.co_filename):
            return data.__get__(self)
        return self.detach()

    def write_data(self: torch.Tensor, value: torch.Tensor) -> None:
        if in_library(sys._getframe(1).f_code.co_filename):
            data.__set__(self, value)
            return
        if (value.shape, value.dtype) != (self.shape, self.dtype):
            raise TraceError(
                f"cannot trace {model_name}: `.data = ...` at {calling_line()} makes a {tuple(self.shape)} "
                f"{self.dtype} tensor {tuple(value.shape)} {value.dtype}: the graph cannot change a tensor's shape "
                "or dtype\n  fix: do it outside the forward, or compute a new tensor from the old")
        if self.requires_grad:
            raise TraceError(
                f"cannot trace {model_name}: `.data = ...` at {calling_line()} replaces the values of a tensor that "
                "takes a gradient (a trained parameter): the optimizer owns a parameter's shards, and its gradient "
                "is of the values before the change\n"
                "  fix: change it outside the forward (after optimizer.step(), under torch.no_grad()); a frozen "
                "parameter (requires_grad=False: a momentum encoder) may be changed in the forward")
        with torch.no_grad():
            self.copy_(value)

    inference_mode.__enter__, inference_mode.__exit__ = enter, exit
    torch.Tensor.data = property(read_data, write_data)
    try:
        yield
    finally:
        inference_mode.__enter__, inference_mode.__exit__ = original_enter, original_exit
        del torch.Tensor.data
