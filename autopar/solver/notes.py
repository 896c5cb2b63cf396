"""What a plan's report tells the user beyond the plan itself (`Plan.notes`): limits of the model that the plan
had to work around, and what would lift them.

    notes = plan_notes(traced, mesh)

Strategies split a dim only where it divides evenly over the mesh axes (`solver.spec`). GPT-2's vocabulary
of 50,257 rows divides by no axis, so its embedding, LM head and loss cannot be split by vocabulary at all;
Megatron pads the vocabulary to a multiple of 128 per tensor-parallel rank, nanoGPT pads GPT-2's to 50,304.
autopar does not pad the model (that changes it: the extra rows' logits enter the softmax), so the report
says so and names the size that would split.

An op with no sharding rule (ours or DTensor's) runs replicated on every device, its inputs gathered: the log
warns once a process, and the plan names the op and the user's line, so a saved plan shows it too.
"""
from __future__ import annotations

import math

import torch

from autopar.solver.mesh import Mesh
from autopar.solver.strategies import replicated_ops
from autopar.tracer import TracedGraph
from autopar.tracer.source_lines import node_line

# A table smaller than this many rows per device is no vocabulary worth splitting (BERT's two token types)
_MIN_ROWS_PER_DEVICE = 64
# Pad to a multiple of 128 rows (Megatron's `make_vocab_size_divisible_by`), and of every device count
_PAD_ROWS = 128


def plan_notes(traced: TracedGraph, mesh: Mesh) -> tuple[str, ...]:
    """After `enumerate_strategies(traced, mesh)` (what the solver runs first)."""
    return tuple(_uneven_vocabulary(traced, mesh) + _replicated(traced, mesh))


def _replicated(traced: TracedGraph, mesh: Mesh) -> list[str]:
    notes = []
    for op, (why, nodes) in replicated_ops(traced.graph, mesh.shape).items():
        where = node_line(nodes[0]) + (f" and {len(nodes) - 1} more" if len(nodes) > 1 else "")
        notes.append(f"{op} ({where}) has {why}: it runs replicated, its inputs gathered whole on every device")
    return notes


def _uneven_vocabulary(traced: TracedGraph, mesh: Mesh) -> list[str]:
    """Each token table (an embedding looked up with the user's ids, not positions made by `arange`) whose rows
    a mesh axis does not divide."""
    from_inputs = _computed_from_inputs(traced)
    notes = []
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.embedding.default:
            continue
        weight, ids = node.args[0], node.args[1]
        if weight.name not in traced.param_fqns or ids.name not in from_inputs:
            continue
        rows = weight.meta["val"].shape[0]
        uneven = [a for a in mesh.axes if a.size > 1 and rows % a.size]
        if not uneven or rows < _MIN_ROWS_PER_DEVICE * mesh.num_devices:
            continue
        multiple = math.lcm(_PAD_ROWS, mesh.num_devices)
        padded = -(-rows // multiple) * multiple
        axes = " or ".join(f"{a.name}={a.size}" for a in uneven)
        notes.append(
            f"{traced.param_fqns[weight.name]} has {rows} rows, which do not split over {axes}: the embedding, and "
            f"an LM head and loss reading it, cannot be split by vocabulary. A vocabulary padded to {padded} rows (a "
            f"multiple of {multiple}) would split; that changes the model (the extra rows' logits enter the softmax, "
            f"as in nanoGPT's 50304 for GPT-2), so it is yours to make.")
    return notes


def _computed_from_inputs(traced: TracedGraph) -> set[str]:
    """Names of the user inputs and of every node computed from one."""
    out = set(traced.input_names)
    for node in traced.graph.nodes:
        if any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out
