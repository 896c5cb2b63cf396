"""`ParallelModule`: the lowered graph as an ordinary `nn.Module` for training loops.

    pm = ParallelModule(gm, traced, mesh, plan)
    loss = pm(**my_slice_of_the_batch)     # same call signature as the original model
    loss.backward()                         # grads of local shards, data-parallel sync included
    opt.step()                              # any torch.optim optimizer over pm.parameters()

Parameters are this rank's shards under their original FQNs (the lowered
graph's own submodules, shared, so `named_parameters()` reads
`transformer.h.0.attn.c_attn.weight`). `state_dict()` gathers full tensors;
`load_state_dict()` takes full tensors and keeps this rank's block.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autopar.codegen.lower import LoweringInfo
from autopar.codegen.shapes import LoweringError, local_block
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.plan import Plan
from autopar.solver.spec import Spec
from autopar.tracer import TracedGraph

log = logging.getLogger(__name__)


class ParallelModule(nn.Module):
    def __init__(self, gm: fx.GraphModule, traced: TracedGraph, mesh: ProcessMesh, plan: Plan):
        super().__init__()
        info: LoweringInfo = gm.meta["autopar"]
        # share the graph's parameter tree so FQNs are the original ones (no "graph." prefix)
        for name, child in gm.named_children():
            self.add_module(name, child)
        for name, p in gm.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in gm.named_buffers(recurse=False):
            self.register_buffer(name, b)
        object.__setattr__(self, "graph_module", gm)  # not a child: its tensors are already ours
        self.mesh, self.plan, self.info = mesh, plan, info
        self._in_spec, self._out_spec = traced.in_spec, traced.out_spec
        self._sync = _make_grad_sync(self, info, mesh)

    @property
    def code(self) -> str:
        return self.graph_module.code

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise LoweringError(f"called with inputs structured as {spec}; the model was traced with {self._in_spec}")
        outs = self.graph_module(*flat)
        return pytree.tree_unflatten(list(outs), self._out_spec)

    # ------------------------------------------------------------ full state dicts
    def _specs(self) -> dict[str, Spec]:
        specs = dict(self.info.param_storage)
        specs.update(self.info.buffer_specs)
        return specs

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """Full (gathered) tensors by FQN, tied names included, on every rank."""
        specs = self._specs()
        out = {}
        for fqn, t in self.sharded_state_dict().items():
            owner = self.info.aliases.get(fqn, fqn)
            out[fqn] = gather_full(t.detach(), specs[owner], self.mesh)
        return out

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's local shards by FQN (what `torch.distributed.checkpoint` saves with the plan's specs)."""
        return nn.Module.state_dict(self, keep_vars=True)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Load FULL tensors: each rank keeps its block per the plan's storage specs."""
        specs = self._specs()
        own = self.sharded_state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise LoweringError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        with torch.no_grad():
            for fqn, t in own.items():
                if fqn in state_dict:
                    spec = specs[self.info.aliases.get(fqn, fqn)]
                    t.copy_(local_block(state_dict[fqn].to(t.device), spec, self.mesh.shape, self.mesh.coordinate))
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


def gather_full(t: torch.Tensor, spec: Spec, mesh: ProcessMesh) -> torch.Tensor:
    """The full tensor from local shards: all-gather innermost axis first (the inverse of `local_block`)."""
    from autopar.runtime.collectives import _gather  # plain (no autograd) gather of the runtime

    for k in reversed(range(len(spec.placements))):
        p = spec.placements[k]
        if hasattr(p, "dim"):
            t = _gather(t, p.dim, mesh.group_name(k))
    return t


def _make_grad_sync(module: nn.Module, info: LoweringInfo, mesh: ProcessMesh):
    from autopar.runtime.collectives import _all_reduce

    params = dict(module.named_parameters())
    hooks = []
    for fqn, axes in info.grad_sync_axes.items():
        if not axes:
            continue
        groups = [mesh.group_name(k) for k in axes]

        def hook(p: torch.Tensor, groups=groups) -> None:
            for g in groups:
                p.grad.copy_(_all_reduce(p.grad, g))

        hooks.append(params[fqn].register_post_accumulate_grad_hook(hook))
    return hooks


