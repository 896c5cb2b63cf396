"""Optimizers that would not step the parallel module as one device steps the model, refused.

    pm = ParallelModule(...)                        # calls watch_optimizers()
    torch.optim.Adafactor(pm.parameters()).step()   # OptimizerError if some parameter is a rank's block
    torch.optim.AdamW(model.parameters()).step()    # OptimizerError: the model's, not the module's (`replaced`)

A parallel module's parameters are this rank's blocks of the full parameters
where the plan shards them (tensor parallel, ZeRO). An elementwise optimizer
(SGD, Adam, AdamW, ...: each element's update reads that element's gradient
and state) steps a block exactly as one device steps those elements. One that
reads the parameter as a whole does not: Adafactor's row and column means of
the squared gradient, Muon's orthogonalised matrix would be the block's, and
the parameters would drift from one device's without an error. So every
optimizer's step is checked (torch's global step pre-hook) before it changes
anything: torch's whole-parameter optimizers are refused on blocks, naming the
parameters and the plan that keeps them whole (`optimizer="adafactor"` or
`"muon"` in `parallelize`); an optimizer class this module does not know steps
with a warning, once per class.

An optimizer's own `state_dict()` holds this rank's blocks of the split
parameters' state (Adam's moments of rank 0's rows, on rank 0). A DDP loop
saves it on rank 0 and loads it on every rank: rank 1 then resumed with rank
0's moments for its rows, whose shapes are the same, and trained on from
there, silently. So each split parameter's entry of `state_dict()` is marked
with the block it holds (`BLOCK_KEY`), and a step after a load checks that
every loaded mark is this rank's block, naming the fix otherwise. autopar's
own optimizer-state functions gather or split the state, and drop the marks.

torch's `ZeroRedundancyOptimizer` steps each parameter on one rank and
broadcasts it: on split parameters every rank's block would become the
stepping rank's. It is refused where a parameter is split (a plan that splits
none steps with it as DDP does).

An optimizer made from the model's parameters before `parallelize` (which DDP
allows: its parameters are the model's own) holds tensors the parallel module
does not train: they never get a gradient, and every step changed nothing,
silently. Its first step is refused, naming the fix. The verdict is kept per
optimizer and checked again when its parameter counts or the live modules
change, so a step pays a lookup.
"""
from __future__ import annotations

import itertools
import sys
import logging
import weakref
import zlib
from typing import AbstractSet, Any, Iterator, Mapping, Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import AutoparError
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.rng import shard_index
from autopar.solver.spec import Shard, Spec

log = logging.getLogger(__name__)

_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
                torch.optim.Rprop, torch.optim.SparseAdam)
# what each of torch's whole-parameter optimizers reads, and the `parallelize` optimizer that plans for it
_WHOLE = {torch.optim.Adafactor: ("row and column means of each matrix's squared gradient", "adafactor"),
          torch.optim.Muon: ("the whole matrix, orthogonalised", "muon"),
          torch.optim.LBFGS: ("dot products over every parameter at once", None)}


class OptimizerError(AutoparError):
    """An optimizer would step a parallel module's shards otherwise than one device steps the parameters."""


class ShardedModule(Protocol):
    """A module whose parameters are local blocks (`ParallelModule`), as this check reads it."""

    mesh: ProcessMesh
    equal_blocks: AbstractSet[str]  # split parameters whose blocks are alike by design (`_check_drawn_apart`)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def param_storage(self) -> Mapping[str, Spec]: ...


_MODULES: weakref.WeakValueDictionary[int, ShardedModule] = weakref.WeakValueDictionary()
_ORDER = itertools.count()
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple] = weakref.WeakKeyDictionary()
_warned: set[type] = set()
# parameters of models a parallel module replaced, by id (a WeakSet would compare tensors with ==)
_REPLACED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_handle = None
# each split parameter's entry in an optimizer's `state_dict()`: which block of which parameter it holds
BLOCK_KEY = "autopar_block"
_marking: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers whose state_dict() marks blocks


def watch_optimizers(module: ShardedModule) -> None:
    """Check every optimizer step against `module`'s shards from now on (installs the hook once)."""
    global _handle
    _MODULES[next(_ORDER)] = module
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # how many parameters it steps and the modules they could be blocks of: a verdict holds while neither changes
    key = (tuple(len(group["params"]) for group in optimizer.param_groups), tuple(_MODULES.keys()))
    if _checked.get(optimizer) != key:
        _check(optimizer)
        _checked[optimizer] = key


