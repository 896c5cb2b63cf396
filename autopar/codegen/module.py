"""`ParallelModule`: the lowered graph as an ordinary `nn.Module` for training loops.

    pm = ParallelModule(gm, traced, mesh, plan)
    loss = pm(**my_slice_of_the_batch)     # same call signature as the original model
    loss.backward()                         # grads of local shards, data-parallel sync included
    pm.clip_grad_norm_(1.0)                 # optional: clipping by the norm of the FULL gradients
    opt.step()                              # any torch.optim optimizer over pm.parameters()

Parameters are this rank's shards under their original FQNs (the lowered
graph's own submodules, shared, so `named_parameters()` reads
`transformer.h.0.attn.c_attn.weight`). `state_dict()` gathers full tensors;
`load_state_dict()` takes full tensors and keeps this rank's block.
"""
from __future__ import annotations

import logging
import math
import operator
from typing import Any, Mapping

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autopar.codegen.lower import LoweringInfo, share_tree
from autopar.codegen.shapes import LoweringError
from autopar.runtime.batch import batch_slice
from autopar.runtime.deferred_loss import grads_scaled_by, other_output
from autopar.runtime.grad_norm import clip_grad_norm_
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.state_dict import full_state_dict, load_full_state_dict
from autopar.solver.plan import Plan
from autopar.solver.spec import Spec
from autopar.tracer import TracedGraph

log = logging.getLogger(__name__)


