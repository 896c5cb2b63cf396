"""The tracer on every zoo model: FQNs, op counts and numerics checked against the eager model."""
from __future__ import annotations

import collections
import random
import warnings
from pathlib import Path

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autopar.compat import TORCH_RELEASE
from autopar.errors import TraceError
from autopar.tracer import split_sample_input, trace, with_device
from tests.codegen.harness import LogRecords, call, loss_of

from tests.zoo import ZOO, load_zoo


class CountCalls(TorchFunctionMode):
    """Counts the torch-level calls the eager model makes: the independent reference for node counts."""

    # `a @ b` reaches a TorchFunctionMode as the method `Tensor.matmul`, never as `Tensor.__matmul__` (Hugging Face
    # LLaMA's rotary embedding under transformers 5.17 makes one: `inv_freq_expanded @ position_ids_expanded`)
    WATCHED = {F.linear: "linear", F.scaled_dot_product_attention: "sdpa", F.conv2d: "conv", F.embedding: "embedding",
               torch.matmul: "matmul", torch.Tensor.matmul: "matmul", torch.bmm: "matmul"}

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.WATCHED:
            self.counts[self.WATCHED[func]] += 1
        return func(*args, **(kwargs or {}))


def graph_counts(traced) -> collections.Counter:
    kinds = {"mm": "matmul", "addmm": "matmul", "bmm": "matmul", "scaled_dot_product_attention": "sdpa",
             "convolution": "conv", "embedding": "embedding"}
    out = collections.Counter()
    for n in traced.graph.nodes:
        if n.op == "call_function" and hasattr(n.target, "_schema"):
            name = n.target._schema.name.split("::")[-1]
            if name in kinds:
                out[kinds[name]] += 1
    return out


def placeholder_values(traced, model, sample_input) -> list:
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers()) | dict(traced.constants)  # and the tensors the trace lifted
    user = dict(zip(traced.input_names, pytree.tree_leaves(split_sample_input(sample_input))))
    values = []
    for n in traced.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name in traced.param_fqns:
            values.append(params[traced.param_fqns[n.name]])
        elif n.name in traced.buffer_fqns:
            values.append(buffers[traced.buffer_fqns[n.name]])
        else:
            values.append(user[n.name])
    return values



