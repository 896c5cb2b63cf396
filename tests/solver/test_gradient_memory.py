"""A parameter's gradient priced once, whichever problem prices it: against hand counts and the grouped problem.

A weight read through its transpose (`x @ w.t()` traces as `permute(w)` then `mm`) reaches the problem node by
node (`grouped=False`: `fixed_plan`, `explain`) as a view of its own. The view's backward receives the weight's
gradient, which the weight's terms price (its `grad_bytes`; re-gathered under ZeRO, the whole gradient beside
the matmul's step): the view carries none of its own, and the node-by-node price is the grouped problem's.
"""
from __future__ import annotations

import dataclasses

import torch

from autopar.profiler import profile
from autopar.solver.assemble import build_for
from autopar.solver.evaluate import evaluate
from autopar.solver.pinned import fixed_plan
from autopar.solver.plan import MemoryBreakdown, Plan
from autopar.solver.problem import Assignment
from autopar.tracer import trace
from tests.codegen.plans import cpu_mesh, greedy_plan

OUT, IN, BATCH = 64, 32, 8


class _Transposed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(OUT, IN))
        self.b = torch.nn.Parameter(torch.randn(OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w.t() + self.b).square().mean()


def _grouped_memory(traced, prof, mesh, plan: Plan) -> MemoryBreakdown:
    """`plan`'s decisions priced on the grouped problem (each class's option the one whose members' strategies are
    the plan's)."""
    built = build_for(traced, prof, mesh, None)
    g, by_node = built.grouping, {d.node: d for d in plan.nodes}
    zero = {p.node for p in plan.params if p.storage != p.use}
    choice, recompute, zeros = [], [], []
    for v, node in enumerate(built.problem.nodes):
        members = [m for c in g.classes[v] for m in g.clusters[c].members]
        choice.append(next(s for s in range(len(node.options))
                            if all(built.strategies[m][built.member_strategy(m, s)] == by_node[m].strategy for m in members)))
        recompute.append(node.recomputable and any(by_node[m].recompute for m in members))
        zeros.append(any(m in zero for m in members))
    return evaluate(built.problem, Assignment(tuple(choice), tuple(recompute), tuple(zeros)))[0]


def test_a_transposed_weight_has_its_gradient_priced_once():
    with torch.device("meta"):
        model, x = _Transposed(), torch.randn(BATCH, IN)
    traced = trace(model, (x,))
    mesh, prof = cpu_mesh((2,)), profile(traced)
    dp = {d.node: d.strategy for d in greedy_plan(traced, mesh, {name: "S(0)" for name in traced.input_names}).nodes}
    w_bytes, grad_bytes = OUT * IN * 4, (OUT * IN + OUT) * 4  # float32: every parameter's numel x 4
    built = build_for(traced, prof, mesh, None, grouped=False)
    views = [n for n in built.problem.nodes if n.name.startswith(("permute", "t"))]
    assert views, [n.name for n in built.problem.nodes]
    assert all(o.temp_bytes == 0 and o.grad_flow_bytes == 0 for n in views for o in n.options)

    replicated = fixed_plan(traced, prof, mesh, dp)
    assert replicated.memory.grads_bytes == grad_bytes
    assert replicated.memory == _grouped_memory(traced, prof, mesh, replicated)

    zero = fixed_plan(traced, prof, mesh, dp, zero_params=frozenset(traced.param_fqns.values()))
    assert zero.memory.grads_bytes == grad_bytes / 2  # each rank keeps its half
    # the matmul's step holds w re-gathered and its whole gradient beside its own (the output's gradient, a
    # rank's half batch), not a third copy for the transpose
    out_grad_bytes = BATCH // 2 * OUT * 4
    assert 2 * w_bytes <= zero.memory.temp_bytes <= 2 * w_bytes + out_grad_bytes, zero.memory.temp_bytes
    assert zero.memory == _grouped_memory(traced, prof, mesh, zero)


VOCAB, WIDTH = 512, 64  # the embedding far larger than the logits of a rank's 4 tokens


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(self.emb(ids)).flatten(0, 1), ids.flatten())


def test_a_tied_weights_later_use_holds_its_gradient_and_the_sum():
    """Backward runs the LM head's step first: the lookup's step makes a second whole gradient of the tied weight,
    and autograd sums the two (a third) into the one the plan keeps: two more, once the lookup's step is done. Stored ZeRO,
    each use's gradient is reduce-scattered first, and nothing whole is summed."""
    with torch.device("meta"):
        model, ids = _Tied(), torch.randint(0, VOCAB, (4, 2))
    traced = trace(model, (ids,))
    # the optimizer step's scratch one byte per parameter byte (foreach), under the summed gradients
    mesh, prof = dataclasses.replace(cpu_mesh((2,)), optimizer_foreach=True), profile(traced)
    dp = {d.node: d.strategy for d in greedy_plan(traced, mesh, {name: "S(0)" for name in traced.input_names}).nodes}
    w_bytes = VOCAB * WIDTH * 4
    built = build_for(traced, prof, mesh, None, grouped=False)
    names = [n.name for n in built.problem.nodes]
    summed = [e for e in built.problem.edges if e.accumulated_bytes is not None]
    weight = next(node for node, fqn in traced.param_fqns.items() if fqn in ("emb.weight", "head.weight"))
    assert [(names[e.src], names[e.dst]) for e in summed] == [(weight, "embedding")]

    replicated = fixed_plan(traced, prof, mesh, dp)
    assert replicated.memory.grads_bytes == w_bytes
    assert replicated.memory.temp_bytes == 2 * w_bytes
    assert replicated.memory == _grouped_memory(traced, prof, mesh, replicated)

    zero = fixed_plan(traced, prof, mesh, dp, zero_params=frozenset(traced.param_fqns.values()))
    assert 2 * w_bytes <= zero.memory.temp_bytes < 3 * w_bytes  # re-gathered and its whole gradient, no sum
    assert zero.memory == _grouped_memory(traced, prof, mesh, zero)
