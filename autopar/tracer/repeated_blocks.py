"""Trace a deep stack of identical blocks by tracing two of them and copying the second.

Capture costs about the same per node, so a 96-layer transformer takes 96 times one layer's capture and
decompositions. When a model holds an `nn.ModuleList` of at least `MIN_BLOCKS` blocks of one structure,
the tracer captures it with blocks 0 and 1 real and every later block a stand-in that hands its input
back, then writes block 1's nodes once per later block, with that block's parameters and names.

This is used only where the capture shows it is exact, else the model is traced whole:
- the blocks match module by module: classes, training flags, parameter and buffer names, shapes, dtypes
  and `requires_grad`, no hooks, no parameter shared with anything else; attributes that differ between
  blocks (a layer index) are not read while blocks 0 and 1 run;
- the parent calls every block (stand-ins included) with equal non-tensor arguments, the same tensors but
  for the one it carries, and each block's carried tensor is what the block before returned (no work
  between blocks); a block returns a tensor like the one it carries;
- blocks 0 and 1 captured to the same nodes (targets, constants, shapes and dtypes, node by node), each
  reading its own parameters, the same shared nodes, and block 1 reading block 0 only where block 0 read
  the stack's input; nothing after the stack reads a block but through what the next block would.
"""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
from torch.utils import _pytree as pytree

from autopar.tracer.block_storages import block_storages
from autopar.tracer.exported import Exported

log = logging.getLogger(__name__)

MIN_BLOCKS = 8  # shallower stacks trace whole in little time


class _NotRepeated(Exception):
    """The stack's blocks do not run alike: the model is traced whole."""


def find_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest `nn.ModuleList` of at least `MIN_BLOCKS` blocks of one structure, by its FQN."""
    best = None
    for name, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and name and len(module) >= MIN_BLOCKS
                and (best is None or len(module) > len(best[1])) and _alike(model, module)):
            best = (name, module)
    return best


def _alike(model: nn.Module, blocks: nn.ModuleList) -> bool:
    owners = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    if any(len(owners[id(p)]) > 1 for p in blocks.parameters()):  # tied within the stack or to the model
        return False
    first = _structure(blocks[0])
    return all(_structure(b) == first for b in blocks)


def _structure(block: nn.Module) -> tuple:
    hooked = any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                 for m in block.modules())
    return (hooked,
            tuple((n, type(m), m.training) for n, m in block.named_modules()),
            tuple((n, p.shape, p.dtype, p.requires_grad) for n, p in block.named_parameters()),
            tuple((n, b.shape, b.dtype) for n, b in block.named_buffers()))


def _differing_attributes(blocks: nn.ModuleList) -> set[tuple[str, str]]:
    """(submodule path within a block, attribute name) of the plain attributes not equal in every block."""
    differ = set()
    for path, first in blocks[0].named_modules():
        for block in blocks:
            other = block.get_submodule(path)
            for attr, value in vars(first).items():
                if attr in ("_parameters", "_buffers", "_modules") or attr not in vars(other):
                    continue
                if not _equal(value, vars(other)[attr]):
                    differ.add((path, attr))
    return differ


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a comparison that is not a plain bool (tensors): count as different
        return False


@contextlib.contextmanager
def _reads_recorded(block: nn.Module, attributes: set[tuple[str, str]], reads: set) -> Iterator[None]:
    """Record into `reads` each of `attributes` read on `block` (its submodules' classes swapped for
    look-alikes with a property per attribute, restored after)."""
    swapped = []
    by_path: dict[str, list[str]] = {}
    for path, attr in attributes:
        by_path.setdefault(path, []).append(attr)
    try:
        for path, attrs in by_path.items():
            module = block.get_submodule(path)
            cls = type(module)
            props = {a: property(lambda self, a=a, p=path: (reads.add((p, a)), self.__dict__[a])[1],
                                 lambda self, v, a=a: self.__dict__.__setitem__(a, v)) for a in attrs}
            names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}  # nn_module_stack names the class
            module.__class__ = type(cls.__name__, (cls,), {**props, **names})
            swapped.append((module, cls))
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


class _Calls:
    """Each block's call as the parent made it: the flattened arguments and what the block returned."""

    def __init__(self) -> None:
        self.args: list[tuple[list, pytree.TreeSpec]] = []
        self.returned: list[Any] = []

    def called(self, args: tuple, kwargs: dict) -> None:
        self.args.append(pytree.tree_flatten((args, kwargs)))

    def check(self, n_blocks: int) -> None:
        """Raise `_NotRepeated` unless every call carries the last one's result and agrees otherwise."""
        if len(self.args) != n_blocks or len(self.returned) < 2:
            raise _NotRepeated(f"{len(self.args)} block calls for {n_blocks} blocks")
        leaves1, spec1 = self.args[1]
        carried = [i for i, x in enumerate(leaves1) if x is self.returned[0]]
        if len(carried) != 1 or not isinstance(self.returned[1], torch.Tensor):
            raise _NotRepeated("no single tensor carried from block to block")
        slot = carried[0]
        if _tensor_meta(self.returned[1]) != _tensor_meta(leaves1[slot]):
            raise _NotRepeated("a block returns a tensor unlike the one it carries")
        for j, (leaves, spec) in enumerate(self.args):
            if spec != spec1 or (j >= 1 and leaves[slot] is not self.returned[j - 1]):
                raise _NotRepeated(f"block {j} is called unlike block 1")
            for i, (x, y) in enumerate(zip(leaves, leaves1)):
                # the stack's input may not need a gradient; blocks 0 and 1 are compared node by node below
                same = (_tensor_meta(x)[:3] == _tensor_meta(y)[:3] if i == slot and j == 0 else
                        _tensor_meta(x) == _tensor_meta(y) if i == slot else
                        x is y if isinstance(y, torch.Tensor) else _equal(x, y))
                if not same:
                    raise _NotRepeated(f"block {j} gets argument {i} unlike block 1")


