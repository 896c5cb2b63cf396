"""torch's `Join` with a parallel module: ranks with different numbers of batches train like one device on the
batches each step still has (`runtime.join`)."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.join import Join

from tests.codegen.harness import EPS, LR, classifier_case, loss_of, parallel_module

from autopar.runtime.join import JoinError
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh

BATCHES = (3, 1)  # rank 0 trains three steps, rank 1 one: it joins first and shadows two


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(count)]


def _rows(batch, lo: int, hi: int):
    return tuple(t[lo:hi] for t in batch)


def _one_device(model, steps: list[tuple]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """AdamW on one device, one step per (global) batch: the losses and the final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for batch in steps:
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_uneven(rank, world, pass_optimizer):
    model, sample, traced, data_parallel, _, _ = classifier_case()
    pm = parallel_module(model, sample, traced, data_parallel, ProcessMesh((2,)))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    batches = _batches(max(BATCHES) + 1)
    losses = []
    with Join([pm], **({"optimizer": opt} if pass_optimizer else {})):
        for batch in batches[:BATCHES[rank]]:
            opt.zero_grad()
            loss = loss_of(pm(*_rows(batch, 4 * rank, 4 * rank + 4)))
            loss.backward()
            opt.step()
            losses.append(loss.item())
    after_join = {n: p.detach().clone() for n, p in pm.named_parameters()}
    with torch.no_grad():  # out of the context, an evaluation is a plain forward again
        pm(*_rows(batches[-1], 4 * rank, 4 * rank + 4))
    # one more step on both ranks, out of the context: equal to one device's only if the optimizer came along
    opt.zero_grad()
    loss_of(pm(*_rows(batches[-1], 4 * rank, 4 * rank + 4))).backward()
    opt.step()
    return losses, after_join, {n: p.detach().clone() for n, p in pm.named_parameters()}


@pytest.mark.timeout(120)
def test_ranks_with_fewer_batches_join_and_the_steps_match_one_device():
    """Each step's global batch is the rows of the ranks that still have one: rank 1's rows only in the first."""
    model = classifier_case()[0]
    batches = _batches(max(BATCHES) + 1)
    steps = [torch.utils._pytree.tree_map(lambda *ts: torch.cat(ts), *[_rows(b, 4 * r, 4 * r + 4) for r in range(2) if k < BATCHES[r]])
             for k, b in enumerate(batches[:max(BATCHES)])]
    want_losses, want_joined = _one_device(model, steps)
    _, want_after = _one_device(classifier_case()[0], [*steps, batches[-1]])
    results = run_ranks(_train_uneven, 2, True, timeout_s=100)
    for rank, (losses, after_join, after) in enumerate(results):
        assert losses == pytest.approx(want_losses[:BATCHES[rank]], rel=1e-5), f"rank {rank}'s losses"
        for n, want in want_joined.items():
            torch.testing.assert_close(after_join[n], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {n} after Join: {m}")
            torch.testing.assert_close(after[n], want_after[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {n} a step later: {m}")


@pytest.mark.timeout(120)
def test_without_the_optimizer_an_early_rank_keeps_its_own_moments_and_says_so():
    """The parameters still come from the last rank to join; the early rank's AdamW moments are its own, so the
    next step parts the ranks: what the warning says."""
    from tests.codegen.harness import LogRecords

    def train(rank, world):
        records = LogRecords("autopar.runtime.join")
        losses, after_join, after = _train_uneven(rank, world, False)
        return after_join, after, records.messages

    (joined0, after0, said0), (joined1, after1, said1) = run_ranks(train, 2, timeout_s=100)
    assert all(torch.equal(joined0[n], joined1[n]) for n in joined0)  # the last joiner's parameters everywhere
    assert not all(torch.allclose(after0[n], after1[n]) for n in after0)  # and then they part
    assert said0 == [] and len(said1) == 1 and "Join([pm], optimizer=opt)" in said1[0]


def _accumulate_uneven(rank, world):
    model, sample, traced, data_parallel, _, _ = classifier_case()
    pm = parallel_module(model, sample, traced, data_parallel, ProcessMesh((2,)))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    batches = _batches(4)
    with Join([pm], optimizer=opt):
        for first, last in [(batches[0], batches[1]), (batches[2], batches[3])][:BATCHES[rank] if rank else 2]:
            opt.zero_grad()
            with pm.no_sync():  # DDP's accumulation idiom: the joined rank must not send buckets for this one
                loss_of(pm(*_rows(first, 4 * rank, 4 * rank + 4))).backward()
            loss_of(pm(*_rows(last, 4 * rank, 4 * rank + 4))).backward()
            opt.step()
    return {n: p.detach().clone() for n, p in pm.named_parameters()}


@pytest.mark.timeout(120)
def test_accumulation_under_no_sync_joins_like_one_device():
    """Two micro-batches a step, the first under `pm.no_sync()`: rank 0 takes two steps, rank 1 one."""
    model = classifier_case()[0]
    batches = _batches(4)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step, ranks in enumerate([(0, 1), (0,)]):
        opt.zero_grad()
        for micro in batches[2 * step:2 * step + 2]:
            model(*(torch.cat([micro[i][4 * r:4 * r + 4] for r in ranks]) for i in range(2))).backward()
        opt.step()
    for rank, got in enumerate(run_ranks(_accumulate_uneven, 2, timeout_s=100)):
        for n, p in model.named_parameters():
            torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {n}: {m}")


def _refused(rank, world, which):
    model, sample, traced, data_parallel, split_weight, tensor_parallel = classifier_case()
    plan = {"split_weight": split_weight, "tensor_parallel": tensor_parallel, "data_parallel": data_parallel}[which]
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((2,)))
    try:
        if which == "data_parallel":  # a plan Join takes, but an evaluation inside the context
            with Join([pm]), torch.no_grad():
                pm(*_rows(sample, 4 * rank, 4 * rank + 4))
        else:
            Join([pm])
    except JoinError as err:
        return str(err)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["split_weight", "tensor_parallel", "data_parallel"])
def test_what_a_joined_rank_cannot_shadow_is_refused_on_every_rank(which):
    said = run_ranks(_refused, 2, which, timeout_s=100)
    assert all(s is not None for s in said), said
    if which == "data_parallel":
        assert all("Evaluate outside the Join context" in s for s in said)
    else:
        what = {"split_weight": "a parameter stored split", "tensor_parallel": "exchanges activations"}[which]
        assert all(what in s and "same number of batches" in s for s in said), said


def test_a_slice_whose_backward_gathers_is_refused():
    """`local_slice` cuts this rank's rows without a collective, but its backward all-gathers the gradient (ViT's
    class token expanded over the batch, under a data-parallel plan): a joined rank could not stand in for that."""
    from torch import fx

    from autopar.runtime import collectives as C
    from autopar.runtime.join import _loss_groups

    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(C.local_slice, (x, 0, "0")))
    with pytest.raises(JoinError, match="local_slice.*a gradient gathered in backward"):
        _loss_groups(fx.GraphModule(torch.nn.Module(), graph))