def replaced(model: torch.nn.Module, module: torch.nn.Module) -> None:
    """Note that `module` trains its own tensors in place of `model`'s parameters (`parallelize`'s model)."""
    own = {id(p) for p in module.parameters()}
    _REPLACED.update((id(p), p) for p in model.parameters() if id(p) not in own)


def _check(optimizer: torch.optim.Optimizer) -> None:
    kind = type(optimizer)
    stale = [p for group in optimizer.param_groups for p in group["params"] if _REPLACED.get(id(p)) is p]
    if stale and all(p.grad is None for p in stale):
        # made before `parallelize` (DDP's parameters are the model's own; these are not the module's)
        raise OptimizerError(
            f"{kind.__name__} holds {len(stale)} parameters of the model given to parallelize, not the parallel "
            "module's: the parallel module trains its own tensors (this rank's shards), so these get no gradient "
            "and the step would change nothing. Make the optimizer after parallelize, from pm.parameters() (a "
            "saved optimizer state loads with pm.load_optimizer_state_dict(optimizer, state))")
    blocks = _blocks()
    _check_loaded_blocks(optimizer, blocks)
    _check_scaler(optimizer, blocks)
    _check_drawn_apart(optimizer, blocks)
    if isinstance(optimizer, _ELEMENTWISE):
        return
    stepped = [blocks[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in blocks]
    if not stepped:
        return
    shown = ", ".join(f"{fqn} (split on {how})" for fqn, how, _ in stepped[:3]) + (", ..." if len(stepped) > 3 else "")
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise OptimizerError(
            f"ZeroRedundancyOptimizer steps each parameter on one rank and broadcasts it to the others, but "
            f"{len(stepped)} of its parameters are this rank's blocks of the full parameters: {shown}. Every rank's "
            "block would become the stepping rank's (measured: rank 1's block of a split weight 0.65 off after two "
            "steps). Nothing was stepped. Use the optimizer it wraps directly: a plan stores optimizer state split "
            "(ZeRO) itself where the memory budget needs it")
    whole = next((_WHOLE[c] for c in kind.__mro__ if c in _WHOLE), None)
    if whole is not None:
        reads, planned = whole
        fix = (f"Parallelize with optimizer={planned!r}, whose plan keeps every parameter whole, or use" if planned
               else f"autopar plans no optimizer of {kind.__name__}'s kind: use")
        raise OptimizerError(
            f"{kind.__name__} reads {reads}, but {len(stepped)} of the parameters it steps are this rank's blocks of "
            f"the full parameters: {shown}. Each rank would update its block from the block alone, unlike one "
            f"device. Nothing was stepped. {fix} an elementwise optimizer (SGD, Adam, AdamW, ...)")
    if kind not in _warned and (not dist.is_initialized() or dist.get_rank() == 0):
        _warned.add(kind)
        log.warning("optimizers: %s steps %d parameters that are this rank's blocks of the full parameters (%s): it "
                    "matches one device only if each element's update reads that element's gradient and state alone "
                    "(as SGD's and AdamW's do). If it reads norms or statistics of a parameter (LAMB, Shampoo), "
                    "parallelize with optimizer='adafactor' or 'muon', whose plans keep every parameter whole",
                    kind.__name__, len(stepped), shown)


def _blocks() -> dict[int, tuple[str, str, int]]:
    """id of each watched module's parameter that is a block of a larger one -> (its FQN, how it is split, the
    mark of the block this rank holds)."""
    out = {}
    for _, module in sorted(_MODULES.items()):
        storage, mesh = module.param_storage(), module.mesh
        for fqn, p in module.named_parameters():
            spec = storage.get(fqn)
            split = [f"dim {pl.dim} over {name}" for pl, name, size in zip(spec.placements, mesh.axis_names, mesh.shape)
                     if isinstance(pl, Shard) and size > 1] if spec is not None else []
            if split:
                how = ", ".join(split)
                out[id(p)] = (fqn, how, _mark(f"{fqn} {spec} {mesh.shape}", shard_index(spec, mesh.coordinate, mesh.shape)))
    return out


def _mark(parameter: str, block: int) -> int:
    """An integer (torch's optimizer load casts the items of a string or tuple, not an int): which parameter,
    split how, and which block of it."""
    return zlib.crc32(parameter.encode()) * _BLOCKS + block


_BLOCKS = 1 << 20  # more blocks than ranks


def _check_loaded_blocks(optimizer: torch.optim.Optimizer, blocks: Mapping[int, tuple[str, str, int]]) -> None:
    """Refuse a step from state another rank's `state_dict()` held; from now on mark this optimizer's."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [(blocks[id(p)], optimizer.state[p][BLOCK_KEY]) for p in params
               if id(p) in blocks and optimizer.state.get(p, {}).get(BLOCK_KEY, blocks[id(p)][2]) != blocks[id(p)][2]]
    if foreign:
        (fqn, how, mine), theirs = foreign[0]
        whose = (f"block {theirs % _BLOCKS}" if theirs // _BLOCKS == mine // _BLOCKS
                 else "a block of another parameter, split, or mesh")
        raise OptimizerError(
            f"{type(optimizer).__name__}'s state for {len(foreign)} split parameters was saved by another rank: for "
            f"{fqn} (split on {how}) this rank holds block {mine % _BLOCKS}, and the loaded state is {whose}'s. An "
            "optimizer's own state_dict() holds its rank's blocks; loaded on every rank from one rank's file, the "
            "other ranks would step with the wrong rows' moments. Nothing was stepped. Save with "
            "pm.optimizer_state_dict(optimizer) on every rank (full tensors: then `if rank == 0: torch.save(...)`) and "
            "load with pm.load_optimizer_state_dict(optimizer, state), or use pm.save_checkpoint / pm.load_checkpoint")
    if blocks and optimizer not in _marking:
        _marking.add(optimizer)
        optimizer.register_state_dict_post_hook(_mark_blocks)
        optimizer.register_load_state_dict_post_hook(lambda opt: _checked.pop(opt, None))  # check its next step


def _check_scaler(optimizer: torch.optim.Optimizer, blocks: Mapping[int, tuple[str, str, int]]) -> None:
    """Refuse a plain `GradScaler` stepping split parameters.

    It skips the step when this rank's gradients hold an inf or NaN. A split parameter's gradient is a
    different block on each rank, so an overflow in one rank's block skipped the step there and not on
    the others (their scales then differ too), and the replicated parameters parted for good, silently.
    torch's `ShardedGradScaler` all-reduces the flag. The scaler is the caller of this step: torch's
    `GradScaler._maybe_opt_step` calls `optimizer.step()`, and its wrapper runs this hook."""
    caller = sys._getframe(1)
    for _ in range(8):  # this hook, _before_step, torch's hook loop and step wrapper, then the scaler
        caller = caller.f_back
        if caller is None:
            return
        scaler = caller.f_locals.get("self")
        if isinstance(scaler, torch.amp.GradScaler):
            break
    else:
        return
    if isinstance(scaler, ShardedGradScaler) or not any(id(p) in blocks for g in optimizer.param_groups for p in g["params"]):
        return
    raise OptimizerError(
        "GradScaler skips a step when this rank's gradients overflow, and the parallel module's split parameters' "
        "gradients are each rank's blocks: an overflow in one rank's block would skip the step on that rank only, "
        "and the ranks' parameters would part. Nothing was stepped. Use torch's ShardedGradScaler, which agrees on "
        "overflows across ranks: `from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler`, "
        "`scaler = ShardedGradScaler(process_group=torch.distributed.group.WORLD)`")


def alike_by_design(full: Mapping[str, torch.Tensor], storage: Mapping[str, Spec], mesh: ProcessMesh) -> set[str]:
    """The split parameters among `full` (whole tensors by FQN, as `parallelize` got them) whose blocks under
    `storage` are copies of one another already: Mamba's `A_log`, whose rows are alike by construction, split by
    rows. The first step's check (`_check_drawn_apart`) leaves them out. Agreed by every rank (one all-reduce on
    the CPU group): the check is a collective, and each rank must leave out the same ones."""
    split = sorted(fqn for fqn, spec in storage.items() if fqn in full and not full[fqn].is_meta and
                   any(isinstance(p, Shard) and n > 1 for p, n in zip(spec.placements, mesh.shape)))
    if not split or not dist.is_initialized():
        return set()
    alike = torch.tensor([_blocks_alike(full[fqn].detach(), storage[fqn], mesh.shape) for fqn in split], dtype=torch.int32)
    dist.all_reduce(alike, op=dist.ReduceOp.MIN, group=mesh.cpu_group)
    return {fqn for fqn, same in zip(split, alike.tolist()) if same}


def _blocks_alike(full: torch.Tensor, spec: Spec, mesh_shape: tuple[int, ...]) -> bool:
    """Whether every block of `full` split as `spec` over `mesh_shape` holds the same values."""
    blocks = [full]
    for p, n in zip(spec.placements, mesh_shape):
        if isinstance(p, Shard) and n > 1:
            blocks = [chunk for b in blocks for chunk in b.chunk(n, p.dim)]
    return all(torch.equal(blocks[0], b) for b in blocks[1:])


def _check_drawn_apart(optimizer: torch.optim.Optimizer, blocks: Mapping[int, tuple[str, str, int]]) -> None:
    """Refuse a first step from split parameters whose blocks are copies of one another.

    An init loop over the module's parameters (`for p in pm.parameters(): nn.init.normal_(p)`, nanoGPT's
    scaling of its residual projections) draws each rank's block alone, from the random numbers every rank
    shares: the blocks come out equal, and a split weight is its first block repeated, its neurons in
    lockstep for good. A collective (every rank steps): each rank's sum and 2-norm of each split
    parameter, compared between ranks holding different blocks (one all-gather on the CPU group); blocks of
    one value (zeros, ones) are equal by design and pass, and so do the parameters a module expects alike
    (`equal_blocks`: those whose full tensor had them so when parallelized, and those the caller names)."""
    by_design = {id(p) for _, module in sorted(_MODULES.items()) for fqn, p in module.named_parameters()
                 if fqn in module.equal_blocks}
    stepped = [(p, blocks[id(p)]) for group in optimizer.param_groups for p in group["params"]
               if id(p) in blocks and id(p) not in by_design]
    if not stepped or not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    with torch.no_grad():  # per parameter: its block's index, sum, 2-norm and whether it holds more than one value
        mine = torch.stack([torch.stack([torch.tensor(float(mark % _BLOCKS), dtype=torch.float64, device=p.device),
                                         p.sum(dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64),
                                         (p.amax() > p.amin()).to(torch.float64)])
                            for p, (_, _, mark) in stepped]).cpu()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine, group=next(iter(_MODULES.values())).mesh.cpu_group)  # on the CPU: gloo
    per_param = torch.stack(every, dim=1).tolist()  # [parameter][rank] -> [block, sum, norm, varied]
    alike = []
    for (_, (fqn, how, _)), ranks in zip(stepped, per_param):
        seen = {block: (total, norm, varied) for block, total, norm, varied in ranks}
        if len(seen) > 1 and len({v[:2] for v in seen.values()}) == 1 and all(v[2] for v in seen.values()):
            alike.append(f"{fqn} (split on {how})")
    if alike:
        raise OptimizerError(
            f"{len(alike)} split parameters hold the same values in every rank's block: {', '.join(alike[:3])}"
            f"{', ...' if len(alike) > 3 else ''}. They were set on the blocks alone, each rank drawing from the "
            "same random numbers (an init loop over pm.parameters()), so each is its first block repeated. Nothing "
            "was stepped. Initialise the model before parallelize, or initialise through pm.apply(init_fn), which "
            "gives each module's function the whole tensors. If their blocks are alike by design (rows set equal "
            "after parallelize), say so before the first step: pm.expect_equal_blocks(name, ...)")


def _mark_blocks(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Mark each split parameter's entry of `state_dict` with the block it holds. torch numbers the parameters
    across the groups in order; the entries are the live state's dicts, so each is copied, not changed."""
    blocks = _blocks()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = state_dict["state"]
    for index, entry in list(state.items()):
        if isinstance(index, int) and id(params[index]) in blocks:
            state[index] = {**entry, BLOCK_KEY: blocks[id(params[index])][2]}
    return state_dict
