"""State across pipeline stages: parameters several stages hold, state dicts and DCP checkpoints.

A parameter read by ops of several stages (GPT-2's token embedding, which its LM head reuses) is a
parameter of each of those stages, on different ranks. As Megatron keeps its embedding group in
sync, `SharedParams` sums the copies' gradients over the stages holding them once per step; with the
same starting values and the same optimizer they stay equal. State dicts and checkpoints name each
tensor once, by the model's FQNs: the first stage holding a shared parameter writes it, every holder
reads it. Checkpoints are `ParallelModule`'s format (`runtime.state_dict`: {"model", "optim"} written
by DCP, each tensor a DTensor on its stage's mesh), so a pipeline's checkpoint resumes under any plan,
one device included, and a pipeline resumes from theirs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from autopar.pipeline.cut import StageGraph
from autopar.pipeline.plan import PipelinePlan
from autopar.pipeline.runtime import PipelineError, PipelineMesh, StageModule
from autopar.runtime.state_dict import (
    full_state_dict as gather_state,
    gather_full,
    load_full_state_dict as load_blocks,
    load_sharded,
    local_shard,
    save_sharded,
)
from autopar.solver.spec import Spec
from autopar.tracer import TracedGraph

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class SharedParams:
    """Parameters held by stages on several pp ranks, and the groups their gradients are summed over."""

    def __init__(self, plan: PipelinePlan, stages: Sequence[StageGraph], modules: Sequence[StageModule], pmesh: PipelineMesh):
        self.pmesh = pmesh
        holders: dict[str, list[int]] = {}
        for stage in stages:
            for fqn in dict.fromkeys(stage.traced.param_fqns.values()):
                holders.setdefault(fqn, []).append(stage.index)
        self.holders = {fqn: tuple(s) for fqn, s in holders.items() if len(s) > 1}
        for fqn, held in self.holders.items():
            ranks = [plan.rank_of(s) for s in held]
            if len(set(ranks)) < len(ranks):
                raise PipelineError(f"{fqn} is read by stages {list(held)}, which this schedule puts on one rank "
                                    f"(pp={plan.pp}, {plan.virtual} stages a rank): cut elsewhere or use fewer stages a rank")
        # a gradient summed block by block where every holder stores the parameter alike, else whole
        self.alike = {fqn: len({_storage(plan.stages[s].plan, fqn) for s in held}) == 1 for fqn, held in self.holders.items()}
        self.groups: dict[tuple[int, ...], ProcessGroup] = {}
        for ranks in sorted({tuple(sorted({plan.rank_of(s) for s in held})) for held in self.holders.values()}):
            self.groups[ranks] = self._group_over(ranks, plan.pp)
        self.params = {fqn: (m, p) for m in modules for fqn, p in m.named_parameters() if fqn in self.holders}
        self.rank_of = plan.rank_of

    def _group_over(self, pp_ranks: tuple[int, ...], pp: int) -> ProcessGroup | None:
        """The group of this rank's pipeline peers at `pp_ranks` (None when it is not among them). Every rank makes
        every such group, in the same order: making a group is a collective of the world."""
        if len(pp_ranks) == pp:
            return self.pmesh.pp_group
        mine = None
        for r in range(self.pmesh.stage_size):
            ranks = [p * self.pmesh.stage_size + r for p in pp_ranks]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine

    def sync_grads(self) -> None:
        """Sum each shared parameter's gradient over the stages holding it (after each stage's own sync)."""
        stage_mesh = self.pmesh.stage
        for fqn in sorted(self.params):
            module, p = self.params[fqn]
            if not p.requires_grad:
                continue
            group = self.groups[tuple(sorted({self.rank_of(s) for s in self.holders[fqn]}))]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if self.alike[fqn]:
                dist.all_reduce(grad, group=group)
            else:  # stored otherwise by another holder: summed whole, then this rank keeps its block
                spec = module.info.param_storage[fqn]
                full = gather_full(grad, spec, stage_mesh)
                dist.all_reduce(full, group=group)
                grad = local_shard(full, spec, stage_mesh)
            p.grad = grad

    def first_holder(self, fqn: str) -> int | None:
        """The stage that writes `fqn` into state dicts and checkpoints (None: not shared)."""
        held = self.holders.get(fqn)
        return held[0] if held else None


def _storage(plan: Any, fqn: str) -> Spec:
    on_mesh = plan.on_mesh()
    return next(p.storage for p in on_mesh.params if p.fqn == fqn)


def _shards(modules: Sequence[StageModule]) -> tuple[dict[str, torch.Tensor], dict[str, Spec], dict[str, int]]:
    """This rank's tensors by every name the model gives them (tied names included), each one's storage spec, and
    the stage holding it."""
    local, specs, stage_of = {}, {}, {}
    for m in modules:
        own = {k: t for k, t in nn.Module.state_dict(m, keep_vars=True).items() if k not in m.info.unsaved}
        for alias, owner in m.info.aliases.items():
            own.setdefault(alias, own[owner])
        storage = {**m.info.param_storage, **m.info.buffer_specs}
        for k, t in own.items():
            local[k], specs[k], stage_of[k] = t, storage[m.info.aliases.get(k, k)], m.stage.index
    return local, specs, stage_of


def _written_here(modules: Sequence[StageModule], shared: SharedParams) -> tuple[dict[str, torch.Tensor], dict[str, Spec]]:
    """The tensors this rank writes: its stages' own, and a shared parameter only where its first holder runs."""
    local, specs, stage_of = _shards(modules)
    owner = {alias: o for m in modules for alias, o in m.info.aliases.items()}
    keep = {k for k in local if shared.first_holder(owner.get(k, k)) in (None, stage_of[k])}
    return {k: local[k] for k in keep}, {k: specs[k] for k in keep}


