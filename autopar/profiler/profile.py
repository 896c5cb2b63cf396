"""Stage 2: `profile(traced) -> GraphProfile`, symbolic costs per node and per parameter.

Per node: forward/backward FLOPs and saved tensors come from `probe` (the op's
real autograd on fake tensors, cached by signature); output bytes are
numel * itemsize of the fake outputs (0 for views); saved tensors are
attributed to the producer of the storage they live in (see `graph.py`).
Values are sympy expressions in the trace's symbols (`traced.symbols`).
The graph is what eager runs (the tracer already turned Hugging Face's
materialised causal masks back into `is_causal=True`, see
`autopar.tracer.attention`), except for copies eager elides (`elided_copies`).
"""
from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass
from typing import Mapping

import sympy
import torch
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.profiler.flops import op_flops
from autopar.profiler.graph import GraphFacts, Ref, analyze, tensor_bytes
from autopar.profiler.probe import OpProbe, probe, to_expr
from autopar.profiler.types import GraphProfile, NodeProfile, ParamProfile
from autopar.tracer import TracedGraph, output_vals
from autopar.tracer.nodes import differentiable, is_dropout_clone, is_tensor_node

log = logging.getLogger(__name__)

_ZERO = sympy.Integer(0)

@dataclass(frozen=True)
class OptimizerCost:
    """What torch.optim's single-tensor step (the CPU default, and what `make_optimizer` builds) does per parameter."""

    state_mult: int  # optimizer state, as multiples of the parameter's bytes
    has_step: bool  # a per-parameter `step` tensor (a 4-byte fp32 scalar for Adam/AdamW with capturable=False)
    launches: int  # ATen ops one step dispatches per parameter (counted against torch in tests/profiler)
    writes: int  # elementwise outputs it writes per parameter, as multiples of the parameter's bytes
    # The update of an element reads other elements of its parameter (a matrix's row and column statistics,
    # the whole matrix orthogonalised): on a rank's block of a parameter it would differ from one device's,
    # so a plan for it keeps every parameter whole (`solver.search`) and the runtime refuses it on shards
    # (`runtime.optimizers`).
    whole_params: bool = False
    factored: bool = False  # Adafactor: a parameter of 2+ dims keeps a row and a column vector, not a full state

    def state_bytes(self, val: torch.Tensor, itemsize: int | None = None) -> int:
        """The optimizer state torch keeps for a parameter shaped like `val` (of `itemsize` bytes an element, default
        val's: a mixed-precision master's is float32's)."""
        step = 4 if self.has_step else 0
        itemsize = itemsize or val.element_size()
        if self.factored and val.ndim >= 2:
            rows, cols = val.numel() // val.shape[-1], val.numel() // val.shape[-2]
            return (rows + cols) * itemsize + step
        return self.state_mult * int(tensor_bytes(val)) * itemsize // val.element_size() + step


_OPTIMIZERS: dict[str, OptimizerCost] = {
    "sgd": OptimizerCost(0, False, 1, 1),  # param.add_(grad)
    "sgd_momentum": OptimizerCost(1, False, 3, 3),  # buf.mul_().add_(grad); param.add_(buf)
    # step += 1; exp_avg.lerp_; exp_avg_sq.mul_().addcmul_(); denom = sqrt / bias correction + eps; param.addcdiv_
    "adam": OptimizerCost(2, True, 9, 7),
    "adamw": OptimizerCost(2, True, 10, 8),  # and param.mul_(1 - lr * weight_decay) first
    # a matrix's ops (a vector's: 13 launches, 7 writes, and a full variance); row and column means of grad^2
    "adafactor": OptimizerCost(1, True, 22, 6, whole_params=True, factored=True),
    # a momentum buffer, and five Newton-Schulz iterations on the matrix (their matmul FLOPs are not priced:
    # `cost.optimizer_step_s` prices elementwise traffic). A tall matrix's ops (a wide one's: 2 fewer launches and
    # writes, its transposes). torch's Muon takes matrices only; a model's other parameters are priced as the same
    "muon": OptimizerCost(1, False, 30, 18, whole_params=True),
}
_ALIASES = {"sgd+momentum": "sgd_momentum", "sgd-momentum": "sgd_momentum", "momentum": "sgd_momentum"}


class ProfileError(AutoparError):
    """The profiler was given something it cannot price (names the value and the fix)."""


def optimizer_cost(optimizer: str) -> OptimizerCost:
    return _OPTIMIZERS[optimizer_key(optimizer)]


