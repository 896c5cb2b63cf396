"""runtime.checkpoint: a region's gradients equal the plain run's, and forward keeps only its inputs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.runtime.checkpoint import checkpointed, checkpointed_with_rng


def _region(pieces: list[torch.Tensor], weight: torch.Tensor, scale: float):
    """Reads a list (a split's pieces) and a non-tensor; returns a tuple with an int and an unused tensor."""
    h = torch.cat(pieces, dim=-1) @ weight
    return torch.tanh(h) * scale, h.shape[0], h.exp()


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g, requires_grad=True)
    w = torch.randn(6, 5, generator=g, requires_grad=True)
    return x, w


def test_gradients_equal_the_plain_runs_and_leave_through_the_inputs():
    x, w = _inputs()
    y, rows, _ = _region(list(x.split(3, dim=-1)), w, 0.5)
    (y.sum() * rows).backward()
    want = (x.grad.clone(), w.grad.clone())

    x, w = _inputs()
    hooked = []
    w.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad.clone()))
    y, rows, unused = checkpointed(_region, list(x.split(3, dim=-1)), w, 0.5)
    assert rows == 4 and unused.requires_grad
    (y.sum() * rows).backward()
    torch.testing.assert_close(x.grad, want[0], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, want[1], rtol=0, atol=0)
    assert len(hooked) == 1  # the parameter's gradient accumulates once, in the outer backward


def test_autograd_grad_through_a_region_returns_gradients_without_accumulating():
    x, w = _inputs()
    y, _, _ = _region([x], w, 2.0)
    want = torch.autograd.grad(y.sum(), w)[0]
    x, w = _inputs()
    y, _, _ = checkpointed(_region, [x], w, 2.0)
    got = torch.autograd.grad(y.sum(), w)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert w.grad is None and x.grad is None


def test_forward_saves_only_the_inputs():
    def count_saved(fn) -> int:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn()
        return len(saved)

    x, w = _inputs()
    assert count_saved(lambda: _region([x], w, 1.0)) > 2  # the matmul's operands, tanh's and exp's outputs
    # A region's first call with a pattern of inputs requiring grad runs it once with autograd on, to learn which
    # outputs require grad (what that run saves is freed as it returns); every later call saves only the inputs.
    # Not assumed done by another test: under xdist this one may be the first of its worker.
    checkpointed(_region, [x], w, 1.0)
    assert count_saved(lambda: checkpointed(_region, [x], w, 1.0)) == 2  # x and w


def _dropped(x: torch.Tensor, w: torch.Tensor):
    return F.dropout(x @ w, p=0.5, training=True)


def test_a_region_with_random_ops_redraws_the_forwards_masks_only_with_rng():
    def grads(runner) -> torch.Tensor:
        x, w = _inputs()
        torch.manual_seed(7)
        y = runner(_dropped, x, w) if runner else _dropped(x, w)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        return w.grad

    want = grads(None)
    torch.testing.assert_close(grads(checkpointed_with_rng), want, rtol=0, atol=0)
    assert not torch.equal(grads(checkpointed), want)  # without the states, backward draws new masks


def test_the_generators_advance_as_without_recompute():
    x, w = _inputs()
    torch.manual_seed(3)
    checkpointed_with_rng(_dropped, x, w).sum().backward()
    after = torch.rand(3)
    torch.manual_seed(3)
    _dropped(x, w)
    torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)


def test_the_recompute_runs_under_the_forwards_autocast():
    def grads(runner) -> torch.Tensor:
        x, w = _inputs()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = runner(_region, [x], w, 1.0)[0] if runner else _region([x], w, 1.0)[0]
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        return w.grad

    torch.testing.assert_close(grads(checkpointed), grads(None), rtol=0, atol=0)


def test_an_output_a_plain_run_computes_without_grad_does_not_require_grad():
    def stats(x: torch.Tensor, running: torch.Tensor):
        return x * 2, running.clone() * 0.9  # the second: a running statistic, no gradient
    x, _ = _inputs()
    running = torch.ones(6)
    for _ in range(2):  # the first call learns which outputs carry gradients, the second reuses that
        y, new_running = checkpointed(stats, x, running)
        assert y.requires_grad and not new_running.requires_grad
        # an op that may not differentiate its argument accepts it (batch norm's running_var)
        torch.ops.aten._native_batch_norm_legit_functional(y.view(1, 4, 6).transpose(1, 2), None, None,
                                                          new_running, new_running, True, 0.1, 1e-5)
