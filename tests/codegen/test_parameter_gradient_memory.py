"""A sharded parameter's whole gradient is priced: rank 0 of an 8-device step never holds more than the plan says.

A parameter stored sharded (ZeRO, or split and all-gathered on its way into a data-parallel matmul) is whole
while its consumer's backward runs, and so is the gradient that backward makes of it, until the reduce-scatter
shards it. With a tied vocabulary-sized embedding that is two whole embeddings beside the logits' gradient:
on 64 devices GPT-2 medium's step held 19% more than its plan predicted (`benchmarks/simulate_memory_large.py`).
Here a small GPT-2 whose tied embedding dominates (vocabulary 8192, width 128, 16 tokens a rank) runs rank 0's
step of three recomputed plans under torch's fake process group (`benchmarks/simulate_memory.simulate_step`,
equal to the measured peak to 2% in `test_memory.py`), and the plan's prediction must cover the simulated peak,
with at most 15% above it (11% here: the gradients' shards and every saved activation are counted through the
step, which the simulation sets to None between steps and backward frees as it goes). Priced node by node
(`fixed_plan`), a parameter's transpose is a node of its own, which carries no gradient of its own: the
parameter's whole gradient is priced at the matmul's step, as the grouped problem prices it.
"""
from __future__ import annotations

import pytest
import torch

from autopar.profiler import profile
from autopar.solver.pinned import fixed_plan
from autopar.solver.spec import Spec
from autopar.solver.strategies import enumerate_strategies
from autopar.tracer.nodes import module_path
from benchmarks.simulate_memory import simulate_step
from examples.gpt2 import GPT, GPTConfig
from tests.codegen.harness import trace_model
from tests.codegen.plans import cpu_mesh, greedy_plan

MARGIN = 0.15  # the prediction's most above the simulated peak (see the module docstring)


def _model():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=8192, block_size=64)).train()
    ids = torch.randint(0, 8192, (8, 16))
    return model, {"input_ids": ids, "labels": torch.randint(0, 8192, (8, 16))}


def _plans(traced):
    mesh = cpu_mesh((8,))
    prof = profile(traced)
    dp = {d.node: d.strategy for d in greedy_plan(traced, mesh, {name: "S(0)" for name in traced.input_names}).nodes}
    # the 2-D weights stored split on their first dim and all-gathered on the edge into the same matmuls
    strategies = enumerate_strategies(traced, mesh)
    split = dict(dp)
    for node in traced.graph.find_nodes(op="placeholder"):
        if node.name in traced.param_fqns and node.meta["val"].ndim == 2:
            split[node.name] = next(s for s in strategies[node.name] if s.output_specs[0] == Spec.parse("S(0)"))
    blocks = frozenset(n.name for n in traced.graph.nodes if n.op == "call_function" and module_path(n).startswith("transformer.h."))
    everything = frozenset(traced.param_fqns.values())
    return {
        "zero+recompute": fixed_plan(traced, prof, mesh, dp, recompute=blocks, zero_params=everything),
        "split+recompute": fixed_plan(traced, prof, mesh, split, recompute=blocks),
        "zero+recompute lm_head": fixed_plan(traced, prof, mesh, dp, zero_params=everything, recompute=blocks | frozenset(
            n.name for n in traced.graph.nodes if n.op == "call_function" and module_path(n) == "lm_head")),
    }


@pytest.mark.timeout(120)
def test_the_prediction_covers_the_step_of_a_sharded_tied_embedding():
    model, sample = _model()
    traced = trace_model(model, sample)
    for name, plan in _plans(traced).items():
        assert plan.recomputed() and any(p.storage != Spec.parse("R") for p in plan.params), name
        predicted, simulated = plan.memory.total_bytes, simulate_step(model, sample, plan).peak_bytes
        assert simulated <= predicted <= (1 + MARGIN) * simulated, (name, predicted, simulated)