def optimizer_key(optimizer: str) -> str:
    key = _ALIASES.get(optimizer.lower(), optimizer.lower())
    if key not in _OPTIMIZERS:
        raise ProfileError(
            f"unknown optimizer {optimizer!r}; choose one of {sorted(_OPTIMIZERS) + sorted(_ALIASES)}"
        )
    return key


def profile(traced: TracedGraph, optimizer: str = "adamw", masters: Mapping[str, torch.dtype] | None = None,
            reduce_dtype: torch.dtype | None = None) -> GraphProfile:
    """Symbolic FLOPs and bytes for every node and parameter of `traced`.

    Mixed precision (`autopar.MixedPrecision`): `masters` maps the FQN of each parameter the graph computes on a
    copy of (traced in the compute dtype) to its master's dtype, whose bytes its gradient and optimizer state take
    (`MixedPrecision.masters`); `reduce_dtype`, what gradients are summed over ranks in."""
    opt = optimizer_key(optimizer)
    start = time.perf_counter()
    facts = analyze(traced)
    probes: dict[str, OpProbe] = {}
    for node in traced.graph.nodes:
        p = _probe_node(node, facts)
        if p is not None:
            probes[node.name] = p
    elided = elided_copies(traced, probes)
    if elided:
        facts = analyze(traced, elided)
    saved_refs = {name: _saved_refs(name, p, facts.arg_refs[name], facts) for name, p in probes.items()}
    saved: set[Ref] = {r for refs in saved_refs.values() for r in refs}

    nodes: dict[str, NodeProfile] = {}
    for node in traced.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        vals = output_vals(node)
        alias = facts.aliases.get(node.name, (False,) * len(vals))
        p = probes.get(node.name)
        out_bytes = tuple(_ZERO if v is None or alias[i] else to_expr(tensor_bytes(v)) for i, v in enumerate(vals))
        nodes[node.name] = NodeProfile(
            name=node.name,
            op="placeholder" if node.op == "placeholder" else str(node.target),
            fwd_flops=p.fwd_flops if p else _fwd_flops_no_grad(node),
            bwd_flops=p.bwd_flops if p else _ZERO,
            output_bytes=out_bytes,
            saved_outputs=tuple((node.name, i) in saved for i in range(len(vals))),
            extra_saved_bytes=p.extra_saved_bytes if p else _ZERO,
            temp_bytes=p.temp_bytes if p else _ZERO,
            saved_refs=saved_refs.get(node.name, ()),
            requires_grad=facts.requires_grad.get(node.name, False),
            value_bytes=tuple(_ZERO if v is None else to_expr(tensor_bytes(v)) for v in vals),
            grad_input_bytes=p.grad_input_bytes if p else (),
            self_saved_bytes=sum((out_bytes[j] for j in p.saved_own), p.extra_saved_bytes) if p else _ZERO,
            dtype=_math_dtype(node, vals),
        )
    params = _params(traced, opt, masters or {}, reduce_dtype)
    log.info("profiler: %d nodes (%d probed op signatures) in %.2f s", len(nodes), len(set(map(id, probes.values()))),
             time.perf_counter() - start)
    return GraphProfile(nodes=nodes, params=params, symbols=dict(traced.symbols), optimizer=opt)


def elided_copies(traced: TracedGraph, probes: dict[str, OpProbe]) -> frozenset[str]:
    """`clone` nodes that eager execution does not copy, so they are priced as views.

    Export writes `clone` where eager returns its input: `nn.Dropout` with p=0
    (eager returns the input itself) and `.contiguous()` on a tensor that the
    real CPU kernels already lay out contiguously (e.g. attention output, which
    the CPU flash kernel returns in (B, T, H, D) order: the meta strides in the
    trace say otherwise, so we use the probe's strides through permutes).
    A user's explicit `.clone()` stays a copy.
    """
    out = set()
    for node in traced.graph.nodes:
        if node.target is not torch.ops.aten.clone.default or not node.all_input_nodes:
            continue
        if is_dropout_clone(node):
            out.add(node.name)
        elif node.kwargs.get("memory_format") == torch.contiguous_format and _real_contiguous(node.args[0], probes):
            out.add(node.name)
    return frozenset(out)


# Views that, when they keep the shape, keep the strides too (HF writes `.view(B, -1, T, D)` on attention output).
_STRIDE_KEEPING = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default)


