"""What one op costs and keeps for backward, found by running its real autograd on fake tensors.

For a node we build fresh fake CPU tensors with the node's (possibly symbolic)
input shapes, run the aten op forward with `requires_grad` on the inputs that
need a gradient, under `torch.autograd.graph.saved_tensors_hooks`, then run its
backward with `torch.autograd.grad`. The pack hook sees exactly the tensors the
op's autograd node keeps; we match them to the op's inputs and outputs by
storage (`StorageWeakRef`, which identifies fake storages too), so a view of an
input saved twice is one input. FLOPs of both passes come from torch's formula
registry (`flops.CountFlops`). Fake tensors are on the `cpu` device so that
`scaled_dot_product_attention` takes the CPU flash path (which, like the CUDA
flash kernel, saves q, k, v, out and the logsumexp, not the attention matrix).

Results depend only on the op, its arguments' shapes/dtypes and which inputs
need grad, so they are cached under that key: a model's repeated layers are
probed once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Hashable, Mapping

import sympy
import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.profiler.flops import op_flops, register_flop_formulas
from autopar.tracer.nodes import differentiable


@dataclass(frozen=True)
class OpProbe:
    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    saved_args: tuple[int, ...]  # indices into tensor_args(node) that the op's backward keeps
    saved_own: tuple[int, ...]  # indices of the op's own outputs that its backward keeps
    extra_saved_bytes: sympy.Expr  # kept tensors that are neither inputs nor outputs (e.g. SDPA logsumexp)
    temp_bytes: sympy.Expr  # most scratch alive at once inside the op's forward or backward (created and dropped there)
    out_strides: tuple[tuple[sympy.Expr, ...], ...] = ()  # strides the real CPU kernel gives each output
    # per index into tensor_args(node): bytes of the gradient the op's backward makes for that input, alive
    # when its backward ends (0 where it hands on the output's gradient itself or a view of it: add, views)
    grad_input_bytes: tuple[sympy.Expr, ...] = ()


def to_expr(x: Any) -> sympy.Expr:
    """A SymInt/int/float as a sympy expression."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        return x.node.expr
    return sympy.sympify(x)


_CACHE: dict[Hashable, OpProbe] = {}


def _leaf_key(leaf: Any, rg: Mapping[str, bool]) -> Hashable:
    if isinstance(leaf, fx.Node):
        val = leaf.meta.get("val")
        if isinstance(val, torch.Tensor):
            return (
                tuple(to_expr(s) for s in val.shape),
                tuple(to_expr(s) for s in val.stride()),
                val.dtype,
                rg.get(leaf.name, False),
            )
        return ("sym", to_expr(val))
    if isinstance(leaf, (torch.SymInt, torch.SymFloat)):
        return ("sym", to_expr(leaf))
    try:
        hash(leaf)
        return leaf
    except TypeError:
        return repr(leaf)


def probe(node: fx.Node, rg: Mapping[str, bool], used_outputs: tuple[bool, ...]) -> OpProbe:
    """Cost and saved tensors of `node` (a call_function on tensors), cached by signature."""
    target = node.target
    flat, spec = pytree.tree_flatten((tuple(node.args), dict(node.kwargs)))
    key = (target, tuple(_leaf_key(leaf, rg) for leaf in flat), used_outputs)
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE[key] = _run(target, flat, spec, rg, used_outputs)
    return hit


