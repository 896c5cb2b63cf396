"""The one place that touches DTensor's private sharding-propagation internals.

Every private torch import of the solver lives here. We ask DTensor's two
registries for the strategies of one op and convert the answer into our own
frozen `Spec`s at this boundary; nothing past this module sees a DTensor class.

- single-dim strategy registry (`op_single_dim_strategy_funcs`, ~1,000 ops:
  pointwise, mm/addmm/bmm, embedding, norms...): a rule function lists the
  valid placements over ONE mesh axis; we expand it over all axes ourselves
  (cartesian product, as DTensor's `expand_to_full_mesh_op_strategy` does).
- op-strategy registry (`op_strategy_funcs`, ~160 ops: views, reductions,
  softmax, cat/split, gather...): a function that, given every candidate
  placement of every input (an `OpStrategy` per input), returns the valid
  (input specs -> output specs) combinations.

A `DeviceMesh` built with `_init_backend=False` is enough for both: the rules
only read the mesh shape, so no process group is created and a later real
`init_process_group` is unaffected.

Tested on torch 2.11 through 2.13 (`autopar.compat.SUPPORTED_TORCH`): these
private names changed in 2.5, 2.8 and since; `_check_features()` fails loudly
at import when they move. What differs between those releases is handled here
and named with its release (`_zipped`, `_raises_on_partial`, `_registered_squeeze`).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from autopar.compat import SUPPORTED_TORCH, TORCH_RELEASE
from autopar.errors import AutoparError
from autopar.solver.spec import Partial, Placement, Replicate, Shard, Spec
from autopar.solver.strategies.expand import Rule, expand_over_mesh

log = logging.getLogger(__name__)


class DTensorAdapterError(AutoparError):
    """The installed torch lacks a DTensor internal the strategy adapter needs."""


try:  # every private torch import of the solver: keep it to this block
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import placement_types as _pt
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
    # for `simulated_mesh` only (the numeric proof): every rank of a mesh in one process
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
except ImportError as err:  # pragma: no cover - only on an untested torch
    raise DTensorAdapterError(
        f"torch {torch.__version__} moved a DTensor internal the strategy adapter imports ({err}); "
        f"autopar is tested with torch {SUPPORTED_TORCH}: install one of those or update autopar/solver/strategies/dtensor_adapter.py"
    ) from err


def _check_features() -> Any:
    prop = DTensor._op_dispatcher.sharding_propagator
    for attr in ("op_strategy_funcs", "op_single_dim_strategy_funcs"):
        if not isinstance(getattr(prop, attr, None), dict):
            raise DTensorAdapterError(
                f"torch {torch.__version__}: ShardingPropagator has no dict {attr!r}; "
                f"autopar is tested with torch {SUPPORTED_TORCH} (update dtensor_adapter.py for this release)"
            )
    return prop


_PROP = _check_features()



def has_dtensor_rule(op: Any) -> bool:
    return op in _PROP.op_single_dim_strategy_funcs or op in _PROP.op_strategy_funcs


@functools.lru_cache(maxsize=None)
def _device_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """A mesh object for the rules only: no backend, no process group."""
    return DeviceMesh("cpu", torch.arange(max(1, _prod(shape))).reshape(shape), _init_backend=False, _rank=0)


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _to_ours(p: Any) -> Placement | None:
    """DTensor placement -> ours; None for placements outside our vocabulary
    (_StridedShard, _MaskPartial, Partial(avg/max/min), ...)."""
    if type(p) is _pt.Replicate:
        return Replicate()
    if type(p) is _pt.Shard:
        return Shard(p.dim)
    if type(p) is _pt.Partial and p.reduce_op == "sum":
        return Partial()
    if isinstance(p, _ShardingPlaceholder):
        return Shard(p.dim)
    return None


def _to_theirs(p: Placement) -> Any:
    if isinstance(p, Shard):
        return _pt.Shard(p.dim)
    if isinstance(p, Partial):
        return _pt.Partial("sum")
    return _pt.Replicate()


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def candidate_specs(shape: Sequence[int], mesh_shape: tuple[int, ...], partial: bool = True) -> tuple[Spec, ...]:
    """Every even spec of a tensor of `shape` on the mesh (Partial included when `partial`)."""
    per_axis: list[Placement] = [Replicate()] + ([Partial()] if partial else []) + [Shard(d) for d in range(len(shape))]
    out = []
    for pl in itertools.product(per_axis, repeat=len(mesh_shape)):
        spec = Spec(tuple(pl))
        if is_even(spec, shape, mesh_shape):
            out.append(spec)
    return tuple(out)


def is_even(spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    factors = [1] * len(shape)
    for p, n in zip(spec.placements, mesh_shape):
        if isinstance(p, Shard):
            if p.dim >= len(shape):
                return False
            factors[p.dim] *= n
    return all(size % f == 0 for size, f in zip(shape, factors))


def dtensor_rules(op: Any, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    """All strategies DTensor knows for `op` on concrete args (tensors are fake/meta tensors).

    Returns None when DTensor has no rule; otherwise rules in our vocabulary
    (unknown placements dropped, not yet filtered for evenness or duplicates).
    Input specs follow the flattened (args, kwargs) order of tensor arguments.
    """
    if op is _SQUEEZE_DIMS:
        op, args = _registered_squeeze(args)
    if op in _PROP.op_single_dim_strategy_funcs:
        return _single_dim_rules(op, args, kwargs, mesh_shape)
    if op in _PROP.op_strategy_funcs:
        return _op_strategy_rules(op, args, kwargs, mesh_shape)
    return None


def _single_dim_rules(op: Any, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule]:
    info = _PROP.op_single_dim_strategy_funcs[op]
    to_meta = lambda x: _meta(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
    args_meta = pytree.tree_map(to_meta, args)
    kwargs_meta = pytree.tree_map(to_meta, kwargs)
    num_inputs = sum(1 for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))
    one_axis: list[tuple[Placement, ...]] = []
    for rule in info.func(op, args_meta, kwargs_meta):
        # None marks a masked-off output (backward ops); a replicated stand-in keeps arity.
        converted = [Replicate() if p is None else _to_ours(p) for p in rule]
        if all(p is not None for p in converted):
            one_axis.append(tuple(converted))  # type: ignore[arg-type]
    if one_axis:
        width = len(one_axis[0])
    else:
        width = num_inputs + _num_outputs(op)
    one_axis.append((Replicate(),) * width)  # DTensor inserts the all-replicate rule implicitly too
    return expand_over_mesh(one_axis, width - num_inputs, len(mesh_shape))


def _num_outputs(op: Any) -> int:
    return sum(1 for r in op._schema.returns if "Tensor" in str(r.type))


def _op_strategy_rules(op: Any, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule]:
    mesh = _device_mesh(mesh_shape)

    def to_strategy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            specs = [OpSpec(DTensorSpec(mesh, tuple(_to_theirs(p) for p in s.placements), _meta(x)))
                     for s in candidate_specs(x.shape, mesh_shape)]
            return OpStrategy(specs)
        if isinstance(x, (list, tuple)) and x and all(isinstance(e, torch.Tensor) for e in x):
            return TupleStrategy([to_strategy(e) for e in x])
        return x

    func = _PROP.op_strategy_funcs[op]
    in_args = tuple(to_strategy(a) for a in args)
    in_kwargs = {k: to_strategy(v) for k, v in kwargs.items()}
    schema = OpSchema(op, in_args, in_kwargs)
    if (_per_candidate(func) or _zipped(func) or _raises_on_partial(func)) and isinstance(in_args[0], OpStrategy):
        # A view rule maps each input candidate on its own, but prices a redistribution from
        # every candidate to each target (quadratic; ~90% of cold strategy time on GPT-2).
        # Asking once per candidate gives the same strategies, in the same order, in linear time.
        # A candidate the rule rejects by raising (e.g. unflattening a dim sharded unevenly) drops
        # only that candidate, not the whole op.
        rest = tuple(_first_candidate(a) for a in in_args[1:]) if _zipped(func) else in_args[1:]
        specs = []
        for c in in_args[0].strategies:
            try:
                specs += func(OpSchema(op, (OpStrategy([c]),) + rest, in_kwargs)).strategies
            except (RuntimeError, AssertionError, ValueError) as err:
                log.debug("strategies: %s rejects input %s: %s", op, c.output_spec, err)
    else:
        result = func(schema)
        if not isinstance(result, OpStrategy):  # TupleStrategy (foreach ops): not in training graphs
            return []
        specs = result.strategies
    # One output spec for an op returning several tensors holds for each of them, as DTensor's sharding propagation
    # reads it (torch 2.11's layer norm rule answers so for its (out, mean, rstd); 2.13's gives three)
    returns = len(op._schema.returns) if schema.return_type_tuple_tensor_like() else 1
    rules: list[Rule] = []
    for s in specs:
        outs = s.output_specs if isinstance(s.output_specs, (tuple, list)) else (s.output_specs,) * returns
        ins = s.input_specs if s.input_specs is not None else (s.output_spec,) * len(schema.args_spec)
        converted = []
        for group in (ins, outs):
            specs = []
            for d in group:
                if d is None:
                    specs.append(Spec.replicate(len(mesh_shape)))
                    continue
                pls = tuple(_to_ours(p) for p in d.placements)
                if any(p is None for p in pls):
                    break
                specs.append(Spec(pls))  # type: ignore[arg-type]
            else:
                converted.append(tuple(specs))
                continue
            break
        if len(converted) == 2:
            rules.append((converted[0], converted[1]))
    return rules


# torch 2.11 and 2.12 (2.13 moved the norms to the single-dim registry): the layer and RMS norm rules read the
# weight's and bias's k-th candidate beside the input's k-th, as DTensor's dispatch passes one candidate per
# input, and raise IndexError given every candidate of each. They replicate the weight and bias whatever their
# source, so asking per input candidate with the weight and bias offered replicated gives every strategy.
_ZIPPED_NORM_RULES = ("layer_norm_strategy", "fused_rms_norm_strategy") if TORCH_RELEASE < (2, 13) else ()


def _zipped(func: Any) -> bool:
    return func.__name__ in _ZIPPED_NORM_RULES and func.__module__.endswith("_ops._math_ops")


# torch 2.11 and 2.12: the random ops' rule (`bernoulli(x)`, ...) raises on a Partial candidate of its input where
# 2.13 leaves that candidate out; asked per candidate, the Partial one alone is dropped.
_PARTIAL_RAISING_RULES = ("random_op_strategy",) if TORCH_RELEASE < (2, 13) else ()


def _raises_on_partial(func: Any) -> bool:
    return func.__name__ in _PARTIAL_RAISING_RULES and func.__module__.endswith("_ops._random_ops")


# torch 2.11: DTensor has no rule for `squeeze.dims` (2.13 registers one and routes every squeeze through it), the
# op cross-entropy's decomposition ends its gather with; without a rule it ran replicated, and a mean loss over a
# batch sharded across ranks became a replicated one, its division left in backward. There the op is asked as the
# squeeze 2.11 does register that drops the same dims: `squeeze.dim` for one dim, `squeeze.default` for every
# size-1 dim. Other dim lists keep no rule.
_SQUEEZE_DIMS = torch.ops.aten.squeeze.dims if not has_dtensor_rule(torch.ops.aten.squeeze.dims) else None


def _registered_squeeze(args: tuple) -> tuple[Any, tuple]:
    """`squeeze.dims(x, dims)` as the registered squeeze that drops the same dims, or squeeze.dims where none does."""
    x, dims = args[0], [d % max(1, args[0].dim()) for d in args[1]]
    if len(dims) == 1:
        return torch.ops.aten.squeeze.dim, (x, dims[0])
    if {d for d in dims if x.shape[d] == 1} == {d for d, size in enumerate(x.shape) if size == 1}:
        return torch.ops.aten.squeeze.default, (x,)
    return torch.ops.aten.squeeze.dims, args


def _first_candidate(x: Any) -> Any:
    """An input's strategy cut to its first candidate, which `candidate_specs` makes the replicated one."""
    return OpStrategy(x.strategies[:1]) if isinstance(x, OpStrategy) else x