class ParallelModule(nn.Module):
    def __init__(self, gm: fx.GraphModule, traced: TracedGraph, mesh: ProcessMesh, plan: Plan):
        super().__init__()
        info: LoweringInfo = gm.meta["autopar"]
        share_tree(self, gm)  # the graph's parameter tree, so FQNs are the original ones (no "graph." prefix)
        object.__setattr__(self, "graph_module", gm)  # not a child: its tensors are already ours
        # the graph takes its parameters and buffers as arguments (`lower`'s docstring says why): each is
        # read from its owner's dict at every call, so the graph gets the module's current tensors (a buffer
        # `module.to` replaced, as get_attr read them)
        self._state_slots = [_slot(self, fqn) for fqn in info.state_inputs]
        self._param_positions = [i for i, (slots, name) in enumerate(self._state_slots) if isinstance(slots[name], nn.Parameter)]
        self.mesh, self.plan, self.info = mesh, plan, info
        self._in_spec, self._out_spec = traced.in_spec, traced.out_spec
        self._loss_index = traced.loss_index  # None: no output is the loss
        # outputs come back as each rank's rows: a loss computed from them outside is one term of a sum.
        # Watched in the first training forward only: a loop that computes its loss outside does so from
        # its first step, and the watch costs an alias and a hook per output.
        self._watch_outputs = info.input_layout == "shard" and math.prod(mesh.shape) > 1
        self._outside_loss_logged = False
        self._sync = _make_grad_sync(self, info, mesh)
        self._synced_params = [slots[name] for slots, name in (self._state_slots[i] for i in self._param_positions)]  # the sync's

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of a GLOBAL batch, as the module's input layout wants it fed.

        'shard': its contiguous slice of dim 0 (`autopar.runtime.batch.batch_slice`), ranks in
        row-major mesh order; 'replicate': the whole batch.
        """
        if self.info.input_layout == "replicate":
            return batch
        index = 0
        for c, n in zip(self.mesh.coordinate, self.mesh.shape):
            index = index * n + c
        return batch_slice(batch, index, math.prod(self.mesh.shape))

    @property
    def code(self) -> str:
        return self.graph_module.code

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise LoweringError(f"called with inputs structured as {spec}; the model was traced with {self._in_spec}")
        state = [slots[name] for slots, name in self._state_slots]
        if any(map(operator.is_not, [state[i] for i in self._param_positions], self._synced_params)):
            self._follow_new_parameters(state)
        with grads_scaled_by(self._sync):  # a mean loss may leave its division by the count to the sync
            outs = list(self.graph_module(*state, *flat))
        if torch.is_grad_enabled():
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
                self._sync.forbid_deferral()  # their grads would be those of the loss's sum: it keeps its division
            watch, self._watch_outputs = self._watch_outputs, False
            for i, out in enumerate(outs):
                if not (isinstance(out, torch.Tensor) and out.requires_grad):
                    continue
                if i != self._loss_index:
                    # on an alias: the loss reads the output itself (a model's logits), whose gradient
                    # is computed in every backward; the alias gets one only from the caller's use
                    outs[i] = other_output(out, self._sync)  # gradient entering there stays exact
                    if watch:
                        outs[i].register_hook(self._outside_loss_hook)
                self._sync.watch(outs[i])  # where a backward enters the module: the sync starts there
        return pytree.tree_unflatten(outs, self._out_spec)

    def _follow_new_parameters(self, state: list[torch.Tensor]) -> None:
        """A parameter was set anew on its module since the gradient sync was built (`mod.w = nn.Parameter(...)`):
        the graph reads the new one, so the sync is rebuilt over the current parameters (their grads are synced,
        as eager autograd would give the new one its gradient; an optimizer made before keeps the old one, as in
        eager PyTorch). Sums a sync wrote to parameters that stayed keep their marks (gradient accumulation)."""
        old = self._sync
        old.remove()
        self._sync = _make_grad_sync(self, self.info, self.mesh)
        self._sync.keep_marks(old)
        self._synced_params = [state[i] for i in self._param_positions]

    def _outside_loss_hook(self, grad: torch.Tensor) -> None:
        """Gradient enters through an output other than the loss: say once what that trains on."""
        if self._outside_loss_logged:
            return
        self._outside_loss_logged = True
        ranks = math.prod(self.mesh.shape)
        if torch.distributed.get_rank() != 0:
            return
        log.warning(
            "gradient enters the parallel module through an output other than its loss: each rank's rows of "
            "that output are its part of the global batch, and backward follows the SUM over ranks of what each "
            "rank backpropagates. A mean over a rank's own rows (DDP's convention) gives %d times the "
            "single-device gradient: divide it by %d, or compute the loss inside the model. (Logged once.)", ranks, ranks)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` for this module: the norm of the full gradients across all
        ranks' shards (a collective: call it on every rank, after backward), the same on every rank."""
        grads = {fqn: p.grad for fqn, p in self.named_parameters() if p.grad is not None}
        return clip_grad_norm_(grads, self.info.param_storage, self.mesh, max_norm, norm_type)

    # ------------------------------------------------------------ full state dicts
    def _specs(self) -> dict[str, Spec]:
        specs = dict(self.info.param_storage)
        specs.update(self.info.buffer_specs)
        return specs

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """Full (gathered) tensors by FQN, on every rank (a collective): the keys of the model's own
        `state_dict()`, tied names included, non-persistent buffers left out."""
        specs = self._specs()
        local = self.sharded_state_dict()
        return full_state_dict(local, {fqn: specs[self.info.aliases.get(fqn, fqn)] for fqn in local}, self.mesh)

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's local shards by FQN (what `torch.distributed.checkpoint` saves with the plan's specs).

        The graph module holds a tied tensor under the names the graph reads and registers its
        buffers as persistent, so the keys are made the model's here: each tied name, and no
        non-persistent buffer or constant the trace lifted."""
        own = {k: t for k, t in nn.Module.state_dict(self, keep_vars=True).items() if k not in self.info.unsaved}
        for alias, owner in self.info.aliases.items():
            own.setdefault(alias, own[owner])
        return own

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Load FULL tensors: each rank keeps its block per the plan's storage specs. A tied tensor is
        loaded from whichever of its names `state_dict` has (the first, if several)."""
        specs = self._specs()
        own = self.sharded_state_dict()
        full: dict[str, torch.Tensor] = {}
        for k, v in state_dict.items():
            if k in own:
                full.setdefault(self.info.aliases.get(k, k), v.to(own[k].device))
        missing = sorted(k for k in own if self.info.aliases.get(k, k) not in full)
        unexpected = sorted(set(state_dict) - set(own))
        if strict and (missing or unexpected):
            raise LoweringError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}; pass strict=False to load the intersection")
        owners = {k: t for k, t in own.items() if k not in self.info.aliases}
        load_full_state_dict(owners, full, {fqn: specs[fqn] for fqn in owners}, self.mesh, strict=False)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _slot(module: nn.Module, fqn: str) -> tuple[dict[str, torch.Tensor], str]:
    """The dict holding parameter or buffer `fqn` of `module`, and its key there."""
    owner_path, _, name = fqn.rpartition(".")
    owner = module.get_submodule(owner_path)
    return (owner._parameters if name in owner._parameters else owner._buffers), name


def _make_grad_sync(module: nn.Module, info: LoweringInfo, mesh: ProcessMesh) -> GradSync:
    """Bucketed sync of the grads the graph leaves partial: one group spanning all of a parameter's axes."""
    params = dict(module.named_parameters())
    # every rank builds the flattened groups in the same (graph) order: group creation is collective
    entries = []
    for fqn, axes in info.grad_sync_axes.items():
        axes = tuple(k for k in axes if mesh.shape[k] > 1)  # a one-rank axis has nothing to sum
        if axes:
            entries.append((fqn, params[fqn], (mesh.flat_group_name(axes),)))
    return GradSync(entries, scaled=params.values())
