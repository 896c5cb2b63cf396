"""Per-node numbers against hand counts: FLOPs, saved tensors (storage sharing), parameter/optimizer bytes."""
from __future__ import annotations

import pytest
import sympy
import torch
from torch import nn

from autopar.profiler import ProfileError, profile, profile_table
from autopar.tracer import trace
from tests.profiler.zoo import load_example


class Net(nn.Module):
    """x -> Linear(16, 48) -> split into q, k, v -> sdpa -> gelu -> sum."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(16, dim=2)
        q, k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in (q, k, v))  # (B, 2, T, 8)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.nn.functional.gelu(y).sum()


@pytest.fixture(scope="module")
def net_profile():
    with torch.device("meta"):
        model = Net()
    traced = trace(model, torch.empty(4, 32, 16, device="meta"), dynamic_dims={"batch": 0, "seq": 1})
    return traced, profile(traced, optimizer="adamw")


def _by_op(prof, op: str):
    return [p for p in prof.nodes.values() if p.op == op]


def test_symbolic_flops_are_hand_counts(net_profile):
    traced, prof = net_profile
    B, S = traced.symbols["batch"], traced.symbols["seq"]
    (lin,) = _by_op(prof, "aten.addmm.default")
    assert sympy.expand(lin.fwd_flops - 2 * B * S * 16 * 48) == 0
    # x does not require grad: backward is only the weight gradient (one matmul of the same size).
    assert sympy.expand(lin.bwd_flops - 2 * B * S * 16 * 48) == 0
    (attn,) = _by_op(prof, "aten.scaled_dot_product_attention.default")
    # q @ k^T and p @ v: 2 * (2 * B * H * S * S * D); torch's formula ignores causality.
    assert sympy.expand(attn.fwd_flops - 4 * B * 2 * S * S * 8) == 0
    assert sympy.expand(attn.bwd_flops - sympy.Rational(5, 2) * attn.fwd_flops) == 0


def test_saved_views_count_once_at_their_producer(net_profile):
    traced, prof = net_profile
    (lin,) = _by_op(prof, "aten.addmm.default")
    (attn,) = _by_op(prof, "aten.scaled_dot_product_attention.default")
    (gelu,) = _by_op(prof, "aten.gelu.default")
    # q, k and v are three views of the one qkv buffer: attention keeps that buffer once.
    assert (lin.name, 0) in attn.saved_refs
    assert sum(1 for r in attn.saved_refs if r == (lin.name, 0)) == 1
    assert lin.saved_outputs == (True,)
    assert attn.saved_outputs == (True,)  # kept by attention itself (out) and by gelu (its input)
    assert gelu.saved_outputs == (False,)  # only summed
    B, S = 8, 32
    cost = prof.evaluate(batch=B, seq=S)
    # logsumexp (B, H, S) fp32 is the one saved tensor that is not a graph value.
    assert cost.nodes[attn.name].extra_saved_bytes == B * 2 * S * 4
    assert cost.nodes[lin.name].output_bytes == (B * S * 48 * 4,)
    views = [c for c in cost.nodes.values() if c.op in ("aten.view.default", "aten.permute.default")]
    assert views and all(c.output_bytes == (0.0,) for c in views)


def test_sym_size_nodes_cost_nothing(net_profile):
    _, prof = net_profile
    sym = [p for p in prof.nodes.values() if p.op == "aten.sym_size.int"]
    assert sym and all(p.fwd_flops == 0 and p.output_bytes == () for p in sym)


@pytest.mark.parametrize(
    "optimizer,state_per_param",
    [("sgd", lambda b: 0), ("sgd_momentum", lambda b: b), ("adam", lambda b: 2 * b + 4), ("AdamW", lambda b: 2 * b + 4)],
)
def test_parameter_and_optimizer_bytes(net_profile, optimizer, state_per_param):
    traced, _ = net_profile
    params = profile(traced, optimizer=optimizer).params
    w, b = params["qkv.weight"], params["qkv.bias"]
    assert (w.numel, w.param_bytes, w.grad_bytes) == (48 * 16, 48 * 16 * 4, 48 * 16 * 4)
    assert w.optimizer_bytes == state_per_param(48 * 16 * 4)
    assert b.optimizer_bytes == state_per_param(48 * 4)


def test_frozen_parameters_have_no_gradient_or_optimizer_state():
    """A frozen parameter (`requires_grad=False`) gets no gradient and no optimizer state, as torch's AdamW
    keeps none for it; a frozen first layer's backward stops there (no gradient for its output)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    model[0].requires_grad_(False)
    x = torch.randn(4, 16)
    params = profile(trace(model, x)).params
    assert (params["0.weight"].grad_bytes, params["0.weight"].optimizer_bytes) == (0, 0)
    assert params["0.weight"].param_bytes == 16 * 32 * 4
    opt = torch.optim.AdamW(model.parameters())
    model(x).sum().backward()
    opt.step()
    state_bytes = sum(t.numel() * t.element_size() for t in opt.state[model[2].weight].values())
    assert not opt.state[model[0].weight] and params["2.weight"].optimizer_bytes == state_bytes
    assert params["2.weight"].grad_bytes == 32 * 4 and model[0].weight.grad is None
    nodes = profile(trace(model, x)).nodes
    assert [(n.op, n.requires_grad) for n in nodes.values() if n.op in ("aten.addmm.default", "aten.relu.default")] == [
        ("aten.addmm.default", False), ("aten.relu.default", False), ("aten.addmm.default", True)]


