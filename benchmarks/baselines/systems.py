"""The hand-written baselines a user would reach for, each measured on the live process group.

    fsdp_ac = build_system("fsdp", "gpt2", model, batch, ac=True)   # a Trainable, inside every rank

- ddp:  `DistributedDataParallel` over all ranks.
- fsdp: FSDP2 `fully_shard` per block and at the root on a 1-D mesh (ZeRO-3: parameters
  resharded after forward).
- tp:   Megatron tensor parallel (`tensor_parallel.py`) on the inner axis of a
  (world/tp, tp) mesh plus data parallel over the outer axis, with DDP's gradient
  all-reduce done by hand on one flat buffer (DDP itself does not take DTensor parameters).
`ac=True` wraps every block in `torch.utils.checkpoint` first (full activation
checkpointing, as torchtitan applies it: before sharding).

One reference, not a baseline: `global_loss_ddp` is DDP whose step also gives every rank
the global loss, the value autopar's module returns (DDP returns each rank's own): the
mean of the ranks' losses, all-reduced in the background from the forward's end until
backward ends, as autopar does it. It tells how much of a gap to DDP that one all-reduce is.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves, tree_map

from autopar.errors import AutoparError
from autopar.profiler.measure import block_paths, checkpoint_modules, make_optimizer
from autopar.tracer import split_sample_input

from benchmarks.baselines.measure import Trainable, plain_tensors
from benchmarks.baselines.tensor_parallel import apply_tensor_parallel

SYSTEMS = ("ddp", "fsdp", "tp")


def slice_batch(batch: Any, index: int, parts: int) -> Any:
    """Part `index` of `parts` of every tensor's dim 0 (the DDP convention: each replica its slice)."""
    def cut(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.shape[0] % parts:
            raise AutoparError(f"batch size {t.shape[0]} is not divisible by {parts} data-parallel ranks; pick --batch divisible by it")
        n = t.shape[0] // parts
        return t[index * n:(index + 1) * n].clone()
    return tree_map(cut, batch)


def _call(model: nn.Module, batch: Any) -> torch.Tensor:
    args, kwargs = split_sample_input(batch)
    out = model(*args, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.loss


def _allreduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup, size: int) -> None:
    """DDP's averaging all-reduce over the data-parallel group, as one flat bucket of local grads."""
    grads = plain_tensors(p.grad for p in params if p.grad is not None)
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def global_loss_ddp(model: nn.Module, batch: Any, optimizer: str = "adamw") -> Trainable:
    """DDP returning the global loss (the module docstring's reference). The mean of the ranks' mean losses
    is the global mean when every rank counts the same number of terms, as the benchmark's batches do."""
    module = DistributedDataParallel(copy.deepcopy(model))
    world = dist.get_world_size()
    local = slice_batch(batch, dist.get_rank(), world)

    def step() -> None:
        loss = _call(module, local)
        total = loss.detach() / world
        work = dist.all_reduce(total, async_op=True)
        loss.backward()
        work.wait()

    return Trainable("ddp+loss", step, make_optimizer(module, optimizer), lambda: _live(module, local))


def _live(module: nn.Module, local: Any) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers(), *(t for t in tree_leaves(local) if isinstance(t, torch.Tensor))]


def build_system(name: str, family: str, model: nn.Module, batch: Any, ac: bool = False, tp: int = 2,
                 optimizer: str = "adamw") -> Trainable:
    """Wrap a private copy of `model` as system `name` on the default process group."""
    model = copy.deepcopy(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    paths = block_paths(model)
    if ac:
        checkpoint_modules(model, paths)
    if name == "ddp":
        module = DistributedDataParallel(model)
        local = slice_batch(batch, rank, world)
        sync = None
    elif name == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for path in paths:
            fully_shard(model.get_submodule(path), mesh=mesh)
        module = fully_shard(model, mesh=mesh)
        local = slice_batch(batch, rank, world)
        sync = None
    elif name == "tp":
        if world % tp:
            raise AutoparError(f"--tp {tp} does not divide the world size {world}")
        dp = world // tp
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(family, [model.get_submodule(p) for p in paths], mesh["tp"])
        module = model
        local = slice_batch(batch, rank // tp, dp)  # ranks of one TP group share a batch slice
        params = list(model.parameters())
        sync = (lambda: _allreduce_grads(params, mesh.get_group("dp"), dp)) if dp > 1 else None
    else:
        raise AutoparError(f"unknown baseline {name!r}; choose one of {SYSTEMS}")
    opt = make_optimizer(module, optimizer)

    def step() -> None:
        _call(module, local).backward()
        if sync is not None:
            sync()

    return Trainable(f"{name}+ac" if ac else name, step, opt, lambda: _live(module, local))
