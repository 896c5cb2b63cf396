"""Fake tensors of their own for the copies of a block (`repeated_blocks`).

The graph's later stages tell aliasing by storage (the profiler: a view shares its input's storage, a tied
parameter is one storage), so a copied node cannot share block 1's fake tensor: each copy's tensors get
storages of their own, with the views among them as block 1 has them.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

class Storages:
    """Fake tensors for one copy of block 1. The graph's later stages tell aliasing by storage (a view
    shares its input's), so each copy gets storages of its own for what block 1 made (`own`); a tensor of
    block 1 in the storage of something block 0 made (`carried`, block 0's storage -> block 1's) takes the
    storage of that thing's copy in the block before (`before`); anything else (shared inputs) is kept."""

    def __init__(self, own: set, carried: dict, before: "Storages | None", template: dict) -> None:
        self.own, self.carried, self.before, self.template = own, carried, before, template
        self.owners: dict = {}  # template storage -> this copy's tensor owning the storage standing for it

    def owner(self, sid: Any, like: torch.Tensor) -> torch.Tensor | None:
        if self.before is None:  # block 1 itself
            return self.template.get(sid)
        if sid in self.own:
            if sid not in self.owners:
                numel = like.untyped_storage().nbytes() // like.element_size()
                if isinstance(numel, int):  # a plain meta tensor: views of it are made without the fake mode
                    self.owners[sid] = torch.empty(numel, dtype=like.dtype, device="meta")
                else:
                    with like.fake_mode:
                        self.owners[sid] = torch.empty(numel, dtype=like.dtype, device=like.device)
            return self.owners[sid]
        if sid in self.carried:
            return self.before.owner(self.carried[sid], like)
        return None

    def val(self, val: Any) -> Any:
        def fresh(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            owner = self.owner(_sid(t), t)
            if owner is None:
                return t
            if owner.dtype != t.dtype:
                raise ValueError("a storage read as two dtypes")  # the caller traces the model whole
            if isinstance(owner, FakeTensor):
                with t.fake_mode:
                    return owner.as_strided(t.shape, t.stride(), t.storage_offset()).detach().requires_grad_(t.requires_grad)
            # made directly, not through the fake mode's dispatch (a tenth of the time)
            view = owner.as_strided(t.shape, t.stride(), t.storage_offset()).requires_grad_(t.requires_grad)
            return FakeTensor(t.fake_mode, view, t.device)
        return pytree.tree_map(fresh, val)


def _sid(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _sids(node: fx.Node) -> list:
    return [_sid(t) for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]


def block_storages(before: list[fx.Node], segs: list[list[fx.Node]], param_of: dict,
                    n_blocks: int) -> dict[int, Storages]:
    """Block j -> the storages of its copy; at n_blocks, what the nodes after the stack read of the last copy."""
    params = [[n for n in before if param_of.get(n.name, (None,))[0] == i] for i in (0, 1)]
    shared = {sid for n in before if param_of.get(n.name) is None for sid in _sids(n)}
    firsts = segs[0] + params[0]
    seconds = segs[1] + [next(m for m in params[1] if param_of[m.name][1] == param_of[n.name][1]) for n in params[0]]
    carried, template = {}, {}
    for a, b in zip(firsts, seconds):
        for x, y in zip(pytree.tree_leaves(a.meta.get("val")), pytree.tree_leaves(b.meta.get("val"))):
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                carried.setdefault(_sid(x), _sid(y))
                template.setdefault(_sid(y), y)
    own = set(template) - shared - set(carried)
    carried = {a: b for a, b in carried.items() if a not in shared}
    storages = {1: Storages(own, carried, None, template)}
    for j in range(2, n_blocks):
        storages[j] = Storages(own, carried, storages[j - 1], template)
    storages[n_blocks] = Storages(set(), {sid: sid for sid in own}, storages[n_blocks - 1], template)
    return storages