def assert_eager_gradients(traced, model, sample_input, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """The gradients of the traced graph's first output by the parameters equal those of the eager model's loss."""
    values = placeholder_values(traced, model, sample_input)
    params = [v for v in values if isinstance(v, torch.nn.Parameter)]
    got = torch.autograd.grad(pytree.tree_leaves(traced.gm(*values))[0], params)
    args, kwargs = split_sample_input(sample_input)
    want = torch.autograd.grad(model(*args, **kwargs), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_traces_on_meta_like_eager(name):
    zoo = load_zoo(name)
    meta_model, meta_input = zoo.build(batch_size=2, seq_len=16, size="tiny", device="meta")
    traced = trace(meta_model, meta_input)

    # Parameters by FQN: exactly the eager model's (tied weights appear once, as in named_parameters()).
    assert sorted(traced.param_fqns.values()) == sorted(n for n, _ in meta_model.named_parameters())
    assert sorted(traced.buffer_fqns.values()) == sorted(n for n, _ in meta_model.named_buffers())
    # No real memory: every value in the graph is a fake/meta tensor.
    for n in traced.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert val.device.type == "meta", n.format_node()

    # Node counts against the eager model's own calls on real tensors.
    model, sample = zoo.build(batch_size=2, seq_len=16, size="tiny", device="cpu")
    with CountCalls() as counter:
        eager_loss = loss_of(call(model, sample))
    eager = counter.counts
    got = graph_counts(traced)
    # HF GPT-2's Conv1D is an addmm, not F.linear: count its modules instead.
    conv1d = sum(1 for m in model.modules() if type(m).__name__ == "Conv1D")
    assert got["matmul"] == eager["linear"] + eager["matmul"] + conv1d, (got, eager)
    assert got["sdpa"] == eager["sdpa"], (got, eager)
    assert got["conv"] == eager["conv"], (got, eager)
    assert got["embedding"] == eager["embedding"], (got, eager)

    # Running the captured graph on the real weights gives the eager loss.
    with torch.no_grad():
        outs = with_device(traced.gm, "cpu")(*placeholder_values(traced, model, sample))
    # the graph returns the buffers it updates (BatchNorm's running stats) before the user outputs
    returned = [a.name for a in next(n for n in traced.graph.nodes if n.op == "output").args[0]]
    graph_loss = outs[returned.index(traced.output_names[traced.loss_index])]
    torch.testing.assert_close(graph_loss, eager_loss.detach(), rtol=1e-5, atol=1e-6)


def test_dynamic_dims_become_symbols():
    zoo = load_zoo("gpt2")
    model, sample = zoo.build(batch_size=2, seq_len=16, size="tiny", device="meta")
    traced = trace(model, sample, dynamic_dims={"batch": 0, "seq": 1})
    assert set(traced.symbols) == {"batch", "seq"}
    ids = next(n for n in traced.graph.nodes if n.name == traced.input_names[0]).meta["val"]
    assert [d.node.expr for d in ids.shape] == [traced.symbols["batch"], traced.symbols["seq"]]


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        if h.sum() > 0:  # data-dependent branch: the line the error must name
            return h.mean()
        return h.sum()


def test_data_dependent_branch_names_the_line():
    with pytest.raises(TraceError) as info:
        trace(DataDependent(), torch.randn(2, 4))
    message = str(info.value)
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "the line the error must name" in text)
    assert f"{Path(__file__).name}:{line}" in message, message
    assert "data-dependent control flow" in message
    assert "torch.where" in message  # the fix


class QueuePointer(torch.nn.Module):
    """MoCo's queue of keys, written at a pointer kept in a buffer and read as a Python int."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("queue", torch.zeros(4, 16))
        self.register_buffer("ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        h = self.proj(x)
        with torch.no_grad():
            ptr = int(self.ptr)  # a Python number from a tensor: the line the error must name
            self.queue[:, ptr:ptr + h.shape[0]] = h.T
            self.ptr[0] = (ptr + h.shape[0]) % 16
        return (h @ self.queue).sum()


def test_tensor_value_as_python_number_names_the_line_and_a_tensor_index():
    """Not "control flow" and `torch.where`: the fix for an index read off a tensor is to index with the tensor."""
    with pytest.raises(TraceError) as info:
        trace(QueuePointer(), torch.randn(2, 4))
    message = str(info.value)
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "a Python number from a tensor: the line" in text)
    assert f"{Path(__file__).name}:{line}" in message, message
    assert "read as a Python number" in message and "index_copy_" in message and "torch.where" not in message


def test_training_mode_is_captured_and_restored():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    model.eval()
    traced = trace(model, torch.randn(2, 4))
    ops = {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert any("dropout" in op or "bernoulli" in op or "rand" in op for op in ops), ops
    assert not model.training


class Handle:
    """An object a forward returns that holds a tensor but is no pytree: export cannot take it apart."""

    def __init__(self, t):
        self.t = t


class ReturnsHandle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).sum(), Handle(x)


def test_an_output_torch_cannot_flatten_is_named_with_a_fix():
    with pytest.raises(TraceError) as info:
        trace(ReturnsHandle(), torch.randn(2, 4))
    message = str(info.value)
    assert "Handle" in message and "an output of a type torch cannot take apart" in message, message
    assert "register_pytree_node" in message and "<string>" not in message, message


class Pooled(torch.nn.Module):
    """Swin's pooler (`AdaptiveAvgPool1d`) next to an `as_strided` that really moves elements (a transpose)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.pool = torch.nn.AdaptiveAvgPool1d(1)

    def forward(self, x):  # x: (batch, tokens, 8)
        h = self.proj(x)
        pooled = self.pool(h.transpose(1, 2)).flatten(1)  # (batch, 8)
        square = h[0, :8, :]  # (8, 8), contiguous
        moved = torch.as_strided(square, (8, 8), (1, 8))  # its transpose: not its input, element for element
        return pooled.sum() + (moved * torch.arange(64.0).view(8, 8)).sum()


def test_an_as_strided_that_restates_its_input_is_dropped_and_a_real_one_kept():
    model, x = Pooled(), torch.randn(3, 8, 8)
    traced = trace(model, x)
    restrided = [n for n in traced.graph.nodes if n.op == "call_function" and "as_strided" in str(n.target)]
    # the export's own as_strided for the pool, counted on the graph before the pass
    exported = torch.export.export(model, (x,)).run_decompositions().graph_module.graph
    assert sum("as_strided" in str(n.target) for n in exported.nodes) == 2
    assert len(restrided) == 1 and list(restrided[0].args[2]) == [1, 8], restrided  # the transpose stays
    got = traced.gm(*placeholder_values(traced, model, x))
    torch.testing.assert_close(pytree.tree_leaves(got)[0], model(x).detach(), rtol=1e-5, atol=1e-5)


class SliceAssigned(torch.nn.Module):
    """Keys assembled from two parts by slice assignment, as DeepSeek-V3's attention does: one part
    shared by every head (a broadcast), one cast from float64 (a dtype change)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 6)
        self.scale = torch.nn.Parameter(torch.randn(2, 1, 6))

    def forward(self, x):  # x: (batch, tokens, 8)
        a = self.proj(x)
        keys = a.new_empty(x.shape[0], 2, x.shape[1], 6)  # (batch, heads, tokens, 6)
        keys[..., :4].copy_(a[:, None, :, :4])
        keys[..., 4:] = a[:, None, :, 4:].double() * 2
        return (keys * self.scale).square().sum()


def test_a_slice_assignment_that_carries_gradients_traces_without_functional_copies():
    """Export writes `copy(self, src)` for `keys[..., :4].copy_(a)`, which has no derivative: the tracer
    decomposes it into expand and a casting copy, and the graph's loss and gradients are eager's."""
    model, x = SliceAssigned(), torch.randn(3, 5, 8)
    traced = trace(model, x)
    assert not [n for n in traced.graph.nodes if n.target is torch.ops.aten.copy.default]
    exported = torch.export.export(model, (x,)).run_decompositions().graph_module.graph
    assert sum(n.target is torch.ops.aten.copy.default for n in exported.nodes) == 2  # what the pass replaced
    values = placeholder_values(traced, model, x)
    params = [v for v in values if isinstance(v, torch.nn.Parameter)]
    got = pytree.tree_leaves(traced.gm(*values))[0]
    got_grads = torch.autograd.grad(got, params)
    want = model(x)
    want_grads = torch.autograd.grad(want, params)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    # with the batch symbolic, the broadcast reads its size from the graph (`sym_size`): right at another batch
    dynamic, other = trace(model, x, dynamic_dims={"batch": 0}), torch.randn(4, 5, 8)
    assert any(n.target is torch.ops.aten.expand.default and isinstance(n.args[1][0], torch.fx.Node) for n in dynamic.graph.nodes)
    got = pytree.tree_leaves(dynamic.gm(*placeholder_values(dynamic, model, other)))[0]
    torch.testing.assert_close(got, model(other), rtol=1e-6, atol=1e-6)


class Bags(torch.nn.Module):
    """Embedding bags of equal length in every mode the tracer splits: a mean with padding, a weighted sum,
    a max, a sum with padding; and one fed explicit offsets, which stays fused."""

    def __init__(self):
        super().__init__()
        self.mean = torch.nn.EmbeddingBag(100, 16, mode="mean", padding_idx=0)
        self.weighted = torch.nn.EmbeddingBag(50, 16, mode="sum")
        self.max = torch.nn.EmbeddingBag(30, 16, mode="max")
        self.padded = torch.nn.EmbeddingBag(20, 16, mode="sum", padding_idx=3)
        self.ragged = torch.nn.EmbeddingBag(10, 16, mode="sum")

    def forward(self, words, items, item_weights, tags, slots, offsets):
        h = self.mean(words) * 1.5 + self.weighted(items, per_sample_weights=item_weights)
        h = h + self.max(tags).sin() + self.padded(slots)
        ragged = self.ragged(words.remainder(10)[:2].reshape(-1), offsets)  # bags of 3 and 7 entries
        return h.pow(2).sum() + ragged.sum()


def _bag_inputs(batch: int) -> tuple[torch.Tensor, ...]:
    words = torch.randint(0, 100, (batch, 5))
    words[0], words[1, :3] = 0, 0  # a bag of padding only (zeros), and one with two real entries
    tags = torch.randint(0, 30, (batch, 6))
    tags[0, :2] = 7  # one row twice in a bag: the max's gradient must reach it once
    slots = torch.randint(0, 20, (batch, 4))
    slots[2] = 3
    return words, torch.randint(0, 50, (batch, 3)), torch.rand(batch, 3), tags, slots, torch.tensor([0, 3])


def test_embedding_bags_of_equal_length_become_lookup_and_reduction():
    """The fused `_embedding_bag` has no sharding rule; bags of one length are an embedding and a reduction,
    which split by bags or by table rows. The rewritten graph's loss and gradients are eager's, also with a
    symbolic batch; bags cut by explicit offsets keep the fused op."""
    torch.manual_seed(0)
    model = Bags()
    for batch, dynamic in ((8, None), (8, {"batch": 0})):
        x = _bag_inputs(batch)
        traced = trace(model, x, dynamic_dims=dynamic)
        fused = [n for n in traced.graph.nodes if n.target is torch.ops.aten._embedding_bag.default]
        lookups = [n for n in traced.graph.nodes if n.target is torch.ops.aten.embedding.default]
        assert len(fused) == 1 and len(lookups) == 4, (fused, lookups)  # only the ragged bags stay fused
        other = _bag_inputs(6) if dynamic else x
        values = placeholder_values(traced, model, other)
        params = [v for v in values if isinstance(v, torch.nn.Parameter)]
        got = pytree.tree_leaves(traced.gm(*values))[0]
        got_grads = torch.autograd.grad(got, params)
        want = model(*other)
        want_grads = torch.autograd.grad(want, params)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


class OneHotClassifier(torch.nn.Module):
    """Label smoothing by hand: `F.one_hot` of the labels, whose export checks them (two `_assert_async`)."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x, labels):
        target = torch.nn.functional.one_hot(labels, 5).float() * 0.9 + 0.02
        return -(target * self.head(x).log_softmax(-1)).sum(-1).mean()


def test_one_hot_checks_become_rank_local_checks_that_still_raise():
    """Export checks `F.one_hot`'s labels as not(any(not(labels >= 0))): a reduction of the whole tensor.
    The tracer writes each check as `autopar::check_all(labels >= 0, message)`, which a rank can run on
    its own part; the graph computes eager's loss and still raises eager's message on a bad label."""
    model, x, labels = OneHotClassifier(), torch.randn(6, 8), torch.tensor([0, 4, 2, 1, 3, 4])
    traced = trace(model, (x, labels))
    targets = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten._assert_async.msg not in targets and torch.ops.aten.any.dims not in targets, targets
    exported = torch.export.export(model, (x, labels)).run_decompositions().graph_module.graph
    checks = sum(n.target is torch.ops.aten._assert_async.msg for n in exported.nodes)  # what the pass replaces
    # torch 2.11 and 2.12 export F.one_hot without checking the labels: nothing to rewrite, and nothing raises
    assert checks == (2 if TORCH_RELEASE >= (2, 13) else 0)
    assert targets.count(torch.ops.autopar.check_all.default) == checks
    got = pytree.tree_leaves(traced.gm(*placeholder_values(traced, model, (x, labels))))[0]
    torch.testing.assert_close(got, model(x, labels), rtol=1e-6, atol=1e-6)
    for bad, message in ((5, "smaller than num_classes"), (-1, "non-negative")) if checks else ():
        wrong = labels.clone()
        wrong[3] = bad
        with pytest.raises(RuntimeError, match=message):
            traced.gm(*placeholder_values(traced, model, (x, wrong)))


class MaskSelected(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, keep):
        return self.proj(x)[keep].square().mean()  # as many rows as `keep` has True values


class CTCLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, targets):
        return F.ctc_loss(self.proj(x).log_softmax(-1).transpose(0, 1), targets, [6] * 4, [3] * 4)