def _per_candidate(func: Any) -> bool:
    """DTensor's view/reshape rule (`_view_ops.register_op_strategy_map`): one output per input candidate."""
    return func.__name__ == "reshape_strategy" and func.__module__.endswith("_ops._view_ops")


@contextlib.contextmanager
def simulated_mesh(mesh_shape: Sequence[int]) -> Iterator[tuple[tuple[str, ...], Callable, Callable]]:
    """Run code that calls c10d collectives for every rank of a mesh at once, in this process.

        with simulated_mesh((2, 2)) as (group_names, to_ranks, from_ranks):
            out = fn(to_ranks({rank: tensor, ...}), group_names)   # collectives over the axes' groups
            per_rank = from_ranks(out)                              # {rank: tensor}

    torch's `LocalTensorMode` runs each op once per rank on a `LocalTensor` (one tensor per
    rank) and implements the functional collectives across those ranks; the groups come from
    a `DeviceMesh` over torch's "fake" backend, which is initialised here and torn down after.
    Ranks are mesh coordinates in row-major order. Needs no process group in this process.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("simulated_mesh needs a process without a process group (it initialises a fake one)")
    world = _prod(mesh_shape)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with LocalTensorMode(world):
            mesh = DeviceMesh("cpu", torch.arange(world).view(*mesh_shape))
            names = tuple(mesh.get_group(a).group_name for a in range(len(mesh_shape)))
            yield names, LocalTensor, lambda t: dict(t._local_tensors)
    finally:
        dist.destroy_process_group()
