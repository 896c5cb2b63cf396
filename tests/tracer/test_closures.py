"""The tracer's copy of a model reads its own tensors, whatever path the forward takes to them.

`copy.deepcopy` keeps functions as they are: a lambda stored on a module still closes over the
original submodule, whose real weights export then lifts as constants (minGPT's `mlpf`: 8 of 29
parameters frozen, silently). The copy's functions are rebound (`tracer.closures`); what cannot be
rebound (a module kept in a global) is linked back to the model's parameter after tracing, or
refused naming the parameter (`tracer.lifted`).
"""
from __future__ import annotations

import functools
import weakref

import pytest
import torch
from torch import nn

from autopar.api import capture_copy, trace_copy
from autopar.errors import TraceError
from autopar.tracer import trace

_KEPT: dict[str, nn.Module] = {}  # a module kept outside the model, as some model code does


class Reached(nn.Module):
    """Submodules reached through a lambda, a partial, a list of lambdas, a default argument, a nested
    closure, a weak reference and a forward hook's closure: every parameter must be a graph input."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(4, 4) for _ in range(5))
        self.f = nn.Linear(4, 4)
        a, b = self.a, self.b
        self.via_lambda = lambda x: a(x)  # noqa: E731
        self.via_partial = functools.partial(lambda m, x: m(x), b)
        self.via_list = [lambda x, m=self.c: m(x)]
        inner = lambda x: self.d(x)  # noqa: E731  (closes over self)
        self.via_nested = lambda x: inner(x)  # noqa: E731
        self.via_weakref = weakref.ref(self.e)
        f = self.f
        self.f.register_forward_hook(lambda module, args, out: out + f.bias)

    def forward(self, x):
        x = self.via_nested(self.via_list[0](self.via_partial(self.via_lambda(x))))
        return (self.f(self.via_weakref()(x))).square().mean()


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_every_path_to_a_submodule_reads_the_copy(device):
    model = Reached()
    traced = trace(*capture_copy(model, torch.randn(2, 4), device))
    assert not traced.constants
    used = {traced.param_fqns[n.name] for n in traced.graph.nodes if n.op == "placeholder" and n.users and n.name in traced.param_fqns}
    assert used == {name for name, _ in model.named_parameters()}
    assert model.via_lambda.__closure__[0].cell_contents is model.a  # the model's own functions are left as they were
    assert model.via_weakref() is model.e


class KeptOutside(nn.Module):
    def __init__(self, key: str):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 4)
        _KEPT[key] = self.fc
        self.key = key

    def forward(self, x):
        return self.out(_KEPT[self.key](x)).square().mean()


def test_a_parameter_reached_past_the_copy_is_linked_back_and_trained():
    model = KeptOutside("linked")
    traced = trace_copy(model, torch.randn(2, 4), "cpu")
    assert not traced.constants and not traced.buffer_fqns
    reads = {traced.param_fqns[n.name] for n in traced.graph.nodes if n.name in traced.param_fqns and n.users}
    assert reads == {"fc.weight", "fc.bias", "out.weight", "out.bias"}


def test_a_view_of_a_parameter_reached_past_the_copy_is_refused_naming_it():
    model = KeptOutside("view")
    _KEPT["view"] = nn.Linear(4, 4)
    _KEPT["view"].weight = nn.Parameter(model.fc.weight.detach()[:, :4])  # shares fc.weight's storage
    _KEPT["view"].weight.data = model.fc.weight.detach().t()  # the same storage, transposed: another view
    with pytest.raises(TraceError) as err:
        trace_copy(model, torch.randn(2, 4), "cpu")
    message = str(err.value)
    assert "`fc.weight`" in message and "closure or lambda over a submodule" in message and "fix:" in message
    assert "test_closures.py" in message  # the user's line


def test_a_module_kept_outside_the_model_traced_on_meta_names_the_construct():
    model = KeptOutside("meta")
    with pytest.raises(TraceError) as err:
        trace_copy(model, torch.randn(2, 4), "meta")
    assert "outside the model's own parameters and buffers" in str(err.value) and "self.mlp(x)" in str(err.value)
