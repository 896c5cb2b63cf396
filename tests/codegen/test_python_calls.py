"""ATen calls rewritten as tensor methods / torch functions: only where the binding runs the same op."""
from __future__ import annotations

import copy

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autopar.codegen.python_calls import bind_python_calls
from autopar.tracer import trace
from tests.codegen.plans import load_zoo

aten = torch.ops.aten


def _graph(fake_x: torch.Tensor, fake_w: torch.Tensor) -> fx.GraphModule:
    """Every case in one graph; placeholders carry fake values as traced nodes do."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"], w.meta["val"] = fake_x, fake_w
    calls = {
        "permute": (aten.permute.default, (w, [1, 0])),  # one overload: bound without evidence
        "mm": (aten.mm.default, (x, "permute")),  # mm.default / mm.dtype: bound after the check
        "add_scalar": (aten.add.Scalar, ("mm", 2)),  # Python's x.add(2) runs add.Tensor: stays ATen
        "add_tensor": (aten.add.Tensor, ("add_scalar", x)),
        "sum_all": (aten.sum.dim_IntList, ("add_tensor", [])),  # empty dims: reduce everything
        "in_place": (aten.mul_.Tensor, ("mm", 3.0)),  # writes its input: stays ATen
        "embedding": (aten.embedding.default, (w, "idx")),  # weight first: a function, not a method
    }
    idx = g.placeholder("idx")
    idx.meta["val"] = fake_x.new_zeros((3,), dtype=torch.int64)
    nodes = {"x": x, "w": w, "idx": idx}
    for name, (op, args) in calls.items():
        node = g.call_function(op, tuple(nodes.get(a, a) if isinstance(a, str) else a for a in args))
        node.name = name
        nodes[name] = node
    g.output((nodes["sum_all"], nodes["in_place"], nodes["embedding"]))
    return fx.GraphModule(nn.Module(), g)


def test_a_call_is_rewritten_only_where_its_binding_dispatches_the_same_op():
    mode = FakeTensorMode()
    with mode:
        fake_x, fake_w = torch.empty(3, 4), torch.empty(4, 4)
    gm, alone, reference, traced = (_graph(fake_x, fake_w) for _ in range(4))
    FakeTensorProp(traced, mode).propagate(fake_x, fake_w, fake_x.new_zeros((3,), dtype=torch.int64))
    evidence = {n.name: n for n in traced.graph.nodes}  # same names, every node with its fake value
    x, w, idx = torch.randn(3, 4), torch.randn(4, 4), torch.tensor([0, 3, 1])

    # without a traced counterpart only single-overload ops are bound
    assert bind_python_calls(alone, {}, {}) == 2, alone.code
    assert {n.name for n in alone.graph.nodes if n.op == "call_method"} == {"permute"}
    assert {n.name: n.target for n in alone.graph.nodes if n.op == "call_function"}["embedding"] is torch.embedding

    # with one: the checked multi-overload ops too, never add.Scalar or an in-place op
    assert bind_python_calls(gm, evidence, {name: name for name in evidence}) == 5, gm.code
    kinds = {n.name: (n.op, n.target) for n in gm.graph.nodes if n.op.startswith("call_")}
    assert kinds["mm"] == ("call_method", "mm") and kinds["add_tensor"] == ("call_method", "add")
    assert kinds["sum_all"] == ("call_method", "sum")
    assert kinds["add_scalar"] == ("call_function", aten.add.Scalar)
    assert kinds["in_place"] == ("call_function", aten.mul_.Tensor)
    assert "torch.ops.aten.add.Scalar(" in gm.code and "w.permute([1, 0])" in gm.code

    want, got = reference(x.clone(), w, idx), gm(x.clone(), w, idx)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), (want, got)


def test_a_traced_model_runs_bitwise_the_same_bound():
    """llama's traced graph (rope, SiLU, RMSNorm, SDPA, cross-entropy): forward and gradients equal to the last bit."""
    model, sample = load_zoo("llama").build(batch_size=2, seq_len=8, size="tiny", device="cpu")
    traced = trace(model, sample)
    bound = copy.deepcopy(traced.gm)
    evidence = {n.name: n for n in traced.gm.graph.nodes}
    calls = sum(1 for n in bound.graph.nodes if isinstance(n.target, torch._ops.OpOverload))
    count = bind_python_calls(bound, evidence, {name: name for name in evidence})
    assert count >= 0.9 * calls, (count, calls, bound.code)

    params, tensors = dict(model.named_parameters()), {**dict(model.named_buffers()), **dict(model.named_parameters())}
    user_inputs = iter(sample.values())  # the placeholders of user inputs come in the sample's order
    feeds = []
    for ph in traced.gm.graph.find_nodes(op="placeholder"):
        fqn = traced.param_fqns.get(ph.name) or traced.buffer_fqns.get(ph.name)
        feeds.append(tensors[fqn] if fqn else next(user_inputs))
    results = []
    for gm in (traced.gm, bound):
        torch.manual_seed(0)
        loss = gm(*feeds)[traced.loss_index]
        grads = torch.autograd.grad(loss, list(params.values()))
        results.append((loss, grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