class _OpsOnParamSizedTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts every ATen op, and the ops writing a tensor of `numel` elements (in place or as a new output)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops, self.writes = numel, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.writes += isinstance(out, torch.Tensor) and out.numel() == self.numel
        return out


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_momentum", "adam", "adamw", "adafactor", "muon"])
def test_optimizer_step_launches_and_writes_as_torch_runs_it(net_profile, optimizer):
    """The step's price per parameter (`cost.optimizer_step_s`) counts what torch.optim's step dispatches:
    the difference between stepping two parameters and one is one parameter's ops. Matrices shaped as
    qkv.weight (Adafactor steps vectors otherwise; Muon takes matrices only); the state is torch's own."""
    from autopar.profiler.measure import make_optimizer

    def counted(n_params: int) -> tuple[_OpsOnParamSizedTensors, torch.optim.Optimizer]:
        params = nn.ParameterList([nn.Parameter(torch.randn(48, 16)) for _ in range(n_params)])
        opt = make_optimizer(params, optimizer)
        for p in params:
            p.grad = torch.randn(48, 16)
        opt.step()  # the first step creates the state
        with _OpsOnParamSizedTensors(48 * 16) as mode:
            opt.step()
        return mode, opt

    (one, opt), (two, _) = counted(1), counted(2)
    traced, _ = net_profile
    w = profile(traced, optimizer=optimizer).params["qkv.weight"]
    assert w.update_launches == two.ops - one.ops
    assert w.update_write_bytes == (two.writes - one.writes) * w.param_bytes
    state = opt.state[opt.param_groups[0]["params"][0]]  # none for plain SGD
    assert w.optimizer_bytes == sum(t.numel() * t.element_size() for t in state.values())


def test_unknown_optimizer_is_named(net_profile):
    traced, _ = net_profile
    with pytest.raises(ProfileError, match="lamb"):
        profile(traced, optimizer="lamb")


def test_tied_parameters_count_once(traced_zoo):
    traced = traced_zoo("gpt2")
    params = profile(traced).params
    model, _ = load_example("gpt2").build(2, 16, size="tiny", device="meta")
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedupes ties
    assert sum(p.param_bytes for p in params.values()) == unique


def test_profile_table_rolls_up_per_block(traced_zoo):
    traced = traced_zoo("gpt2")
    prof = profile(traced)
    rows = profile_table(traced, prof, batch=2, seq=16)
    names = [r.module for r in rows]
    assert "transformer.h.0" in names and "transformer.h.1" in names
    cost = prof.evaluate(batch=2, seq=16)
    assert sum(r.fwd_flops for r in rows) == sum(c.fwd_flops for c in cost.nodes.values())
    assert sum(r.param_bytes for r in rows) == sum(p.param_bytes for p in cost.params.values())
    h0, h1 = (next(r for r in rows if r.module == f"transformer.h.{i}") for i in (0, 1))
    assert h0.fwd_flops == h1.fwd_flops > 0 and h0.activation_bytes == h1.activation_bytes > 0