@pytest.mark.parametrize("model, sample, op, fix", [
    (MaskSelected(), (torch.randn(4, 6, 8), torch.rand(4, 6) > 0.5), "aten.index.Tensor", "torch.where(mask, x, 0)"),
    (CTCLoss(), (torch.randn(4, 6, 8), torch.randint(1, 8, (4, 3))), "aten._ctc_loss.default", "outside the model"),
], ids=["boolean-mask", "ctc"])
def test_a_size_that_depends_on_values_is_refused_with_the_line_and_a_fix(model, sample, op, fix):
    """`x[mask]` exports with an unbacked size (the solver failed on it: "Cannot convert symbols to int");
    `F.ctc_loss` does not export at all. Both name the op, the user's line and a way around."""
    with pytest.raises(TraceError) as info:
        trace(model, sample)
    message = str(info.value)
    assert "output size depends on tensor values" in message and op in message, message
    assert "test_trace.py:" in message and fix in message, message


class ReverseGradient(torch.autograd.Function):
    """A gradient reversal layer (domain-adversarial training): identity forward, gradient times -0.5."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -0.5 * grad


class RoundStraightThrough(torch.autograd.Function):
    """Rounding with the gradient passed straight through, its forward under no_grad (autograd runs a
    Function's forward with grad off and turns it back on where export does not see it)."""

    @staticmethod
    def forward(ctx, x):
        with torch.no_grad():
            return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


class FusedTanhGelu(torch.autograd.Function):
    """A hand-written GELU with its own backward that is the forward's derivative (Bloom's kind)."""

    @staticmethod
    def forward(x):
        return 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * x ** 3)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * (x + 0.044715 * x ** 3))
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.79788456 * (1 + 3 * 0.044715 * x * x))


