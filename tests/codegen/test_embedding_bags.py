"""A recommendation model's embedding bags, split by bags, by table rows or by table columns.

`nn.EmbeddingBag` over equal-length bags reaches the solver as an embedding lookup
and a reduction (`autopar.tracer.bags`), so its table can be sharded like any
embedding's. Every plan, random or the solver's, must train like one device.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.codegen.harness import LogRecords, check_cases, check_plan, random_plan_cases, reference, trace_model

import autopar
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.spec import Shard

ROWS = 4096  # the item table: 256 KiB, the model's largest tensor


class Recommender(nn.Module):
    """DLRM's shape: dense features through a bottom MLP, sparse ones through embedding bags (a weighted
    sum, a mean skipping padding), and a top MLP on both, trained for click-through."""

    def __init__(self, dim: int = 16, sparse: bool = False):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, dim))
        self.items = nn.EmbeddingBag(ROWS, dim, mode="sum", sparse=sparse)
        self.words = nn.EmbeddingBag(ROWS // 4, dim, mode="mean", padding_idx=0, sparse=sparse)
        self.top = nn.Sequential(nn.Linear(3 * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense, items, item_weights, words, clicked):
        bags = [self.items(items, per_sample_weights=item_weights), self.words(words)]
        h = torch.cat([self.bottom(dense), *bags], dim=1)
        return F.binary_cross_entropy_with_logits(self.top(h).squeeze(1), clicked)


def _sample(batch: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    words = torch.randint(0, ROWS // 4, (batch, 4), generator=g)
    words[0, :2] = 0  # padding
    return (torch.randn(batch, 8, generator=g), torch.randint(0, ROWS, (batch, 6), generator=g),
            torch.rand(batch, 6, generator=g), words, torch.randint(0, 2, (batch,), generator=g).float())


def _model(sparse: bool = False) -> Recommender:
    torch.manual_seed(0)
    return Recommender(sparse=sparse)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh_shape, plans", [((2,), 8), ((2, 2), 4)], ids=["2", "2x2"])
def test_random_plans_over_embedding_bags_match_one_device(mesh_shape, plans):
    model, sample = _model(), _sample()
    traced = trace_model(model, sample)
    lookups = [n.name for n in traced.graph.nodes if n.target is torch.ops.aten.embedding.default]
    assert len(lookups) == 2  # both bags split into lookup and reduction
    cases = random_plan_cases(model, sample, traced, mesh_shape, plans, seed=7)
    # among the plans, some split a table by rows (each rank looks up the rows it holds)
    assert any(isinstance(p, Shard) and p.dim == 0 for _, _, _, _, plan, _, _ in cases for d in plan.nodes
               if d.node in lookups for p in d.strategy.input_specs[0].placements)
    check_cases(mesh_shape, cases)


def _solver_plans(rank: int, world: int, budgets: list[float | None]) -> list[str]:
    """The solver's plan at each budget, trained one step against one device; the item table's lookup spec."""
    model, sample = _model(), _sample()
    traced, ref, mesh = trace_model(model, sample), reference(model, sample, 1), ProcessMesh((world,))
    specs = []
    for budget in budgets:
        pm = autopar.parallelize(model, sample, (world,), memory_budget=budget)
        check_plan(model, sample, traced, pm.plan, ref, 1, mesh, f"solver plan at {budget}")
        lookup = next(d for d in pm.plan.nodes if d.op == "aten.embedding.default" and d.module == "items")
        specs.append(str(lookup.strategy.input_specs[0]))
    return specs


@pytest.mark.timeout(240)
def test_a_tight_budget_shards_the_tables_by_rows():
    """With memory to spare the solver splits the item table by columns (the lookup's output is
    gathered, no table-sized gradient is all-reduced); at 950 KB, where a whole table's gradient and
    Adam state no longer fit (beside the AdamW step's scratch, two buffers of the largest block), by rows.
    (The least any plan needs is 940 KB; from 959 KB a plan keeping the columns split fits too, priced 1.2%
    slower: inside the search's 5% gap, either may be the answer there.) Both train like one device."""
    ample, tight = run_ranks(_solver_plans, 2, [None, 9.5e5])[0]
    assert ample == "S(1)" and tight == "S(0)", (ample, tight)


@pytest.mark.timeout(240)
def test_tables_with_sparse_gradients_train_like_their_dense_twin():
    """`sparse=True` tables stopped `parallelize` in the profiler (a sparse gradient has no storage). The
    tracer now gives them dense gradients, the same numbers: random plans of the sparse model's graph
    train like the same model with dense tables (AdamW, which takes no sparse gradients)."""
    sparse, dense, sample = _model(sparse=True), _model(), _sample()
    logs = LogRecords("autopar.tracer.sparse_grads")
    traced = trace_model(sparse, sample)
    assert sorted(m.split("`")[1] for m in logs.messages) == ["items", "words"]
    check_cases((2,), random_plan_cases(dense, sample, traced, (2,), 6, seed=3))


def _sgd_steps(rank: int, world: int, steps: int) -> dict[str, float]:
    """The sparse model under the solver's plan, trained with SGD and with Adagrad: the largest difference
    per parameter from the same model trained on one device with its sparse gradients. (Adagrad starts
    from an accumulator of 1: from 0 its first step is lr * sign(grad), which turns float noise in a
    gradient that is zero in exact arithmetic into a step of lr.)"""
    errors = {}
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.5),
                 lambda ps: torch.optim.Adagrad(ps, lr=0.5, initial_accumulator_value=1.0)):
        eager, sample = _model(sparse=True), _sample()
        pm = autopar.parallelize(_model(sparse=True), sample, (world,))
        eager_opt, opt = make(eager.parameters()), make(pm.parameters())
        for _ in range(steps):
            eager(*sample).backward()
            assert eager.items.weight.grad.is_sparse
            eager_opt.step()
            eager_opt.zero_grad()
            pm(*pm.local_batch(sample)).backward()
            opt.step()
            opt.zero_grad()
        full = pm.state_dict()
        for name, p in eager.named_parameters():
            errors[f"{type(opt).__name__} {name}"] = (full[name] - p.detach()).abs().max().item()
    return errors


@pytest.mark.timeout(240)
def test_sparse_tables_step_like_one_device_with_sgd_and_adagrad():
    errors = run_ranks(_sgd_steps, 2, 3)[0]
    assert len(errors) == 2 * len(list(_model().parameters()))
    assert max(errors.values()) < 1e-5, errors
