"""enumerate_strategies: API conventions, our own rules, fallback, the cache."""
from __future__ import annotations

import collections
import logging
import re

import pytest
import torch
from torch import fx

from autopar.solver.mesh import make_mesh
from autopar.solver.spec import Spec
from autopar.solver.strategies import _WARNED, enumerate_strategies, node_strategies, strategy_inputs
from autopar.solver.strategies.dtensor_adapter import dtensor_rules
from autopar.tracer import output_vals, trace

from tests.solver.test_strategies_numeric import load_example

aten = torch.ops.aten

MESH = make_mesh(4, (2, 2), "h100")


def _tiny_gpt2():
    model, sample = load_example("gpt2").build(batch_size=2, seq_len=8, size="tiny", device="meta")
    return trace(model, sample)


def test_conventions_on_tiny_gpt2():
    traced = _tiny_gpt2()
    strategies = enumerate_strategies(traced, MESH)
    for node in traced.graph.nodes:
        if node.op == "output":
            assert node.name not in strategies
            continue
        for s in strategies[node.name]:
            assert len(s.output_specs) == len(output_vals(node))
            if node.op == "placeholder":
                assert s.input_specs == () and not s.output_specs[0].has_partial()
            else:
                assert len(s.input_specs) == len(strategy_inputs(node))
        assert len(set(strategies[node.name])) == len(strategies[node.name])  # deduplicated
    # every even spec of a (256, 64) parameter without Partial: R, S(0), S(1) per axis -> 9
    wte = next(name for name, fqn in traced.param_fqns.items() if fqn == "transformer.wte.weight")
    assert len(strategies[wte]) == 9
    # SDPA: replicate, batch or heads per axis (3 x 3 = 9; batch 2 on both axes is uneven -> 8)
    sdpa = strategies["scaled_dot_product_attention"]
    assert {str(s.output_specs[0]) for s in sdpa} == {"RR", "RS(0)", "RS(1)", "S(0)R", "S(0)S(1)", "S(1)R", "S(1)S(0)", "S(1)S(1)"}
    # getitem mirrors its producer's output
    ln = strategies["native_layer_norm"]
    assert {s.output_specs[0] for s in strategies["getitem"]} == {s.output_specs[0] for s in ln}


def test_sum_over_all_dims_gives_partial():
    traced = _tiny_gpt2()
    strategies = enumerate_strategies(traced, make_mesh(2, (2,), "h100"))
    by = {str(s.input_specs[0]): str(s.output_specs[0]) for s in strategies["sum_2"]}
    assert by == {"R": "R", "S(0)": "P", "P": "P"}  # DTensor would say S(0) -> S(0) on a scalar


def test_unknown_op_falls_back_to_replicate_with_one_warning(caplog):
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(8, 8, device="meta")
    nodes = []
    for _ in range(2):  # cdist has no DTensor rule (and no rule of ours)
        n = g.call_function(torch.ops.aten._cdist_forward.default, (x, x, 2.0, None))
        n.meta["val"] = torch.empty(8, 8, device="meta")
        nodes.append(n)
    _WARNED.discard("aten._cdist_forward.default")
    with caplog.at_level(logging.WARNING):
        for n in nodes:
            assert node_strategies(n, (2,)) == (node_strategies(n, (2,))[0],)
            assert node_strategies(n, (2,))[0].input_specs == (Spec.parse("R"), Spec.parse("R"))
    assert sum("aten._cdist_forward.default" in r.message for r in caplog.records) == 1


def test_gpt2_small_enumerates_each_distinct_node_once(monkeypatch):
    import autopar.solver.strategies as strategies_module
    computed = []
    real_compute = strategies_module._compute
    monkeypatch.setattr(strategies_module, "_CACHE", {})  # cold, whatever ran before in this worker
    monkeypatch.setattr(strategies_module, "_compute", lambda node, mesh_shape: computed.append(node) or real_compute(node, mesh_shape))
    model, sample = load_example("gpt2").build(batch_size=2, seq_len=128, size="small", device="meta")
    traced = trace(model, sample)
    strategies = enumerate_strategies(traced, MESH)  # cold: layer 0 computes, layers 1-11 hit the cache
    cold = len(computed)
    again = enumerate_strategies(traced, MESH)  # e.g. the solver re-planning for another budget
    assert again == strategies
    assert len(computed) == cold  # the second enumeration computes nothing
    blocks = [re.search(r"\.h\.(\d+)\b", str(list(n.meta.get("nn_module_stack", {}).values())[-1:])) for n in computed]
    per_block = collections.Counter(int(m.group(1)) for m in blocks if m)
    assert per_block[0] > 10 and sum(per_block.values()) == per_block[0], per_block  # blocks 1-11 are layer 0's


def _rules(op, args) -> set[str]:
    """DTensor's strategies for `op` on a 2-device mesh through the adapter, as "(ins) -> outs" strings."""
    return {f"({', '.join(map(str, ins))}) -> {', '.join(map(str, outs))}" for ins, outs in dtensor_rules(op, args, {}, (2,))}


@pytest.mark.parametrize("shape, dims", [((4, 1, 6), [1]), ((4, 1, 6), [-2]), ((4, 1, 6, 1), [1, 3]), ((4, 1, 6), [0, 1])])
def test_squeeze_of_listed_dims_keeps_the_other_dims_split(shape, dims):
    """`squeeze.dims` (cross-entropy's decomposition makes one), which torch 2.11's DTensor has no rule for: the
    size-1 dims go, a split dim keeps its split under its new number (hand-derived), on every release."""
    x = torch.empty(shape, device="meta")
    assert _rules(aten.squeeze.dims, (x, dims)) == {"(R) -> R", "(P) -> P", "(S(0)) -> S(0)", "(S(2)) -> S(1)"}


def test_layer_norm_splits_its_three_outputs_as_its_input():
    """native_layer_norm's (out, mean, rstd) split along the batch or sequence dim as its input, its weight and bias
    replicated (torch 2.11's rule gives one spec for the three; 2.13's three)."""
    x, w = torch.empty(4, 8, 64, device="meta"), torch.empty(64, device="meta")
    assert {"(S(0), R, R) -> S(0), S(0), S(0)", "(S(1), R, R) -> S(1), S(1), S(1)"} <= _rules(
        aten.native_layer_norm.default, (x, [64], w, w, 1e-5))
