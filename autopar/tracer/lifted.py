"""Constants the export lifted that are the model's own parameters or buffers, linked back to them.

    copied, batch = capture_copy(model, sample, "cpu")
    traced = link_lifted_state(trace(copied, batch), copied, model)

The tracer runs a copy of the model (`api.capture_copy`). A forward that reaches
a tensor of the ORIGINAL model by a path the copy does not own (a module kept in
a global or a class attribute; a closure `tracer.closures` could not rebind) reads
its real values, and torch.export lifts them as constants (`TracedGraph.constants`);
so it does with a parameter of the copy itself held by another reference than its
module's attribute (`functools.partial(F.linear, weight=self.w)`): export swaps the
module's attributes for its inputs, not the references held elsewhere. Either way
the parallel module would hold a frozen copy of a parameter one device trains,
and nothing would say so. A lifted constant that is a parameter or buffer of the
copy, or shares storage with one of the model, is that tensor: its uses are moved onto the placeholder of
that parameter or buffer (which the copy's export lifted as an input, unread),
and it trains as on one device. A view of one (other shape, strides or offset)
cannot stand for it, and is an error naming the parameter and the fix.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from autopar.errors import TraceError
from autopar.tracer.capture import TracedGraph
from autopar.tracer.source_lines import node_line


def link_lifted_state(traced: TracedGraph, *models: nn.Module) -> TracedGraph:
    """`traced` with each lifted constant that is a parameter or buffer of one of `models` (the copy traced, the
    model it was copied from) read as that one."""
    own: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for model in models:
        for fqn, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            for key in _keys(t):
                own.setdefault(key, []).append((fqn, t))
    lifted = [(name, fqn, traced.constants[fqn]) for name, fqn in traced.buffer_fqns.items() if fqn in traced.constants]
    matches = [(name, fqn, t, next(own[k] for k in _keys(t) if k in own)) for name, fqn, t in lifted
               if any(k in own for k in _keys(t))]
    if not matches:
        return traced
    placeholders = {fqn: name for name, fqn in {**traced.param_fqns, **traced.buffer_fqns}.items()}
    buffer_fqns, constants = dict(traced.buffer_fqns), dict(traced.constants)
    for name, lifted_fqn, tensor, candidates in matches:
        owner = next((fqn for fqn, t in candidates if _same_view(t, tensor)), None)
        target = placeholders.get(_canonical(traced, owner)) if owner else None
        if target is None or traced.node(target).meta["val"].dtype != tensor.dtype:
            raise TraceError(_unowned_message(type(models[0]).__name__, candidates[0][0], traced.node(name)))
        node = traced.node(name)
        node.replace_all_uses_with(traced.node(target))
        traced.graph.erase_node(node)
        del buffer_fqns[name], constants[lifted_fqn]
    traced.gm.recompile()
    return replace(traced, buffer_fqns=buffer_fqns, constants=constants)


def _keys(t: torch.Tensor) -> list[int]:
    """What identifies the storage `t` views (`_cdata`: its StorageImpl's address, which a detached alias shares, on
    real, meta and fake tensors alike), or nothing for a tensor without one (sparse)."""
    try:
        return [t.untyped_storage()._cdata]
    except (RuntimeError, NotImplementedError):
        return []


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)


def _canonical(traced: TracedGraph, fqn: str) -> str:
    """The name a tied parameter's placeholder has (`TracedGraph.tied_params`)."""
    return next((owner for owner, others in traced.tied_params.items() if fqn in others), fqn)


def _unowned_message(model_name: str, fqn: str, node: torch.fx.Node) -> str:
    where = node_line(next(iter(node.users))) if node.users else "an unknown line"
    return (f"cannot trace {model_name}: the forward reads `{fqn}` (or a view of it) at {where} through a reference "
            "the model does not own, so the parallel module would hold a frozen copy of it. This happens with a closure or lambda over a "
            "submodule that cannot be copied with the model, or a module kept outside the model (a global, a class "
            f"attribute)\n  fix: reach it through the model's own attributes in forward (`self.mlp.c_fc(x)`), or "
            "make the lambda a method of the module")