class WithFunction(torch.nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function, self.proj, self.head = function, torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.function.apply(self.proj(x))).square().mean()


@pytest.mark.parametrize("function", [ReverseGradient, RoundStraightThrough], ids=lambda f: f.__name__)
def test_a_function_whose_backward_is_not_its_forwards_derivative_is_refused(function):
    """The traced graph differentiates a Function's forward, so a gradient reversal layer would train
    the other way: the tracer measures the difference on random inputs and refuses it, naming the line."""
    with pytest.raises(TraceError) as info:
        trace(WithFunction(function), torch.randn(4, 8))
    message = str(info.value)
    assert f"`{function.__name__}`" in message and "not the derivative of its forward" in message, message
    assert "test_trace.py:" in message and "self.function.apply" in message and ".detach()" in message, message


def test_a_function_whose_backward_is_its_forwards_derivative_traces_with_eagers_gradients():
    model, x = WithFunction(FusedTanhGelu), torch.randn(4, 8)
    assert_eager_gradients(trace(model, x), model, x, rtol=1e-5)


class GradientHooked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        z = self.proj(x)
        z.register_hook(lambda grad: grad * 0.1)  # lost in the graph: the proj layer would learn 10x faster
        return self.head(z).square().mean()


class RenormedEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(10, 8, max_norm=1.0), torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.embed(ids)).square().mean()  # max_norm renormalises the rows looked up, in place