def _tensor_meta(t: Any) -> tuple | None:
    if not isinstance(t, torch.Tensor):
        return None
    return tuple(map(str, t.shape)), t.dtype, tuple(map(str, t.stride())), t.requires_grad


class _StandIn(nn.Module):
    """A later block while the stack is captured: records its call and hands the carried tensor back."""

    def __init__(self, calls: _Calls) -> None:
        super().__init__()
        self._calls = calls

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._calls.called(args, kwargs)
        leaves, _ = pytree.tree_flatten((args, kwargs))
        previous = self._calls.returned[-1]
        if not any(x is previous for x in leaves):
            raise _NotRepeated("a block does not get what the block before returned")
        self._calls.returned.append(previous)
        return previous


def export_stamped(model: nn.Module, stack: tuple[str, nn.ModuleList],
                   export: Callable[[], torch.export.ExportedProgram]) -> Exported | None:
    """`export()` run with the stack cut to two blocks and stand-ins, its graph grown to every block;
    None where that would not be exactly the whole model's graph (the caller traces it whole)."""
    name, blocks = stack
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    calls, reads = _Calls(), set()
    differ = _differing_attributes(blocks)
    stand_ins = nn.ModuleList([blocks[0], blocks[1], *(_StandIn(calls) for _ in range(len(blocks) - 2))])
    hooks = [b.register_forward_pre_hook(lambda m, a, k: calls.called(a, k), with_kwargs=True) for b in blocks[:2]]
    hooks += [b.register_forward_hook(lambda m, a, out: calls.returned.append(out)) for b in blocks[:2]]
    try:
        parent._modules[attr] = stand_ins
        with _reads_recorded(blocks[0], differ, reads), _reads_recorded(blocks[1], differ, reads):
            ep = export()
        calls.check(len(blocks))
        if reads:
            raise _NotRepeated(f"the blocks read attributes that differ between them: {sorted(reads)}")
        return stamp(Exported.of(ep), name, len(blocks))
    except Exception as err:  # anything the cut model does not do as the whole one: trace it whole
        log.info("tracer: %s traced whole (%s)", name, str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
        return None
    finally:
        parent._modules[attr] = blocks
        for hook in hooks:
            hook.remove()


# ---------------------------------------------------------------- the graph


_SUFFIX = re.compile(r"^(.*)_(\d+)$")


def _split_name(name: str) -> tuple[str, int]:
    match = _SUFFIX.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _join_name(base: str, number: int) -> str:
    return f"{base}_{number}" if number else base


def _block_of(node: fx.Node, pattern: re.Pattern) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = pattern.match(path)
        if match:
            return int(match.group(1))
    return None


def stamp(exported: Exported, stack: str, n_blocks: int) -> Exported:
    """The graph of `exported` (blocks 0 and 1 of `stack` captured) with block 1's nodes written again for
    blocks 2 .. n_blocks-1. Raises `_NotRepeated` where blocks 0 and 1 did not capture alike."""
    pattern = re.compile(rf"^{re.escape(stack)}\.(\d+)(?:\.|$)")
    graph = exported.gm.graph
    nodes = list(graph.nodes)
    param_of: dict[str, tuple[int, str]] = {}  # block placeholder -> (block, FQN within the block)
    for s in exported.input_specs:
        match = pattern.match(s.target or "") if s.kind in (InputKind.PARAMETER, InputKind.BUFFER) else None
        if match:
            param_of[s.arg.name] = (int(match.group(1)), s.target[match.end(1) + 1:])
    where = {n: _block_of(n, pattern) for n in nodes if n.op == "call_function"}
    segs = [[n for n in nodes if where.get(n) == i] for i in (0, 1)]
    if not segs[0] or len(segs[0]) != len(segs[1]) or any(b not in (0, 1, None) for b in where.values()):
        raise _NotRepeated("blocks 0 and 1 captured to different node counts")
    first = nodes.index(segs[0][0])
    if nodes[first:first + 2 * len(segs[0])] != segs[0] + segs[1]:
        raise _NotRepeated("the blocks' nodes are not one run each")
    local = [{n: q for q, n in enumerate(seg)} for seg in segs]
    carry: dict[int, fx.Node] = {}  # block 0 node block 1 reads (by position) -> the node block 0 read there
    steps: dict[str, int] = {}  # node name base -> how many names one block takes of it

    def refs_alike(a: Any, b: Any) -> bool:
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
            return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and _equal(a, b)
        if a in local[0]:
            return local[1].get(b) == local[0][a]
        if a.name in param_of:
            return param_of.get(b.name) == (1, param_of[a.name][1]) and param_of[a.name][0] == 0
        if b in local[0]:  # block 1 reads block 0 where block 0 read the stack's input
            return carry.setdefault(local[0][b], a) is a
        return a is b and a not in local[1]

    for a, b in zip(*segs):
        args_a, spec_a = pytree.tree_flatten((a.args, a.kwargs))
        args_b, spec_b = pytree.tree_flatten((b.args, b.kwargs))
        if (a.target is not b.target or spec_a != spec_b or _meta(a) != _meta(b)
                or not isinstance(a.target, (torch._ops.OpOverload, type(len)))
                or not all(refs_alike(x, y) for x, y in zip(args_a, args_b))):
            raise _NotRepeated(f"blocks 0 and 1 differ at {a.name} / {b.name}")
        (base_a, num_a), (base_b, num_b) = _split_name(a.name), _split_name(b.name)
        if base_a != base_b or steps.setdefault(base_a, num_b - num_a) != num_b - num_a:
            raise _NotRepeated(f"node names {a.name} / {b.name} do not step by block")
    after = nodes[first + 2 * len(segs[0]):]
    for node in after:
        for arg in node.all_input_nodes:
            if arg in local[0] or (arg in local[1] and local[1][arg] not in carry):
                raise _NotRepeated(f"{node.name} reads {arg.name} inside a block")
    for name, (block, _) in param_of.items():
        if not all(where.get(u) == block for u in graph.find_nodes(op="placeholder", target=name)[0].users):
            raise _NotRepeated(f"block parameter {name} read outside its block")
    return _grown(exported, nodes[:first], segs, after, carry, param_of, steps, stack, n_blocks)


def _meta(node: fx.Node) -> Any:
    return pytree.tree_map(lambda v: _tensor_meta(v) if isinstance(v, torch.Tensor) else str(v), node.meta.get("val"))


def _grown(exported: Exported, before: list[fx.Node], segs: list[list[fx.Node]], after: list[fx.Node],
           carry: dict[int, fx.Node], param_of: dict[str, tuple[int, str]], steps: dict[str, int],
           stack: str, n_blocks: int) -> Exported:
    """The new graph module and its input and output specs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    specs: list[InputSpec] = []
    spec_of = {s.arg.name: s for s in exported.input_specs}
    flat = stack.replace(".", "_")
    ones = {kind: [n for n in before if param_of.get(n.name, (None,))[0] == 1 and spec_of[n.name].kind == kind]
            for kind in (InputKind.PARAMETER, InputKind.BUFFER)}  # block 1's parameters, then its buffers
    copies: dict[int, dict[fx.Node, fx.Node]] = {j: {} for j in range(2, n_blocks)}  # block -> block 1's -> its
    storages = block_storages(before, segs, param_of, n_blocks)
    for node in before:
        env[node] = _copy(graph, node, env.__getitem__, node.name)
        if node.op != "placeholder":
            continue
        specs.append(spec_of[node.name])
        kind = spec_of[node.name].kind
        if ones.get(kind) and node is ones[kind][-1]:  # after block 1's last of a kind: the later blocks'
            for j in range(2, n_blocks):
                for one in ones[kind]:
                    copies[j][one] = _copy(graph, one, env.__getitem__, one.name.replace(f"_{flat}_1_", f"_{flat}_{j}_", 1))
                    copies[j][one].meta["val"] = storages[j].val(one.meta["val"])
                    s = spec_of[one.name]
                    specs.append(InputSpec(s.kind, TensorArgument(copies[j][one].name),
                                           f"{stack}.{j}.{param_of[one.name][1]}", s.persistent))
    for seg in segs:
        for node in seg:
            env[node] = _copy(graph, node, env.__getitem__, node.name)
    by_position = {j: [] for j in range(n_blocks)}
    by_position[0], by_position[1] = [env[n] for n in segs[0]], [env[n] for n in segs[1]]
    position = {n: q for q, n in enumerate(segs[1])}
    seg0 = {n: q for q, n in enumerate(segs[0])}
    for j in range(2, n_blocks):
        def read(x: fx.Node, j: int = j) -> fx.Node:
            if x in position:
                return by_position[j][position[x]]
            if x in seg0:
                return by_position[j - 1][seg0[x]]
            return copies[j].get(x) or env[x]
        for node in segs[1]:
            base, number = _split_name(node.name)
            new = _copy(graph, node, read, _join_name(base, number + (j - 1) * steps[base]))
            new.meta["val"] = storages[j].val(node.meta.get("val"))
            new.meta["nn_module_stack"] = _moved(node.meta.get("nn_module_stack") or {}, f"{stack}.1", f"{stack}.{j}")
            by_position[j].append(new)
    last = {n: by_position[n_blocks - 1][position[n]] for n in segs[1]}
    for node in after:
        base, number = _split_name(node.name)
        env[node] = _copy(graph, node, lambda x: last.get(x) or env[x],
                          node.name if node.op == "output" else _join_name(base, number + (n_blocks - 2) * steps.get(base, 0)))
        if "val" in node.meta:
            env[node].meta["val"] = storages[n_blocks].val(node.meta["val"])
    out_args = env[after[-1]].args[0]
    outputs = [replace(s, arg=TensorArgument(a.name)) if isinstance(a, fx.Node) else s
               for s, a in zip(exported.output_specs, out_args)]
    gm = fx.GraphModule(exported.gm, graph)
    return replace(exported, gm=gm, input_specs=tuple(specs), output_specs=tuple(outputs))


def _copy(graph: fx.Graph, node: fx.Node, read: Callable[[fx.Node], fx.Node], name: str) -> fx.Node:
    target = name if node.op == "placeholder" else node.target  # a placeholder's target is its argument's name
    new = graph.create_node(node.op, target, fx.map_arg(node.args, read), fx.map_arg(node.kwargs, read), name, node.type)
    new.meta = dict(node.meta)
    return new


def _moved(stack_meta: dict, old: str, new: str) -> dict:
    """nn_module_stack with the block at `old` read as the one at `new`."""
    def move(path: str) -> str:
        return new + path[len(old):] if path == old or path.startswith(old + ".") else path
    return {key.replace(old, new, 1) if old in key else key: (move(path), cls) for key, (path, cls) in stack_meta.items()}
