"""Train a zoo model parallelized by autopar; one process per device.

    torchrun --nproc_per_node 4 examples/train.py --model gpt2 --steps 10
    torchrun --nproc_per_node 4 examples/train.py --model llama --mesh 2x2 --memory-budget-mb 4

Gloo on CPU here, NCCL on GPUs unchanged. Every rank builds the same model (same
seed), `autopar.parallelize` keeps this rank's shards, and each rank feeds its
slice of every global batch (the DDP convention; `--input-layout replicate` feeds
the whole batch). Rank 0 prints the loss of each step: the global mean loss.
The batches are random tokens drawn from one seeded generator on every rank; with
`--fixed-batch` the model sees one batch over and over, and the loss falls fast.
With `--checkpoint DIR` the run resumes from the newest checkpoint in DIR when there is one
(model, optimizer, step, data and dropout generators; saved under any plan or world size)
and saves there after its last step, and every `--checkpoint-every` steps. Each save is a
new directory in DIR, published only once complete, and the newest `--keep-last` are kept:
a run killed in the middle of a save resumes from the checkpoint before it.

    torchrun --nproc_per_node 4 examples/train.py --steps 5 --checkpoint ckpt
    torchrun --nproc_per_node 2 examples/train.py --steps 10 --checkpoint ckpt   # steps 5-9
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

import autopar
from autopar.cli import mesh_shape
from autopar.model_file import import_model_file
from autopar.runtime.checkpoints import latest_checkpoint
from autopar.runtime.launch import init_from_env
from autopar.tracer import split_sample_input
from autopar.runtime.batch import batch_slice

EXAMPLES = Path(__file__).resolve().parent


def load_zoo(name: str) -> ModuleType:
    """Import examples/<name>.py by path (examples/ is not a package)."""
    path = EXAMPLES / f"{name}.py"
    if not path.exists():
        choices = sorted(p.stem for p in EXAMPLES.glob("*.py") if p.stem != "train")
        raise SystemExit(f"no model file {path}; choose --model from {choices}")
    return import_model_file(path)


def random_like(batch, gen: torch.Generator):
    """A fresh batch with the sample's shapes: integer tensors get tokens below the sample's max + 1."""
    def draw(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, generator=gen, dtype=t.dtype)
        high = int(t.max().item()) + 1
        return torch.randint(0, max(high, 1), t.shape, generator=gen, dtype=t.dtype)
    return pytree.tree_map(draw, batch)


def loop_state(step: int, gen: torch.Generator) -> dict:
    """What a resumed run needs besides the model and optimizer to continue as if never stopped: the next step,
    the batches' generator and the default generator (dropout's masks), the same on every rank."""
    return {"step": step, "data": gen.get_state(), "rng": torch.get_rng_state()}


def call(model, batch) -> torch.Tensor:
    args, kwargs = split_sample_input(batch)
    out = model(*args, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.loss  # Hugging Face models return an output object


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # every rank parses the same arguments: one message is enough
        if os.environ.get("RANK", "0") != "0":
            sys.exit(2)
        super().error(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", help="a zoo file in examples/ (gpt2, llama, bert, vit, mlp, hf_gpt2, hf_llama)")
    ap.add_argument("--size", default="tiny", help="model size preset of the zoo file (tiny trains in seconds on CPU)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8, help="GLOBAL batch size (divisible by the data-parallel degree)")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--mesh", type=mesh_shape, default=None, help="logical mesh shape, e.g. 2x2, as `autopar plan --mesh` (default: one axis over the world)")
    ap.add_argument("--memory-budget-mb", type=float, default=None, help="per-device budget for the solver (default: the hardware's memory)")
    ap.add_argument("--plan", default=None, help="a JSON plan file to use instead of solving")
    ap.add_argument("--input-layout", choices=("shard", "replicate"), default="shard")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--fixed-batch", action="store_true", help="train on one batch (overfit: the loss must fall)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--print-code", action="store_true", help="rank 0 prints the generated forward")
    ap.add_argument("--checkpoint", default=None,
                    help="a directory: resume from its newest checkpoint if it holds one; save to it after the last step")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps (0: after the last only)")
    ap.add_argument("--keep-last", type=int, default=2, help="checkpoints kept in --checkpoint, the newest")
    return ap.parse_args(argv)


def train(args: argparse.Namespace) -> list[float]:
    """Run the training loop on this rank; returns the loss of every step it ran."""
    rank, world_size, device = init_from_env()
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    mesh = args.mesh or (world_size,)

    zoo = load_zoo(args.model)
    torch.manual_seed(args.seed)  # same init and same dropout stream on every rank
    model, sample = zoo.build(batch_size=args.batch_size, seq_len=args.seq_len, size=args.size, device="cpu",
                              dropout=args.dropout, seed=args.seed)
    budget = args.memory_budget_mb * 2**20 if args.memory_budget_mb else None
    pm = autopar.parallelize(model.to(device), sample, mesh, memory_budget=budget, plan=args.plan,
                             input_layout=args.input_layout)
    del model  # the parallel module holds this rank's shards; the full model is no longer needed
    if rank == 0 and args.print_code:
        print(pm.code)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr)

    gen = torch.Generator().manual_seed(args.seed + 1)  # identical batches on every rank; each keeps its slice
    first_step = 0
    if args.checkpoint and latest_checkpoint(args.checkpoint):
        loop = loop_state(0, gen)  # what the loop needs beyond the model and optimizer
        loaded = pm.load_checkpoint(args.checkpoint, optimizer, extra=loop)
        first_step = loop["step"]
        gen.set_state(loop["data"])
        torch.set_rng_state(loop["rng"])
        if rank == 0:
            print(f"resumed from {loaded} at step {first_step}", flush=True)
    losses = []
    for step in range(first_step, args.steps):
        batch = sample if args.fixed_batch else random_like(sample, gen)
        if args.input_layout == "shard":
            batch = batch_slice(batch, rank, world_size)  # this rank's rows of the global batch, whatever the plan
        batch = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = call(pm, batch)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - start) * 1e3
        losses.append(loss.item())  # the global loss, identical on every rank
        if rank == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {step_ms:7.1f} ms", flush=True)
        every = args.checkpoint_every and (step + 1) % args.checkpoint_every == 0
        if args.checkpoint and (every or step + 1 == args.steps):
            pm.save_checkpoint(args.checkpoint, optimizer, extra=loop_state(step + 1, gen), keep_last=args.keep_last)
    return losses


if __name__ == "__main__":
    train(parse_args())
    dist.destroy_process_group()