class ClampedByData(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 1)

    def forward(self, x):
        self.proj.weight.data = self.proj.weight.data.clamp(-0.1, 0.1)  # WGAN's clipping, in the forward
        return self.proj(x).square().mean()


class HalvedByData(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 1)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        self.scale.data = self.scale.data.half()  # another dtype: no op export could record
        return self.proj(x * self.scale.float()).square().mean()


@pytest.mark.parametrize("model, sample, what, fix", [
    (GradientHooked(), torch.randn(4, 8), "a gradient hook is registered in the forward", "k * z + (1 - k) * z.detach()"),
    (RenormedEmbedding(), torch.randint(0, 10, (4, 3)), "changes parameter `embed.weight` in place", "max_norm"),
    (ClampedByData(), torch.randn(4, 8), "`.data = ...` at", "after optimizer.step()"),
    (HalvedByData(), torch.randn(4, 8), "makes a (8,) torch.float32 tensor (8,) torch.float16", "outside the forward"),
], ids=["tensor-hook", "max-norm", "data-write", "data-dtype"])
def test_backward_behaviour_the_graph_cannot_hold_is_refused_with_the_line(model, sample, what, fix):
    """A hook on an activation is not an op, and a parameter changed in the forward would be changed on a
    copy: dropped silently, each would train wrong (a 10x gradient error; an embedding with no gradient; a
    weight never clipped)."""
    with pytest.raises(TraceError) as info:
        trace(model, sample)
    message = str(info.value)
    assert what in message and "test_trace.py:" in message and fix in message, message