class _Watch(TorchDispatchMode):
    """Counts FLOPs, records every new storage an op call creates and which of them are alive after each call."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: Any = 0
        self.created: dict[StorageWeakRef, Any] = {}
        self._alive: set[StorageWeakRef] = set()
        self.snapshots: list[frozenset[StorageWeakRef]] = []  # storages alive after each call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops = self.flops + op_flops(func, args, kwargs, out)
        if getattr(func, "is_view", False):
            return out  # aliases an existing storage (fake views may not report the shared storage)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                self.created.setdefault(ref, t.untyped_storage().nbytes())
                self._alive.add(ref)
        # A fake storage dies with its last tensor, as a real one would: what is dead now was scratch.
        self._alive = {ref for ref in self._alive if not ref.expired()}
        self.snapshots.append(frozenset(self._alive))
        return out

    def peak_scratch(self, exclude: Collection[StorageWeakRef]) -> Any:
        """Most bytes alive at once among created storages not in `exclude` (outputs, kept tensors)."""
        totals = {to_expr(sum(self.created[r] for r in snap if r not in exclude)) for snap in self.snapshots}
        totals.discard(sympy.Integer(0))
        return sympy.Max(*totals) if totals else sympy.Integer(0)


def _fake_mode(flat: list) -> Any:
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    vals = [leaf.meta.get("val") for leaf in flat if isinstance(leaf, fx.Node)]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]) or FakeTensorMode()


def _run(target: Any, flat: list, spec, rg: Mapping[str, bool], used_outputs: tuple[bool, ...]) -> OpProbe:
    register_flop_formulas()
    fake_mode = _fake_mode(flat)
    with fake_mode:
        made: dict[fx.Node, torch.Tensor] = {}  # one fake tensor per distinct input node
        arg_tensors: list[torch.Tensor] = []  # in tensor_args(node) order

        def fake(leaf: Any) -> Any:
            if not isinstance(leaf, fx.Node):
                return leaf
            val = leaf.meta.get("val")
            if not isinstance(val, torch.Tensor):
                return val  # a SymInt from a sym_size node
            if leaf not in made:
                t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="cpu")
                made[leaf] = t.requires_grad_(rg.get(leaf.name, False))
            arg_tensors.append(made[leaf])
            return made[leaf]

        args, kwargs = pytree.tree_unflatten([fake(leaf) for leaf in flat], spec)
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        fwd = _Watch()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fwd:
            out = target(*args, **kwargs)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]

        def sid(t: torch.Tensor) -> StorageWeakRef:
            return StorageWeakRef(t.untyped_storage())

        arg_ids = [sid(t) for t in arg_tensors]
        out_ids = [sid(t) for t in outs]
        saved_args: set[int] = set()
        saved_own: set[int] = set()
        extra: dict[StorageWeakRef, Any] = {}
        for t in saved:
            s = sid(t)
            if s in out_ids:
                saved_own.add(out_ids.index(s))
            elif s in arg_ids:
                saved_args.add(arg_ids.index(s))
            else:
                extra[s] = t.untyped_storage().nbytes()

        fwd_temp = fwd.peak_scratch({*out_ids, *extra})
        bwd_flops, bwd_temp, grads = _backward(outs, used_outputs, list(made.values()))
        made_grad = {id(t): g for t, g in zip(made.values(), grads)}  # input tensor -> the new gradient storage's bytes
        grad_input_bytes = []
        for t in arg_tensors:  # an input passed twice (mul(x, x)) gets its one gradient at its first place
            grad_input_bytes.append(to_expr(made_grad.pop(id(t), 0)))
    return OpProbe(
        fwd_flops=to_expr(fwd.flops),
        bwd_flops=to_expr(bwd_flops),
        saved_args=tuple(sorted(saved_args)),
        saved_own=tuple(sorted(saved_own)),
        extra_saved_bytes=to_expr(sum(extra.values())),
        temp_bytes=to_expr(sympy.Max(to_expr(fwd_temp), to_expr(bwd_temp))),
        out_strides=tuple(tuple(to_expr(s) for s in o.stride()) for o in outs),
        grad_input_bytes=tuple(grad_input_bytes),
    )


def _backward(outs: list[torch.Tensor], used_outputs: tuple[bool, ...], inputs: list[torch.Tensor]) -> tuple[Any, Any, list]:
    """FLOPs and scratch bytes of the op's backward, for gradients of the outputs the graph uses, and per input
    the bytes of the gradient storage it makes for that input (0 where none, or the output's gradient passed on)."""
    grad_of = [
        o for i, o in enumerate(outs)
        if o.requires_grad and differentiable(o) and (i >= len(used_outputs) or used_outputs[i])
    ]
    wanted = [t for t in inputs if t.requires_grad]
    if not grad_of or not wanted:
        return 0, 0, [0] * len(inputs)
    grad_outputs = [torch.empty_like(o) for o in grad_of]
    bwd = _Watch()
    with bwd:
        grads = torch.autograd.grad(grad_of, wanted, grad_outputs, allow_unused=True)
    kept = {StorageWeakRef(g.untyped_storage()) for g in grads if g is not None}
    passed_on = {StorageWeakRef(g.untyped_storage()) for g in grad_outputs}
    by_input = dict(zip(map(id, wanted), grads))
    new: list = []
    counted: set[StorageWeakRef] = set()  # two inputs given one storage (views of one gradient) count it once
    for t in inputs:
        g = by_input.get(id(t))
        ref = None if g is None else StorageWeakRef(g.untyped_storage())
        if ref is None or ref in passed_on or ref in counted:
            new.append(0)
        else:
            counted.add(ref)
            new.append(g.untyped_storage().nbytes())
    return bwd.flops, bwd.peak_scratch(kept), new
