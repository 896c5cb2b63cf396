"""What the profiler hands the solver: symbolic per-node and per-parameter costs.

`NodeProfile` holds sympy expressions in the graph's symbolic dims (plain
integers when the trace is static); `GraphProfile.evaluate(...)` turns the
whole profile into concrete floats (`NodeCost`, `ParamCost`) for one size,
which is all the solver reads.

Saved-for-backward memory is attributed to the node that *produces* a tensor
(`saved_outputs[i]` is True when output i of the node is kept for backward by
the node itself or by any consumer, directly or through a view), so a tensor
saved by several consumers is counted once, and recomputing the producer frees it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import sympy


@dataclass(frozen=True)
class NodeProfile:
    name: str
    op: str  # str(node.target), e.g. "aten.mm.default"; "placeholder" for inputs
    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    output_bytes: tuple[sympy.Expr, ...]  # one per tensor output (0 for outputs that alias an input: views)
    saved_outputs: tuple[bool, ...]  # output i is kept alive for backward (see module docstring)
    extra_saved_bytes: sympy.Expr  # saved tensors that are not graph values (rare; e.g. RNG state)
    temp_bytes: sympy.Expr  # scratch the op allocates and frees within forward or backward
    # Added by the profiler (defaults keep hand-built profiles valid):
    saved_refs: tuple[tuple[str, int], ...] = ()  # (producer, output index) of each storage this node's backward keeps
    requires_grad: bool = False  # the node's output needs a gradient (it runs a backward step)
    value_bytes: tuple[sympy.Expr, ...] = ()  # per output: numel * itemsize even for views (size of its gradient)
    # per tensor input: the gradient storage its backward makes for it (`probe.OpProbe.grad_input_bytes`)
    grad_input_bytes: tuple[sympy.Expr, ...] = ()
    # what its own backward keeps of its outputs and beyond them (softmax's output, SDPA's logsumexp): alive
    # through its backward step, after its consumers' steps freed what they kept
    self_saved_bytes: sympy.Expr = sympy.Integer(0)
    # the dtype its math runs in (its first floating-point input's, else its output's: "bfloat16", "float32"):
    # what rate its FLOPs are priced at (`Mesh.flops_per_s_for`); "": the mesh's one rate
    dtype: str = ""


@dataclass(frozen=True)
class ParamProfile:
    fqn: str
    node: str  # placeholder name in the traced graph
    numel: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # for the optimizer the caller named (Adam/AdamW: 2 fp32 states per element)
    update_launches: int = 0  # ops the optimizer's step launches for this parameter (0: tied twin or no gradient)
    update_write_bytes: int = 0  # elementwise output bytes that step writes
    # mixed precision (`autopar.MixedPrecision`): param_bytes holds the float32 master and its compute copy, whose
    # bytes these are (0: the graph computes on the parameter itself); grad_bytes and optimizer_bytes are the master's
    copy_bytes: int = 0
    reduce_bytes: int | None = None  # its gradient as summed over ranks, in the reduce dtype (None: grad_bytes)
    # on the host tier by the caller's choice (`solver.offload.offloaded_profile`): its optimizer state, kept on the
    # host and stepped there (optimizer_bytes, the device's, is 0 then); 0: the tier is the solver's to choose, or none
    host_optimizer_bytes: int = 0


@dataclass(frozen=True)
class NodeCost:
    """`NodeProfile` evaluated at concrete sizes."""

    name: str
    op: str
    fwd_flops: float
    bwd_flops: float
    output_bytes: tuple[float, ...]
    saved_outputs: tuple[bool, ...]
    extra_saved_bytes: float
    temp_bytes: float
    saved_refs: tuple[tuple[str, int], ...] = ()
    requires_grad: bool = False
    value_bytes: tuple[float, ...] = ()
    grad_input_bytes: tuple[float, ...] = ()
    self_saved_bytes: float = 0.0
    dtype: str = ""


@dataclass(frozen=True)
class ParamCost:
    fqn: str
    node: str
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    update_launches: int = 0
    update_write_bytes: float = 0.0
    copy_bytes: float = 0.0
    reduce_bytes: float | None = None
    numel: float = 0.0  # elements (what a host optimizer step's time goes by, `solver.offload`)
    host_optimizer_bytes: float = 0.0  # (`ParamProfile.host_optimizer_bytes`)

    @property
    def compute_bytes(self) -> float:
        """The tensor forward and backward compute on (what a ZeRO gather moves): its compute copy, or itself."""
        return self.copy_bytes or self.param_bytes

    @property
    def summed_bytes(self) -> float:
        """Its gradient as the ranks sum it (the gradient sync, ZeRO's reduce-scatter)."""
        return self.grad_bytes if self.reduce_bytes is None else self.reduce_bytes


@dataclass(frozen=True)
class GraphProfile:
    nodes: Mapping[str, NodeProfile]  # in graph (topological) order
    params: Mapping[str, ParamProfile]  # by FQN
    symbols: Mapping[str, sympy.Symbol]  # "batch"/"seq" -> symbol used in the expressions
    optimizer: str

    def evaluate(self, **sizes: int) -> "ConcreteProfile":
        """Concrete numbers for e.g. evaluate(batch=8, seq=1024); static profiles need no sizes."""
        subs = {self.symbols[k]: v for k, v in sizes.items() if k in self.symbols}

        def num(expr: sympy.Expr) -> float:
            return float(expr.xreplace(subs)) if subs and not isinstance(expr, (int, float)) else float(expr)

        nodes = {
            name: NodeCost(
                name=p.name,
                op=p.op,
                fwd_flops=num(p.fwd_flops),
                bwd_flops=num(p.bwd_flops),
                output_bytes=tuple(num(b) for b in p.output_bytes),
                saved_outputs=p.saved_outputs,
                extra_saved_bytes=num(p.extra_saved_bytes),
                temp_bytes=num(p.temp_bytes),
                saved_refs=p.saved_refs,
                requires_grad=p.requires_grad,
                value_bytes=tuple(num(b) for b in p.value_bytes),
                grad_input_bytes=tuple(num(b) for b in p.grad_input_bytes),
                self_saved_bytes=num(p.self_saved_bytes),
                dtype=p.dtype,
            )
            for name, p in self.nodes.items()
        }
        params = {
            fqn: ParamCost(fqn, p.node, float(p.param_bytes), float(p.grad_bytes), float(p.optimizer_bytes),
                           p.update_launches, float(p.update_write_bytes), float(p.copy_bytes),
                           None if p.reduce_bytes is None else float(p.reduce_bytes), float(p.numel),
                           float(p.host_optimizer_bytes))
            for fqn, p in self.params.items()
        }
        return ConcreteProfile(nodes=nodes, params=params, optimizer=self.optimizer)


@dataclass(frozen=True)
class ConcreteProfile:
    nodes: Mapping[str, NodeCost]
    params: Mapping[str, ParamCost]
    optimizer: str = "adamw"  # added: the optimizer the profile priced (the memory model needs its step scratch)
