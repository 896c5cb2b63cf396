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

An optimizer made from the model's parameters before `parallelize` (which DDP
allows: its parameters are the model's own) holds tensors the parallel module
does not train: they never get a gradient, and every step changed nothing,
silently. Its first step is refused, naming the fix. The verdict is kept per
optimizer and checked again when its parameter counts or the live modules
change, so a step pays a lookup.
"""
from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Iterator, Mapping, Protocol

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import AutoparError
from autopar.runtime.mesh import ProcessMesh
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

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def param_storage(self) -> Mapping[str, Spec]: ...


_MODULES: weakref.WeakValueDictionary[int, ShardedModule] = weakref.WeakValueDictionary()
_ORDER = itertools.count()
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple] = weakref.WeakKeyDictionary()
_warned: set[type] = set()
# parameters of models a parallel module replaced, by id (a WeakSet would compare tensors with ==)
_REPLACED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_handle = None


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
    if isinstance(optimizer, _ELEMENTWISE):
        return
    blocks = _blocks()
    stepped = [blocks[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in blocks]
    if not stepped:
        return
    shown = ", ".join(f"{fqn} (split on {how})" for fqn, how in stepped[:3]) + (", ..." if len(stepped) > 3 else "")
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


def _blocks() -> dict[int, tuple[str, str]]:
    """id of each watched module's parameter that is a block of a larger one -> (its FQN, how it is split)."""
    out = {}
    for _, module in sorted(_MODULES.items()):
        storage, mesh = module.param_storage(), module.mesh
        for fqn, p in module.named_parameters():
            spec = storage.get(fqn)
            split = [f"dim {pl.dim} over {name}" for pl, name, size in zip(spec.placements, mesh.axis_names, mesh.shape)
                     if isinstance(pl, Shard) and size > 1] if spec is not None else []
            if split:
                out[id(p)] = (fqn, ", ".join(split))
    return out
