"""examples/train.py on 2 gloo ranks trains exactly like one device (same init, same global batch)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch.testing import assert_close

from autopar.model_file import import_model_file

TRAIN_PY = Path(__file__).resolve().parents[2] / "examples" / "train.py"
ARGV = ["--model", "gpt2", "--size", "tiny", "--steps", "3", "--batch-size", "4", "--seq-len", "16", "--fixed-batch"]


def _load_train():
    return import_model_file(TRAIN_PY)


train = _load_train()


def _run(rank: int, world_size: int) -> list[float]:
    return train.train(train.parse_args(ARGV))


def _reference() -> list[float]:
    args = train.parse_args(ARGV)
    torch.manual_seed(args.seed)
    model, sample = train.load_zoo("gpt2").build(batch_size=4, seq_len=16, size="tiny", device="cpu", dropout=0.0, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        loss = train.call(model, sample)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_train_script_matches_single_device(spmd):
    losses = spmd(_run, 2, timeout_s=120)  # tracing a tiny GPT takes ~5 s per rank on a loaded 2-core box
    ref = _reference()
    assert losses[0] == losses[1]  # every rank reports the same global loss
    assert_close(losses[0], ref, rtol=1e-5, atol=0)
    assert ref[-1] < ref[0]  # and it trains: the loss falls on a fixed batch
