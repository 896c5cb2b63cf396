"""examples/train.py on gloo ranks trains exactly like one device (same init, same global batches),
also when it stops, checkpoints and resumes on another number of ranks."""
from __future__ import annotations

from pathlib import Path

import torch
from torch.testing import assert_close

from autopar.model_file import import_model_file

TRAIN_PY = Path(__file__).resolve().parents[2] / "examples" / "train.py"
ARGV = ["--model", "gpt2", "--size", "tiny", "--batch-size", "4", "--seq-len", "16"]


def _load_train():
    return import_model_file(TRAIN_PY)


train = _load_train()


def _run(rank: int, world_size: int, argv: list[str]) -> list[float]:
    return train.train(train.parse_args(argv))


def _reference(argv: list[str]) -> list[float]:
    """One device's losses over the loop's batches: the sample again and again, or the generator's draws."""
    args = train.parse_args(argv)
    torch.manual_seed(args.seed)
    model, sample = train.load_zoo("gpt2").build(batch_size=4, seq_len=16, size="tiny", device="cpu", dropout=0.0, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        loss = train.call(model, sample if args.fixed_batch else train.random_like(sample, gen))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_train_script_matches_single_device(spmd):
    argv = ARGV + ["--steps", "3", "--fixed-batch"]
    losses = spmd(_run, 2, argv, timeout_s=120)  # tracing a tiny GPT takes ~5 s per rank on a loaded 2-core box
    ref = _reference(argv)
    assert losses[0] == losses[1]  # every rank reports the same global loss
    assert_close(losses[0], ref, rtol=1e-5, atol=0)
    assert ref[-1] < ref[0]  # and it trains: the loss falls on a fixed batch


def test_train_script_resumes_on_another_world_size(spmd, tmp_path):
    """Two steps on 4 ranks with --checkpoint, then --steps 5 on 2 ranks from that checkpoint: the second run
    trains steps 2-4 only (the step count and the data generator come back with the model and optimizer),
    and all five losses are one device's over the same random batches."""
    checkpoint = ["--checkpoint", str(tmp_path / "ckpt")]
    first = spmd(_run, 4, ARGV + ["--steps", "2"] + checkpoint, timeout_s=120)
    second = spmd(_run, 2, ARGV + ["--steps", "5"] + checkpoint, timeout_s=120)
    assert len(first[0]) == 2 and len(second[0]) == 3
    assert_close(first[0] + second[0], _reference(ARGV + ["--steps", "5"]), rtol=1e-5, atol=0)


def test_a_resumed_run_with_dropout_takes_the_uninterrupted_runs_steps(spmd, tmp_path):
    """With dropout 0.1 (masks drawn from autopar's generator, which `pm.save_checkpoint` carries), 2 steps, a
    checkpoint and 2 more give the losses of 4 uninterrupted steps on the same 2 ranks, bit for bit."""
    argv = ARGV + ["--dropout", "0.1"]
    straight = spmd(_run, 2, argv + ["--steps", "4"], timeout_s=120)[0]
    checkpoint = ["--checkpoint", str(tmp_path / "ckpt")]
    first = spmd(_run, 2, argv + ["--steps", "2"] + checkpoint, timeout_s=120)[0]
    second = spmd(_run, 2, argv + ["--steps", "4"] + checkpoint, timeout_s=120)[0]
    assert first + second == straight
