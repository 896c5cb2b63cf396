"""`profile_table`: a profile rolled up per layer, the rows `autopar profile` prints."""
from __future__ import annotations

from dataclasses import dataclass

from autopar.profiler.memory import block_of
from autopar.profiler.types import GraphProfile
from autopar.tracer import TracedGraph, module_path


@dataclass(frozen=True)
class ProfileRow:
    module: str  # a repeated block ("transformer.h.3"), else the innermost module path ("" = top level)
    fwd_flops: float
    bwd_flops: float
    activation_bytes: float  # kept for backward: saved outputs of the row's nodes + their extra saved tensors
    param_bytes: float


def profile_table(traced: TracedGraph, profile: GraphProfile, **sizes: int) -> list[ProfileRow]:
    """One row per layer, in graph order, at concrete `sizes` (e.g. batch=8, seq=1024)."""
    cost = profile.evaluate(**sizes)
    rows: dict[str, list[float]] = {}
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.name not in cost.nodes:
            continue
        key = block_of(node) or module_path(node)
        c = cost.nodes[node.name]
        row = rows.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        row[0] += c.fwd_flops
        row[1] += c.bwd_flops
        row[2] += sum(b for b, s in zip(c.output_bytes, c.saved_outputs) if s) + c.extra_saved_bytes
    for fqn, p in cost.params.items():
        owner = max((k for k in rows if k and (fqn == k or fqn.startswith(k + "."))), key=len, default=None)
        if owner is None:
            owner = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        rows.setdefault(owner, [0.0, 0.0, 0.0, 0.0])[3] += p.param_bytes
    return [ProfileRow(k, *v) for k, v in rows.items()]
