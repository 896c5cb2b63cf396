"""Which dim of each input holds the batch: dim 0 unless the caller says otherwise.

    batch_dims((ids, labels), {}, batch_dim=1)        # (seq, batch) inputs: [1, 1]
    batch_dims((x, labels), {}, batch_dim=(1, 0))     # x (seq, batch, feat), labels (batch,): [1, 0]

`batch_dim` is either an int, for every tensor input: a tensor is batched along it when it has that
dim and its size there is the batch's (that size in the first tensor that has the dim), else fed
whole; or a structure shaped as the sample input (a tuple for positional inputs, a dict for keyword
ones, `CallArguments` for both; torch.export's `dynamic_shapes` is written the same way) whose
leaves are ints, each that input's batch dim, or None for an input fed whole. A structure may stop
early: a leaf int or None stands for everything under it.

The result has one entry per leaf of `(args, kwargs)` as pytree flattens them, which is the order of
a trace's user inputs (`TracedGraph.input_names`): the dim, or None where the input is fed whole
(a non-tensor, a tensor without the batch).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.tracer.call_arguments import split_sample_input

BatchDim = Any  # int, or a structure of ints and Nones shaped as the sample input (module docstring)


class BatchDimError(AutoparError):
    """`batch_dim` does not fit the inputs: a structure of another shape, a dim an input does not have, or
    inputs whose batch sizes differ."""


def batch_dims(args: tuple, kwargs: Mapping[str, Any], batch_dim: BatchDim = 0) -> tuple[int | None, ...]:
    """Per leaf of `(args, kwargs)`: the dim its batch runs along, or None (fed whole)."""
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    if isinstance(batch_dim, int) and not isinstance(batch_dim, bool):
        return _matching(leaves, batch_dim)
    args_dims, kwargs_dims = _as_call(batch_dim)
    given = _per_leaf(args_dims, tuple(args), "the positional inputs") + _per_leaf(kwargs_dims, dict(kwargs), "the keyword inputs")
    dims = tuple(None if d is None else _dim_of(leaf, d, path) for leaf, (path, d) in zip(leaves, given, strict=True))
    sizes = {path: int(leaf.shape[d]) for leaf, (path, _), d in zip(leaves, given, dims) if d is not None}
    if len(set(sizes.values())) > 1:
        raise BatchDimError(f"batch_dim gives inputs batches of different sizes: {sizes}; give each input the dim "
                            f"that holds the batch, or None for an input fed whole on every rank")
    return dims


def batch_size(leaves: list[Any], dims: tuple[int | None, ...]) -> int | None:
    """The batch's size: that of the first batched input along its batch dim (None: nothing is batched)."""
    return next((int(t.shape[d]) for t, d in zip(leaves, dims) if d is not None), None)


def _matching(leaves: list[Any], dim: int) -> tuple[int | None, ...]:
    """One dim for every tensor: batched where its size there is that of the first tensor having the dim."""
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if dim < 0:
        raise BatchDimError(f"batch_dim={dim}: give the batch dim counted from the front (0 for (batch, ...), 1 for (seq, batch, ...))")
    size = next((int(t.shape[dim]) for t in tensors if t.dim() > dim), None)
    if size is None and tensors and dim > 0:  # (dim 0 and only scalars: nothing is batched, every input fed whole)
        raise BatchDimError(f"batch_dim={dim}, but no input has {dim + 1} dims (shapes {[tuple(t.shape) for t in tensors]})")
    return tuple(dim if isinstance(t, torch.Tensor) and t.dim() > dim and int(t.shape[dim]) == size else None for t in leaves)


def _dim_of(leaf: Any, dim: int, path: str) -> int:
    if not isinstance(leaf, torch.Tensor):
        raise BatchDimError(f"batch_dim gives {path} (a {type(leaf).__name__}, not a tensor) batch dim {dim}; give it None")
    if not -leaf.dim() <= dim < leaf.dim():
        raise BatchDimError(f"batch_dim gives {path} batch dim {dim}, but its shape is {tuple(leaf.shape)}")
    return dim % leaf.dim()


def _as_call(batch_dim: BatchDim) -> tuple[Any, Any]:
    """The structure in `(args, kwargs)` form, as `tracer.split_sample_input` turns the sample input."""
    return (None, None) if batch_dim is None else split_sample_input(batch_dim)


def _per_leaf(spec: Any, tree: Any, path: str) -> list[tuple[str, int | None]]:
    """(path, dim) per leaf of `tree`, `spec` broadcast over it (a leaf of `spec` covers what is under it)."""
    if spec is None or isinstance(spec, int):
        return [(path, spec)] * len(pytree.tree_leaves(tree))
    if isinstance(spec, Mapping) and isinstance(tree, Mapping):
        missing = [key for key, value in tree.items()
                   if key not in spec and any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value))]
        if missing:  # (an input the structure leaves out that holds no tensor, `temperature=2.0`, is fed as it is)
            raise BatchDimError(f"batch_dim gives no batch dim for {missing} of {path}; add them (None for an input fed "
                                f"whole on every rank)")
        return [pair for key in tree for pair in _per_leaf(spec.get(key), tree[key], _child(path, key))]
    if isinstance(spec, (tuple, list)) and isinstance(tree, (tuple, list)) and len(spec) == len(tree):
        return [pair for i, (s, t) in enumerate(zip(spec, tree)) for pair in _per_leaf(s, t, _child(path, i))]
    raise BatchDimError(f"batch_dim gives {spec!r} for {path}, which is {_described(tree)}; shape batch_dim as the sample "
                        f"input (a tuple for positional inputs, a dict for keyword ones), an int or None per input")


def _child(path: str, key: int | str) -> str:
    """`input 'labels'`, `positional input 1`, then `input 'pair'[0]` further down."""
    if path.startswith("the "):
        return f"{path[4:-1]} {key!r}"
    return f"{path}[{key!r}]"


def _described(tree: Any) -> str:
    if isinstance(tree, torch.Tensor):
        return f"a tensor {tuple(tree.shape)}"
    if isinstance(tree, Mapping):
        return f"a dict with keys {sorted(tree)}"
    if isinstance(tree, (tuple, list)):
        return f"a {type(tree).__name__} of {len(tree)}"
    return f"a {type(tree).__name__}"
