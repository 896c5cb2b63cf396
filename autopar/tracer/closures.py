"""Functions stored on a deep-copied model made to read the copy, not the model they were made over.

    copied = copy.deepcopy(model, memo)
    rebind_closures(copied, memo)   # minGPT's `self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))` reads copied.mlp

`copy.deepcopy` copies a function as itself: a lambda stored on a module
(minGPT's block keeps `m = self.mlp; self.mlpf = lambda x: ...`) still closes
over the ORIGINAL submodule. The tracer runs the copy (its parameters on
`meta` or fake tensors), so such a forward would read the original's real
weights, which torch.export lifts as constants: they would never be trained,
and the copy's own parameters would stay unread. So every function reachable
from the copy's modules (their attributes and hooks, lists, tuples, dicts,
`functools.partial`s, bound methods, nested closures and default arguments) gets
a twin whose closure cells and defaults hold what `memo` maps them to: the
copies. Weak references (a child module's `weakref.ref` to its parent) are
made to point at the copy too, since deepcopy keeps them as they are.
What this cannot reach (a module held in a global, a class attribute) is
caught after tracing (`tracer.lifted`).
"""
from __future__ import annotations

import copy
import functools
import types
import weakref
from typing import Any

from torch import nn

# the module's own registries: its parameters, buffers and submodules are deep-copied by deepcopy itself
_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules"})


def deep_copy(module: nn.Module) -> nn.Module:
    """`copy.deepcopy(module)` whose stored functions read the copy: a copy that trains its own weights."""
    memo: dict[int, Any] = {}
    copied = copy.deepcopy(module, memo)
    rebind_closures(copied, memo)
    return copied


def rebind_closures(copied: nn.Module, memo: dict[int, Any]) -> None:
    """Make the functions stored on `copied`'s modules read the objects `memo` (deepcopy's) maps theirs to."""
    rebinder = _Rebinder(memo)
    for module in copied.modules():
        attrs = vars(module)
        for name, value in list(attrs.items()):
            if name not in _REGISTRIES:
                attrs[name] = rebinder.rebound(value)


class _Rebinder:
    def __init__(self, memo: dict[int, Any]):
        self.memo = memo
        self.copies = {id(v) for k, v in memo.items() if k != id(memo)}  # objects deepcopy made: ours to change
        self.done: dict[int, Any] = {}  # id of an object visited -> what stands for it (cycles end here)

    def rebound(self, value: Any) -> Any:
        value = self.memo.get(id(value), value)  # the copy deepcopy made of it, if it made one
        key = id(value)
        if key in self.done:
            return self.done[key]
        if isinstance(value, types.FunctionType):
            return self._function(value)
        self.done[key] = value  # before recursing: a container holding itself
        if isinstance(value, types.MethodType):
            out = types.MethodType(self.rebound(value.__func__), self.rebound(value.__self__))
            out = value if out.__func__ is value.__func__ and out.__self__ is value.__self__ else out
        elif isinstance(value, functools.partial):
            func, args = self.rebound(value.func), tuple(self.rebound(a) for a in value.args)
            keywords = {k: self.rebound(v) for k, v in value.keywords.items()}
            same = func is value.func and _all_same(args, value.args) and _all_same(keywords.values(), value.keywords.values())
            out = value if same else functools.partial(func, *args, **keywords)
        elif isinstance(value, weakref.ReferenceType) and type(value) is weakref.ReferenceType:
            target = value()
            copy = self.memo.get(id(target)) if target is not None else None
            out = weakref.ref(copy) if copy is not None and copy is not target else value
        elif isinstance(value, (list, dict)):
            out = self._container(value)
        elif type(value) is tuple:
            items = tuple(self.rebound(v) for v in value)
            out = value if _all_same(items, value) else items
        else:
            out = value  # anything else deepcopy copied (or kept) as it should
        self.done[key] = out
        return out

    def _container(self, value: list | dict) -> list | dict:
        """A list or dict with its items rebound: changed in place when deepcopy made it (the copy's own), else a
        new one (a list in a closure is the original model's, which must stay as it is)."""
        keys = range(len(value)) if isinstance(value, list) else list(value)
        items = {k: self.rebound(value[k]) for k in keys}
        if all(items[k] is value[k] for k in keys):
            return value
        out = value if id(value) in self.copies else value.copy()
        for k, v in items.items():
            out[k] = v
        return out

    def _function(self, f: types.FunctionType) -> types.FunctionType:
        """`f`, or a twin of it (same code, globals and attributes) whose closure cells and defaults are rebound."""
        cells = f.__closure__ or ()
        twin_cells = tuple(types.CellType() for _ in cells)
        twin = types.FunctionType(f.__code__, f.__globals__, f.__name__, None, twin_cells)
        self.done[id(f)] = twin  # a function closing over itself (recursion) finds its twin
        changed = False
        for cell, twin_cell in zip(cells, twin_cells):
            try:
                content = cell.cell_contents
            except ValueError:  # a cell not filled yet (a name assigned after the function was made)
                continue
            twin_cell.cell_contents = self.rebound(content)
            changed |= twin_cell.cell_contents is not content
        defaults = None if f.__defaults__ is None else tuple(self.rebound(d) for d in f.__defaults__)
        kwdefaults = None if f.__kwdefaults__ is None else {k: self.rebound(v) for k, v in f.__kwdefaults__.items()}
        changed |= defaults is not None and not _all_same(defaults, f.__defaults__)
        changed |= kwdefaults is not None and not _all_same(kwdefaults.values(), f.__kwdefaults__.values())
        if not changed:
            self.done[id(f)] = f
            return f
        twin.__defaults__, twin.__kwdefaults__ = defaults, kwdefaults
        twin.__qualname__, twin.__module__, twin.__doc__ = f.__qualname__, f.__module__, f.__doc__
        twin.__dict__.update(f.__dict__)
        return twin


def _all_same(new: Any, old: Any) -> bool:
    return all(a is b for a, b in zip(new, old, strict=True))
