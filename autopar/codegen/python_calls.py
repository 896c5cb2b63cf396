"""The generated forward's ATen calls written as tensor methods and torch functions.

The lowered graph calls ops the way the trace names them, `torch.ops.aten.permute.default(w, [1, 0])`:
a Python `OpOverload.__call__` frame, then the JIT path that parses arguments against the schema.
Eager PyTorch calls the same kernel as `w.permute([1, 0])` through the generated C++ argument
parser. Measured on this machine (one thread, gpt2-tiny activations): a permute 2.44 us against
1.02 us, a reshape 2.77 against 0.94, an add 4.16 against 2.99; gpt2-tiny's forward on one rank
went from 2.98 to 2.67 ms (eager: 2.39 ms). So each call is rewritten, after every other codegen
pass has read the ATen targets, as `x.name(...)` (`call_method`) or `torch.name(...)` /
`torch._C._nn.name(...)` (`call_function`), when that binding provably runs the same op:

- the binding must be C++ (a builtin): `torch.split` or `Tensor.split` are Python wrappers with
  other signatures;
- run on the traced node's own fake arguments, the binding must dispatch exactly the ops the
  overload dispatches (recorded with a dispatch mode). With several overloads (`add.Tensor` /
  `add.Scalar`, `sum.default` / `sum.dim_IntList`) the binding picks one by argument types: this is
  what tells them apart;
- where that cannot be run (no traced counterpart with the same argument structure, as for the
  `contiguous` codegen writes for a no-op dropout; symbolic shapes), only an op name with a single
  overload (out= variants aside) is bound: the binding can dispatch nowhere else.

Ops that write their inputs keep their ATen spelling, and so does a multi-overload call the check
cannot run on.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Mapping

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_CPP = (types.BuiltinFunctionType, types.MethodDescriptorType)
_FUNCTION_NAMESPACES = (torch, torch._C._nn)

Binding = tuple[str, Any]  # (fx node op, target): ("call_method", "permute") or ("call_function", torch.embedding)


def bind_python_calls(gm: fx.GraphModule, traced: Mapping[str, fx.Node], origin: Mapping[str, str]) -> int:
    """Rewrite every provably equivalent ATen call in `gm` and its sub-GraphModules; returns how many.

    traced: traced node name -> node (its `meta["val"]` are the fake arguments of the check);
    origin: lowered node name -> the traced node it implements."""
    count = 0
    checked: dict[tuple, bool] = {}  # what `_same_dispatch` found, by everything the binding's overload choice reads
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        before = count
        for node in module.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            binding = _binding(node, traced.get(origin.get(node.name, "")), checked)
            if binding is not None:
                node.op, node.target = binding
                count += 1
        if count > before:
            module.recompile()
    return count


def _binding(node: fx.Node, traced: fx.Node | None, checked: dict[tuple, bool]) -> Binding | None:
    op: torch._ops.OpOverload = node.target
    if op._schema.is_mutable:
        return None
    for binding in _candidates(node, op):
        same = _same_dispatch(op, binding, node, traced, checked)
        if same or (same is None and _single_overload(op)):
            return binding
    return None


def _candidates(node: fx.Node, op: torch._ops.OpOverload) -> list[Binding]:
    name = op._schema.name.split("::")[1]
    found: list[Binding] = []
    first = op._schema.arguments[0] if op._schema.arguments else None
    # a method only where the op's first argument is the tensor it would be called on (not `pow.Scalar`'s number)
    if first is not None and first.name == "self" and isinstance(first.type, torch.TensorType) \
            and node.args and isinstance(node.args[0], fx.Node) and isinstance(getattr(torch.Tensor, name, None), _CPP):
        found.append(("call_method", name))
    for namespace in _FUNCTION_NAMESPACES:
        fn = getattr(namespace, name, None)
        if isinstance(fn, _CPP):
            found.append(("call_function", fn))
    return found


def _single_overload(op: torch._ops.OpOverload) -> bool:
    packet = op._overloadpacket
    kept = [o for o in packet.overloads() if not any(a.is_out for a in getattr(packet, o)._schema.arguments)]
    return kept == [op._overloadname]


def _same_dispatch(op: torch._ops.OpOverload, binding: Binding, node: fx.Node, traced: fx.Node | None,
                   checked: dict[tuple, bool]) -> bool | None:
    """Whether `binding`, called as the node calls `op`, dispatches what `op` does, on the traced node's fake
    arguments (whose structure must be the lowered node's: same leaves, tensors where it has nodes); None when
    that cannot be run (no such traced node, symbolic shapes, no tensor argument).

    The answer is reused for calls alike in what a binding's overload choice reads: the argument structure,
    each leaf's type, and for tensors dtype, device, whether 0-d (a 0-d tensor may pass as a number) and
    whether it requires grad (then it may not): gpt2-xl's 1,899 calls took 0.4 s checked one by one."""
    if traced is None:
        return None
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    traced_flat, traced_spec = pytree.tree_flatten((traced.args, traced.kwargs))
    if spec != traced_spec:
        return None
    fake: list[Any] = []
    for leaf, traced_leaf in zip(flat, traced_flat):
        if isinstance(leaf, fx.Node) != isinstance(traced_leaf, fx.Node):
            return None
        if isinstance(leaf, fx.Node):
            val = traced_leaf.meta.get("val")
            if not isinstance(val, FakeTensor) or not all(isinstance(s, int) for s in val.shape):
                return None
            fake.append(val)
        elif type(leaf) is not type(traced_leaf) or isinstance(leaf, torch.SymInt):
            return None
        else:
            fake.append(traced_leaf)
    tensors = [v for v in fake if isinstance(v, FakeTensor)]
    if not tensors:
        return None
    key = (op, binding, spec, tuple(_kind(v) for v in fake))
    if key not in checked:
        args, kwargs = pytree.tree_unflatten(fake, spec)
        with tensors[0].fake_mode:
            expected = _dispatched(op, args, kwargs)
            got = _dispatched(_as_callable(binding), args, kwargs)
        checked[key] = expected is not None and expected == got
    return checked[key]


def _kind(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return torch.Tensor, value.dtype, value.device.type, value.dim() == 0, value.requires_grad
    return (type(value),)


def _as_callable(binding: Binding) -> Callable:
    kind, target = binding
    if kind == "call_method":
        return lambda self, *args, **kwargs: getattr(self, target)(*args, **kwargs)
    return target


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[torch._ops.OpOverload] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _dispatched(fn: Callable, args: tuple, kwargs: dict) -> list | None:
    """The ops `fn(*args, **kwargs)` dispatches (None when the call fails: a binding that does not take
    these arguments)."""
    try:
        with _Record() as record:
            fn(*args, **kwargs)
    except (TypeError, RuntimeError):
        return None
    return record.ops