def full_state_dict(modules: Sequence[StageModule], pmesh: PipelineMesh, traced: TracedGraph) -> dict[str, torch.Tensor]:
    """Every stage's full tensors on every rank: gathered in each stage, then exchanged along the pipeline."""
    local, specs, _ = _shards(modules)
    mine = gather_state(local, specs, pmesh.stage)
    parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(pmesh.pp_group)
    dist.all_gather_object(parts, {k: v.cpu() for k, v in mine.items()}, group=pmesh.pp_group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in (part or {}).items():
            merged.setdefault(k, v)
    return merged


def load_full_state_dict(modules: Sequence[StageModule], pmesh: PipelineMesh, traced: TracedGraph,
                         state_dict: Mapping[str, torch.Tensor], strict: bool) -> Any:
    """Copy each of this rank's blocks out of the whole model's full tensors `state_dict`."""
    expected = {*traced.param_fqns.values(), *(a for names in traced.tied_params.values() for a in names),
                *(b for b in traced.buffer_fqns.values() if b not in traced.nonpersistent_buffers and b not in traced.constants)}
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise PipelineError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}; "
                            "pass strict=False to load the intersection")
    local, specs, _ = _shards(modules)
    owners = {k: t for k, t in local.items() if not any(k in m.info.aliases for m in modules)}
    full = {}
    for k, v in state_dict.items():
        name = next((m.info.aliases[k] for m in modules if k in m.info.aliases), k)
        if name in owners:
            full.setdefault(name, v.to(owners[name].device))
    load_blocks(owners, full, specs, pmesh.stage, strict=False)
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _model_param_groups(osd: Mapping[str, Any], pmesh: PipelineMesh, traced: TracedGraph) -> list[dict[str, Any]]:
    """The optimizer's param groups as one device's optimizer over the whole model would have them: each group's
    parameters from every stage, in the model's order (every rank writes the same groups)."""
    names = [[*g["params"]] for g in osd["param_groups"]]
    parts: list[list[list[str]] | None] = [None] * dist.get_world_size(pmesh.pp_group)
    dist.all_gather_object(parts, names, group=pmesh.pp_group)
    order = {fqn: i for i, fqn in enumerate(dict.fromkeys(traced.param_fqns.values()))}
    groups = []
    for i, group in enumerate(osd["param_groups"]):
        every = {fqn for part in parts for fqn in (part[i] if part and i < len(part) else [])}
        groups.append({**group, "params": sorted(every, key=lambda f: order.get(f, len(order)))})
    return groups


def save_checkpoint(pm: nn.Module, modules: Sequence[StageModule], pmesh: PipelineMesh, traced: TracedGraph, path: str,
                    optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None) -> None:
    local, specs = _written_here(modules, pm._shared)
    osd = None
    if optimizer is not None:
        full = get_optimizer_state_dict(pm, optimizer)
        osd = {"state": {k: v for k, v in full["state"].items() if k in local},
               "param_groups": _model_param_groups(full, pmesh, traced)}
    save_sharded(local, specs, pmesh.stage, path, osd, extra)


def load_checkpoint(pm: nn.Module, modules: Sequence[StageModule], pmesh: PipelineMesh, path: str,
                    optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None) -> None:
    local, specs, _ = _shards(modules)
    osd = None if optimizer is None else get_optimizer_state_dict(pm, optimizer)
    loaded = load_sharded(local, specs, pmesh.stage, path, osd, extra)
    if optimizer is not None:
        held = set(dict(pm.named_parameters()))
        loaded["param_groups"] = [{**g, "params": [f for f in g["params"] if f in held]} for g in loaded["param_groups"]]
        set_optimizer_state_dict(pm, optimizer, loaded)