class Checkpointed(torch.nn.Module):
    """Activation checkpointing both ways torch offers, on activations that need a gradient."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out, self.head = (torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.out(t)), h, use_reentrant=False)
        return self.head(h).square().mean()


def test_activation_checkpointing_is_traced_inline_with_eagers_gradients():
    """Reentrant checkpointing is an autograd.Function whose forward runs under no_grad: export then took
    everything after it for a no_grad block (the later layers got no gradient). It is traced inline, as
    the non-reentrant kind is, and autopar's plan picks its own recompute."""
    model, x = Checkpointed(), torch.randn(4, 8)
    traced = trace(model, x)
    assert not [n for n in traced.graph.nodes if n.target is torch.ops.aten.detach.default]
    values = placeholder_values(traced, model, x)
    params = [v for v in values if isinstance(v, torch.nn.Parameter)]
    got = torch.autograd.grad(pytree.tree_leaves(traced.gm(*values))[0], params)
    model(x).backward()  # reentrant checkpointing supports backward() only, not autograd.grad
    for g, p in zip(got, params, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-6)


class InferenceModeBlocks(torch.nn.Module):
    """A frozen teacher's targets under `torch.inference_mode()` (a block and a decorated method), used through
    `.clone()` as eager requires, and one layer that trains again inside `inference_mode(False)`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.student, self.teacher, self.head = (torch.nn.Linear(8, 8) for _ in range(3))

    @torch.inference_mode()
    def _targets(self, x):
        return torch.tanh(self.teacher(x))

    def forward(self, x):
        with torch.inference_mode():
            soft = torch.softmax(self.student(x), -1)
            with torch.inference_mode(False):
                trained = self.head(x)
        out = self.student(x)
        return (out - self._targets(x).clone()).square().mean() + (out * soft.clone()).sum() + trained.mean()


def test_inference_mode_blocks_stop_gradients_as_in_eager():
    """Export does not record inference mode: the blocks' ops were ordinary ops, and the student learnt
    through its own soft targets and the teacher learnt at all."""
    model, x = InferenceModeBlocks(), torch.randn(4, 8)
    traced = trace(model, x)
    assert torch.inference_mode.__enter__ is torch.autograd.grad_mode.inference_mode.__dict__["__enter__"]
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    values = placeholder_values(traced, model, x)
    params = [v for v in values if isinstance(v, torch.nn.Parameter)]
    got = torch.autograd.grad(pytree.tree_leaves(traced.gm(*values))[0], params, allow_unused=True)
    model(x).backward()
    for g, p in zip(got, params, strict=True):
        if p.grad is None:  # the teacher's: eager gives it none
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-6)
    assert model.teacher.weight.grad is None and model.head.weight.grad is not None


class OlderGradientStops(torch.nn.Module):
    """`.data` read in the forward (a weight used without its gradient) and `t.detach_()`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        frozen_view = x @ self.a.weight.data.t()
        target = h * 2
        target.detach_()
        return (self.b(h) * target).sum() + (h * frozen_view).mean()


def test_data_reads_and_in_place_detach_stop_gradients_as_in_eager():
    """`.data` failed the trace at no line (a tensor export did not create); `detach_` was dropped by the
    decompositions, and the graph differentiated through it (gradients off by up to 3.4)."""
    model, x = OlderGradientStops(), torch.randn(4, 8)
    traced = trace(model, x)
    assert "data" not in torch.Tensor.__dict__  # the read is patched only while export runs
    assert_eager_gradients(traced, model, x)