def _real_contiguous(node, probes: dict[str, OpProbe]) -> bool:
    perms = []
    while node.target in _STRIDE_KEEPING or node.target is torch.ops.aten.permute.default:
        if node.target is torch.ops.aten.permute.default:
            perms.append(node.args[1])
        elif node.meta["val"].shape != node.args[0].meta["val"].shape:
            return False
        node = node.args[0]
    p = probes.get(node.name)
    val = node.meta.get("val")
    if p is None or len(p.out_strides) != 1 or not isinstance(val, torch.Tensor):
        return False
    shape = [to_expr(s) for s in val.shape]
    strides = list(p.out_strides[0])
    for dims in reversed(perms):
        shape = [shape[d] for d in dims]
        strides = [strides[d] for d in dims]
    expected = sympy.Integer(1)
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and sympy.expand(stride - expected) != 0:
            return False
        expected = expected * size
    return True


def _probe_node(node, facts: GraphFacts) -> OpProbe | None:
    """Probe ops that take part in autograd; views save nothing and cost no FLOPs, so they are skipped."""
    if node.op != "call_function" or node.target is operator.getitem or not facts.requires_grad.get(node.name):
        return None
    if all(facts.aliases.get(node.name, (False,))):
        return None
    return probe(node, facts.requires_grad, facts.used_outputs[node.name])


def _fwd_flops_no_grad(node) -> sympy.Expr:
    """Forward FLOPs of an op outside autograd (no probe needed: the formula reads shapes only)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return _ZERO
    from torch.fx.node import map_arg

    args = map_arg(node.args, lambda a: a.meta.get("val"))
    kwargs = map_arg(node.kwargs, lambda a: a.meta.get("val"))
    return to_expr(op_flops(node.target, args, kwargs, node.meta.get("val")))


def _saved_refs(name: str, p: OpProbe, arg_refs: tuple[Ref, ...], facts: GraphFacts) -> tuple[Ref, ...]:
    """The storages a probed node's backward keeps, each once."""
    out = [facts.base[arg_refs[i]] for i in p.saved_args] + [facts.base[(name, j)] for j in p.saved_own]
    return tuple(dict.fromkeys(out))


def _math_dtype(node, vals) -> str:
    """The dtype `node`'s math runs in: its first floating-point tensor input's (a matmul of bf16 operands runs at
    the bf16 rate, whatever it returns), else its first floating-point output's; "" when it has neither."""
    inputs = [a.meta.get("val") for a in node.all_input_nodes] if node.op == "call_function" else []
    for v in (*inputs, *vals):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return str(v.dtype).removeprefix("torch.")
    return ""


def _params(traced: TracedGraph, opt: str, masters: Mapping[str, torch.dtype],
            reduce_dtype: torch.dtype | None) -> dict[str, ParamProfile]:
    """Per-parameter bytes; tied parameters (one storage under several FQNs) are counted once. A parameter computed
    on a copy (`masters`) holds the master and the copy; its gradient and optimizer state are the master's."""
    from torch.multiprocessing.reductions import StorageWeakRef

    cost = _OPTIMIZERS[opt]
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder" and n.name in traced.param_fqns]
    # The placeholder the graph actually reads owns a tied storage (export routes all uses to one).
    placeholders.sort(key=lambda n: not n.users)
    owners: set = set()
    params: dict[str, ParamProfile] = {}
    for n in placeholders:
        val = n.meta["val"]
        sid = StorageWeakRef(val.untyped_storage())
        nbytes = int(tensor_bytes(val))
        tied = sid in owners
        owners.add(sid)
        if tied:
            log.debug("profiler: %s is tied to another parameter; counted once", traced.param_fqns[n.name])
        fqn = traced.param_fqns[n.name]
        master = masters.get(fqn)
        copy = 0 if tied or master is None else nbytes
        held = nbytes if master is None else int(val.numel()) * master.itemsize  # the parameter the optimizer steps
        # a frozen parameter (requires_grad=False) has no gradient, and the optimizer keeps no state for it
        grad = 0 if tied or not differentiable(val) or not val.requires_grad else held
        params[fqn] = ParamProfile(
            fqn=fqn,
            node=n.name,
            numel=int(val.numel()),
            param_bytes=0 if tied else held + copy,
            grad_bytes=grad,
            optimizer_bytes=0 if not grad else cost.state_bytes(val, held // max(int(val.numel()), 1)),
            update_launches=cost.launches if grad else 0,  # the optimizer steps what has a gradient, once per storage
            update_write_bytes=cost.writes * grad,
            copy_bytes=copy,
            reduce_bytes=None if reduce_dtype is None or not grad else int(val.numel()) * reduce_dtype.itemsize,
        )
    order = {n.name: i for i, n in enumerate(traced.graph.nodes)}
    return dict(sorted(params.items(), key=lambda kv: order[kv[1].node]))
