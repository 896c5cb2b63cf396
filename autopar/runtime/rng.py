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
(SPMD: same ops). The base seeds do not come from torch's default generator: DDP
loops seed that apart per rank for their data (nanoGPT's `torch.manual_seed(1337 +
rank)`, timm's `seed + rank`), and ranks holding the same replicated activation
would drop it with different masks (measured under a tensor-parallel plan with
dropout: two ranks' "global" losses differed at the first step, 5.537 and 5.504,
and the replicated layer norms parted). Activation checkpointing captures and
replays this generator with torch's (`capture_states`), so the recompute redraws
the forward's masks.

A random op forks one generator: the default generator of its input's device
(CPU, or that one CUDA device), which is the one it draws from. Forking every
visible GPU's at each dropout would cost a state copy per device per op, and
would initialise CUDA in CPU ranks of a GPU host.

    with fork_rng_for(Spec.parse("S(0)R"), mesh.coordinate, mesh.shape, device=x.device):
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


def _generator(device: torch.device) -> torch.Generator:
    """The default generator a random op on `device` draws from: CUDA's of that device, else the CPU's (meta and
    fake tensors draw nothing; a fake CUDA tensor may exist where CUDA was never initialised)."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _device_of(values: Sequence[Any]) -> torch.device:
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


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
def _fork_with_index(index: int, seed: int | None, device: torch.device) -> Iterator[None]:
    if seed is None:
        seed = int(torch.randint(0, _SEED_MOD - 1, (1,), dtype=torch.int64, generator=_masks).item())
    generator = _generator(device)
    state = generator.get_state()
    generator.manual_seed((seed + index * _GOLDEN) % _SEED_MOD)
    try:
        yield
    finally:
        generator.set_state(state)


@contextlib.contextmanager
def fork_rng_for(spec: Spec, coordinate: Sequence[int], mesh_shape: Sequence[int], seed: int | None = None,
                 device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the body under an RNG seeded for this rank's shard of an activation laid out as `spec`.

    `seed`: fixed base seed (tests); default: drawn from the random ops' generator.
    `device`: where the body's random op runs; only that device's default generator is forked, and it is
    restored on exit.
    """
    if len(spec.placements) != len(coordinate) or len(coordinate) != len(mesh_shape):
        raise ValueError(f"spec {spec}, coordinate {tuple(coordinate)} and mesh shape {tuple(mesh_shape)} must have one entry per mesh axis")
    with _fork_with_index(shard_index(spec, coordinate, mesh_shape), seed, torch.device(device)):
        yield


States = tuple[torch.Tensor, tuple[tuple[int, torch.Tensor], ...], torch.Tensor]


def capture_states(values: Sequence[Any] = ()) -> States:
    """The states `replay_states` restores: the CPU generator's, those of the CUDA devices `values`' tensors are on
    (as torch's checkpoint takes them), and the random ops' generator's."""
    devices = sorted({v.device.index or 0 for v in values if isinstance(v, torch.Tensor) and v.device.type == "cuda"})
    return (torch.get_rng_state(), tuple((d, torch.cuda.get_rng_state(d)) for d in devices), _masks.get_state())


@contextlib.contextmanager
def replay_states(states: States) -> Iterator[None]:
    """Run the body from captured generator states (activation checkpointing's recompute draws what the
    forward drew); the generators are restored on exit, so the recompute does not advance them."""
    cpu_state, device_states, masks_state = states
    current = _masks.get_state()
    with torch.random.fork_rng(devices=[d for d, _ in device_states]):
        torch.set_rng_state(cpu_state)
        for device, state in device_states:
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
    with _fork_with_index(index, None, _device_of(args)):
        return op(*args, **kwargs)