class GradientPenalty(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = torch.nn.Linear(8, 1)

    def forward(self, x):
        x = x.requires_grad_()
        score = self.critic(x).sum()
        (slope,) = torch.autograd.grad(score, x, create_graph=True)
        return score + (slope.norm(dim=-1) - 1).square().mean()


def test_a_gradient_taken_in_the_forward_is_refused_naming_the_line():
    """export cannot capture `torch.autograd.grad`; it failed with "a fake tensor in the exported program
    constant's list" at no line."""
    with pytest.raises(TraceError, match=r"(?s)torch.autograd.grad is called in the forward at .*test_trace.py:\d+ "
                                         r"\(`\(slope,\) = torch.autograd.grad.*DDP or FSDP"):
        trace(GradientPenalty(), torch.randn(4, 8))
    assert torch.autograd.grad.__module__ == "torch.autograd"


def test_a_lazy_module_not_run_yet_is_named_with_the_fix():
    """nn.LazyLinear makes its parameters in its first forward; before it, parallelize failed in torch with
    "Can't access the shape of an uninitialized parameter", naming neither."""
    from autopar.api import capture_copy

    model, x = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.Linear(4, 1)), torch.randn(3, 8)
    with pytest.raises(TraceError, match=r"0\.weight, 0\.bias do not exist yet.*(?s:.*)model\(\*batch\)"):
        capture_copy(model, x)
    model(x)
    traced = trace(*capture_copy(model, x))
    assert sorted(traced.param_fqns.values()) == ["0.bias", "0.weight", "2.bias", "2.weight"]


class Seq2Seq(torch.nn.Module):
    def __init__(self, say_causal: bool):
        super().__init__()
        self.say_causal, self.emb = say_causal, torch.nn.Embedding(16, 16)
        self.transformer = torch.nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)

    def forward(self, src, tgt):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        causal = {"tgt_is_causal": True} if self.say_causal else {}
        return self.transformer(self.emb(src), self.emb(tgt), tgt_mask=mask, **causal).square().mean()


def test_a_transformer_mask_torch_would_test_for_causality_names_the_flag():
    """nn.Transformer compares a mask it is not told about with a causal one, a test on values export cannot
    make: the error said "data-dependent control flow" and to use torch.where, at the user's call."""
    src, tgt = torch.randint(0, 16, (2, 6)), torch.randint(0, 16, (2, 5))
    with pytest.raises(TraceError, match=r"testing whether an attention mask is causal(?s:.*)tgt_is_causal=True"):
        trace(Seq2Seq(say_causal=False), (src, tgt))
    model = Seq2Seq(say_causal=True)
    assert_eager_gradients(trace(model, (src, tgt)), model, (src, tgt), rtol=1e-5, atol=1e-6)


class VAE(torch.nn.Module):
    """A reparameterised sample and a KL term through torch.distributions, whose argument checks are on."""

    def __init__(self):
        super().__init__()
        self.enc, self.mu, self.log_var, self.dec = (torch.nn.Linear(*d) for d in ((8, 16), (16, 4), (16, 4), (4, 8)))

    def forward(self, x):
        h = torch.relu(self.enc(x))
        posterior = torch.distributions.Normal(self.mu(h), (0.5 * self.log_var(h)).exp())
        z = posterior.rsample()
        kl = torch.distributions.kl_divergence(posterior, torch.distributions.Normal(0.0, 1.0)).sum(1).mean()
        return F.mse_loss(self.dec(z), x) + kl


def test_distributions_trace_with_their_argument_checks_on():
    """`Normal(mu, sigma)` checks sigma > 0 with a Python `if` on its values: the trace stopped there
    ("data-dependent control flow"). Traced with the checks off, the graph draws the same sample as eager
    from the same seed: the same loss and gradients. The checks are on again after the trace."""
    model, x = VAE(), torch.randn(4, 8)
    assert torch.distributions.Distribution._validate_args
    traced = trace(model, x)
    assert torch.distributions.Distribution._validate_args
    values = placeholder_values(traced, model, x)
    params = [v for v in values if isinstance(v, torch.nn.Parameter)]
    torch.manual_seed(3)
    got_loss = pytree.tree_leaves(traced.gm(*values))[0]
    got = torch.autograd.grad(got_loss, params)
    torch.manual_seed(3)
    want_loss = model(x)
    want = torch.autograd.grad(want_loss, params)
    torch.testing.assert_close(got_loss, want_loss)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


