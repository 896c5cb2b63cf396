"""A loss torch cannot trace, computed outside the model on the parallel module's outputs.

`F.ctc_loss` does not export (its scratch is sized by the targets' values), and the tracer says to
compute it outside the model (`autopar.tracer.data_sizes`). Done so, each rank's loss over its rows,
divided by the number of ranks, is its term of the global mean: the gradients are one device's.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.runtime.launch import run_ranks

BATCH, FRAMES, LETTERS = 4, 6, 3


class Acoustic(nn.Module):
    """Frames to log-probabilities over a blank and 7 letters, as a speech model's CTC head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, frames):
        return self.body(frames).log_softmax(-1)


def _ctc(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    rows = log_probs.shape[0]
    return F.ctc_loss(log_probs.transpose(0, 1), targets, [FRAMES] * rows, [LETTERS] * rows)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randn(BATCH, FRAMES, 8, generator=g), torch.randint(1, 8, (BATCH, LETTERS), generator=g)


def _model() -> Acoustic:
    torch.manual_seed(0)
    return Acoustic()


def _grads_outside(rank: int, world: int) -> dict[str, torch.Tensor]:
    frames, targets = _data()
    pm = autopar.parallelize(_model(), (frames,), (world,))
    (local_frames,), local_targets = pm.local_batch((frames,)), pm.local_batch(targets)
    (_ctc(pm(local_frames), local_targets) / world).backward()  # this rank's term of the global mean
    return {name: p.grad for name, p in pm.named_parameters()}


@pytest.mark.timeout(240)
def test_ctc_computed_outside_the_model_gives_one_devices_gradients():
    model = _model()
    frames, targets = _data()
    _ctc(model(frames), targets).backward()
    for grads in run_ranks(_grads_outside, 2):
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
