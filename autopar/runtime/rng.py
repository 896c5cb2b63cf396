"""Random ops on sharded activations: the Megatron RNG rule.

Ranks that hold different shards of an activation must draw independent masks
(else every tensor-parallel or data-parallel shard is dropped in the same pattern);
ranks that hold the same replicated activation must draw identical ones (else the
replicas diverge). So the seed of a random op depends on this rank's coordinates
on exactly the mesh axes where the activation is Shard (Replicate and Partial axes
share the mask: dropout commutes with a sum only under one mask).

Each random op draws a fresh base seed from a generator of ours, then seeds a
forked RNG with (base seed, shard index), so masks change every step. That
generator is seeded alike on every rank when the first parallel module is made
(`agree_on_mask_seed`: rank 0's torch seed), and every rank advances it alike
(SPMD: same ops). The base seeds came from torch's default generator until the
twenty-eighth session; but DDP loops seed it apart per rank for their data
(nanoGPT's `torch.manual_seed(1337 + rank)`, timm's `seed + rank`), and then ranks
holding the same replicated activation dropped it with different masks: under a
tensor-parallel plan with dropout, two ranks' "global" losses differed at the
first step (5.537 and 5.504) and the replicated layer norms parted. Activation
checkpointing captures and replays this generator with torch's (`capture_states`),
so the recompute redraws the forward's masks.

    with fork_rng_for(Spec.parse("S(0)R"), mesh.coordinate, mesh.shape):
        y = torch.nn.functional.dropout(x, 0.1)

In generated code: `random_op(torch.ops.aten.native_dropout.default, ('1',), x, 0.1, True)`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.solver.spec import Shard, Spec

_SEED_MOD = 2**63
_GOLDEN = 0x9E3779B97F4A7C15  # odd, so index -> index * _GOLDEN mod 2**63 is a bijection: distinct shards, distinct seeds


def shard_index(spec: Spec, coordinate: Sequence[int], mesh_shape: Sequence[int]) -> int:
    """Row-major index of this rank's coordinates over the axes where `spec` is Shard (0 when replicated everywhere)."""
    index = 0
    for p, c, n in zip(spec.placements, coordinate, mesh_shape):
        if isinstance(p, Shard):
            index = index * n + c
    return index


def _devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


_masks = torch.Generator()  # the base seeds of random ops: alike on every rank (module docstring)
_masks_agreed = False


def agree_on_mask_seed(group: dist.ProcessGroup | None) -> None:
    """Seed the random ops' generator with rank 0's torch seed on every rank of `group` (a collective; once a
    process: later modules go on drawing from it)."""
    global _masks_agreed
    if _masks_agreed:
        return
    seed = torch.tensor([torch.initial_seed() % _SEED_MOD], dtype=torch.int64)
    if dist.is_initialized():
        dist.broadcast(seed, src=0, group=group)
    _masks.manual_seed(int(seed.item()))
    _masks_agreed = True


def masks_state() -> torch.Tensor:
    """The random ops' generator state (checkpoints carry it, so a resumed run draws the masks it would have)."""
    return _masks.get_state()


def set_masks_state(state: torch.Tensor) -> None:
    _masks.set_state(state)


@contextlib.contextmanager
def _fork_with_index(index: int, seed: int | None) -> Iterator[None]:
    if seed is None:
        seed = int(torch.randint(0, _SEED_MOD - 1, (1,), dtype=torch.int64, generator=_masks).item())
    with torch.random.fork_rng(devices=_devices()):
        torch.manual_seed((seed + index * _GOLDEN) % _SEED_MOD)
        yield


@contextlib.contextmanager
def fork_rng_for(spec: Spec, coordinate: Sequence[int], mesh_shape: Sequence[int], seed: int | None = None) -> Iterator[None]:
    """Run the body under an RNG seeded for this rank's shard of an activation laid out as `spec`.

    `seed`: fixed base seed (tests); default: drawn from the default generator.
    The default generator is restored (advanced by that one draw) on exit.
    """
    if len(spec.placements) != len(coordinate) or len(coordinate) != len(mesh_shape):
        raise ValueError(f"spec {spec}, coordinate {tuple(coordinate)} and mesh shape {tuple(mesh_shape)} must have one entry per mesh axis")
    with _fork_with_index(shard_index(spec, coordinate, mesh_shape), seed):
        yield


def capture_states() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The default generators' states (CPU, each CUDA device) and the random ops' one, for `replay_states`."""
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in _devices()], _masks.get_state()


@contextlib.contextmanager
def replay_states(states: tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Run the body from captured generator states (activation checkpointing's recompute draws what the
    forward drew); the generators are restored on exit, so the recompute does not advance them."""
    cpu_state, device_states, masks_state = states
    current = _masks.get_state()
    with torch.random.fork_rng(devices=_devices()):
        torch.set_rng_state(cpu_state)
        for device, state in zip(_devices(), device_states):
            torch.cuda.set_rng_state(state, device)
        _masks.set_state(masks_state)
        try:
            yield
        finally:
            _masks.set_state(current)


def random_op(op: Callable[..., Any], groups: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
    """`op(*args, **kwargs)` seeded per the Megatron rule, for generated code.

    `groups`: the c10d group names of the mesh axes (in mesh order) where the op's
    output is Shard; this rank's position in each group gives the shard index.
    Leave out Replicate and Partial axes: dropout of a partial sum equals the sum of
    the dropped terms only when every term uses the same mask.
    """
    index = 0
    for name in groups:
        if not isinstance(name, str):
            raise TypeError(f"random_op: groups must be c10d group names (str), got {groups!r}; pass mesh.group_name(axis) for each Shard axis")
        pg = _resolve_process_group(name)
        index = index * pg.size() + pg.rank()
    with _fork_with_index(index, None):
        return op(*args, **kwargs)