class WeightNormed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.utils.weight_norm(torch.nn.Linear(8, 8))  # deprecated, as older vocoders use it
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x))).square().mean()


@pytest.mark.filterwarnings("ignore:.*weight_norm.* is deprecated:FutureWarning")
def test_old_weight_norm_traces_from_a_copy():
    """`torch.nn.utils.weight_norm` keeps `g * v / |v|` as a tensor attribute with a gradient history, which
    `parallelize`'s copy for the trace could not deep-copy (torch's RuntimeError). Its pre-hook recomputes
    it in the copy, so the graph has eager's gradients for g and v."""
    from autopar.api import capture_copy

    model, x = WeightNormed(), torch.randn(4, 8)
    traced = trace(*capture_copy(model, x, "cpu"))
    assert {"proj.weight_g", "proj.weight_v"} <= set(traced.param_fqns.values())
    assert_eager_gradients(traced, model, x)


class PythonFlip(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 1)

    def forward(self, x):
        if random.random() < 0.5:  # an augmentation drawn in Python: the line the warning must name
            x = x.flip(-1)
        noise = numpy.random.uniform(0, 0.1)
        return (self.proj(x) + noise).square().mean()


def test_python_random_draws_in_the_forward_are_named():
    """`random` and `numpy.random` run once, while tracing: the graph keeps that draw for every step. Each
    line is named once; torch's random ops are not reported, and `random.random` is Python's own again
    after the trace."""
    records = LogRecords("autopar.tracer.python_random")
    draw = random.random
    trace(PythonFlip(), torch.randn(4, 8))
    trace(torch.nn.Dropout(0.5), torch.randn(4, 8))
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "the line the warning must name" in text)
    assert len(records.messages) == 2 and random.random is draw
    assert f"random.random() at {__file__}:{line}" in records.messages[0] and "torch.rand" in records.messages[0]
    assert "numpy.random.uniform()" in records.messages[1]


class PackedGRU(torch.nn.Module):
    def __init__(self, packed: bool):
        super().__init__()
        self.packed, self.gru, self.head = packed, torch.nn.GRU(8, 8, batch_first=True), torch.nn.Linear(8, 2)

    def forward(self, x, lengths):
        if self.packed:
            seq = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            _, h = self.gru(seq)  # the line the packed error must name
            return self.head(h[-1]).square().mean()
        out, _ = self.gru(x)
        return self.head(out[torch.arange(x.shape[0]), lengths - 1]).square().mean()


def test_a_packed_sequence_is_refused_with_the_padded_form_that_traces():
    """A GRU on a packed sequence stopped with "a construct torch.export cannot capture" and torch's
    message about a FakeTensor size. The error now names the packed sequence and the padded form, which
    gives the packed loss on one device and traces with its gradients."""
    x, lengths = torch.randn(4, 6, 8), torch.tensor([6, 3, 5, 2])
    with pytest.raises(TraceError) as info:
        trace(PackedGRU(packed=True), (x, lengths))
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "the line the packed error must name" in text)
    assert f"test_trace.py:{line}" in str(info.value) and "out[torch.arange(batch), lengths - 1]" in str(info.value)
    packed, padded = PackedGRU(packed=True), PackedGRU(packed=False)
    padded.load_state_dict(packed.state_dict())
    torch.testing.assert_close(padded(x, lengths), packed(x, lengths))
    assert_eager_gradients(trace(padded, (x, lengths)), padded, (x, lengths))


def test_an_rnn_traces_without_warnings():
    """export warned on every trace of nn.GRU / nn.LSTM that "the tensor attributes self.gru._flat_weights[0], ...
    were assigned during export" and must be buffers: torch's own modules, nothing the user can change."""
    x, lengths = torch.randn(4, 6, 8), torch.tensor([6, 3, 5, 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace(PackedGRU(packed=False), (x, lengths))
    assert [str(w.message)[:80] for w in caught] == []
