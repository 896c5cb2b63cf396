"""`PipelineModule`: this rank's stages of a model under a `PipelinePlan`, trained a batch at a time.

    pm = parallelize_pipeline(model, sample, plan)
    opt = torch.optim.AdamW(pm.parameters())
    for batch in loader:
        opt.zero_grad()
        loss = pm.step(**pm.local_batch(batch))   # the batch's loss, on every rank
        opt.step()

`step` runs torch's schedule over the micro-batches and then, once, the gradient sync the module
docstring of `runtime` lists. Parameters are this rank's blocks of its stages' parameters, under the
model's names; a parameter several stages read is a parameter of each of them, kept equal (same
gradients, same steps). `state_dict`, `load_state_dict`, `save_checkpoint` and `load_checkpoint`
read and write the whole model in the formats `ParallelModule` uses (`state`).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils import _pytree as pytree

from autopar.codegen.lower import _set_nested
from autopar.pipeline import state
from autopar.pipeline.cut import StageGraph
from autopar.pipeline.plan import PipelinePlan
from autopar.pipeline.runtime import PipelineError, PipelineMesh, StageModule, chunk_spec, make_schedule, pipeline_stage
from autopar.runtime import rng
from autopar.runtime.batch import batch_slice
from autopar.tracer import TracedGraph

log = logging.getLogger(__name__)


class PipelineModule(nn.Module):
    def __init__(self, plan: PipelinePlan, traced: TracedGraph, stages: Sequence[StageGraph],
                 modules: Mapping[int, StageModule], pmesh: PipelineMesh):
        """traced: the whole model at the micro-batch's size; stages: all of its stages; modules: this rank's, by
        stage index."""
        super().__init__()
        self.plan, self.pmesh = plan, pmesh
        self._traced, self._stage_graphs = traced, tuple(stages)
        self._stage_modules = [modules[i] for i in sorted(modules)]  # not submodules: their tensors are adopted below
        self._adopt()
        # how this rank's block of each parameter and buffer is cut from the full tensor, by FQN
        self.storage = {fqn: spec for m in self._stage_modules for fqn, spec in {**m.info.param_storage, **m.info.buffer_specs}.items()}
        device = next(iter(self.parameters())).device
        num = len(stages)
        pipeline_stages = [pipeline_stage(modules[i], stages[i], stages[i + 1] if i + 1 < num else None, num, pmesh, device)
                           for i in sorted(modules)]
        self._fed = tuple(dict.fromkeys(n for i in sorted(modules) for n in stages[i].user_inputs))
        self._last = stages[-1] if num - 1 in modules else None
        self._schedule = make_schedule(plan.schedule, pipeline_stages, plan.microbatches, self._loss_part,
                                       chunk_spec(traced, self._fed))
        self._parts: list[torch.Tensor] = []  # this step's micro-batch losses (the last stage's)
        self._counts: list[torch.Tensor] = []
        self._shared = state.SharedParams(plan, stages, self._stage_modules, pmesh)  # collective: every rank makes its groups
        rng.agree_on_mask_seed(None)  # dropout masks alike on replicas, however each rank seeded torch

    def _adopt(self) -> None:
        """This rank's stages' parameters and buffers as this module's own, under the model's names (stages share
        no tensor: a parameter two stages read is a copy in each, on different ranks, `state.SharedParams`)."""
        for module in self._stage_modules:
            for fqn, p in module.named_parameters():
                _set_nested(self, fqn, p, True)
            for fqn, b in module.named_buffers():
                _set_nested(self, fqn, b, False)

    # ------------------------------------------------------------ training
    def local_batch(self, batch: Any) -> Any:
        """This rank's slice of a global batch: ranks at the same place in every stage feed the same samples
        (the stage mesh's ranks split the batch, as `ParallelModule.local_batch` splits it over the world)."""
        return batch_slice(batch, self.pmesh.stage_rank, self.pmesh.stage_size, self._traced.batch_dim)

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of every micro-batch of this rank's slice of the batch (called as the model is,
        with the inputs of this rank's `local_batch`), then the gradient sync: the batch's loss, on every rank."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._traced.in_spec:
            raise PipelineError(f"step() takes the model's inputs as it was traced ({self._traced.in_spec}), got {spec}")
        inputs = dict(zip(self._traced.input_names, flat))
        self._check_sizes(inputs)
        self._parts, self._counts = [], []
        target = torch.arange(self.plan.microbatches) if self._last is not None else None  # each micro-batch's index
        self._schedule.step(target=target, return_outputs=False, **{n: inputs[n] for n in self._fed})
        return self._finish()

    def _check_sizes(self, inputs: Mapping[str, Any]) -> None:
        """Each batched input holds this rank's slice of the batch the plan was made for (torch would cut another
        size into uneven micro-batches, whose shapes the stages' graphs do not take)."""
        m, world = self.plan.microbatches, self.pmesh.stage_size
        for name, dim in self._traced.batch_dim_of().items():
            if dim is None or name not in self._fed:
                continue
            want = int(self._traced.node(name).meta["val"].shape[dim]) * m // world
            got = int(inputs[name].shape[dim])
            if got != want:
                raise PipelineError(f"input {name!r} has {got} rows along dim {dim}, but this plan's batch gives each "
                                    f"rank {want} ({m} micro-batches of {want // m}): feed pm.local_batch(batch) of a "
                                    f"global batch of {want * world}")

    def _loss_part(self, output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: the micro-batch's part of the loss, as the stage returns
        it (its count kept aside); backward starts there."""
        self._parts.append(output[0])
        if len(output) > 1:
            self._counts.append(output[1].detach())
        return output[0]

    def _finish(self) -> torch.Tensor:
        """The step's loss on every rank, and gradients synced and divided by the loss's divisor."""
        totals = torch.zeros(2, dtype=torch.float64)
        if self._last is not None:
            kind = self._last.loss.kind
            totals[0] = sum(float(p.detach()) for p in self._parts)
            totals[1] = float(sum(self._counts)) if kind == "count" else (self.plan.microbatches if kind == "mean" else 1)
        device = self.pmesh.stage.device_mesh.device_type
        totals = totals.to(device)
        dist.broadcast(totals, group=self.pmesh.pp_group, group_src=self.plan.rank_of(len(self._stage_graphs) - 1))
        self._sync_stage_grads()
        self._shared.sync_grads()
        divisor = float(totals[1])
        if divisor != 1.0:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.div_(divisor)
        self._parts, self._counts = [], []
        return (totals[0] / totals[1]).to(torch.float32)

    def _sync_stage_grads(self) -> None:
        """Sum the gradients each stage's plan leaves partial over its stage mesh: one all-reduce per group of axes
        and dtype, over the step's accumulated gradients."""
        for module in self._stage_modules:
            buckets: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
            params = dict(module.named_parameters())
            for fqn, axes in module.info.grad_sync_axes.items():
                axes = tuple(k for k in axes if self.pmesh.stage.shape[k] > 1)
                grad = params[fqn].grad
                if axes and grad is not None:
                    buckets.setdefault((self.pmesh.stage.flat_group_name(axes), grad.dtype), []).append(grad)
            for (group, _), grads in buckets.items():
                flat = _flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=_resolve_process_group(group))
                for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    g.copy_(summed)

    # ------------------------------------------------------------ state
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The whole model's full tensors by FQN, on every rank (a collective): the keys of the model's own
        `state_dict()`, tied names included."""
        return state.full_state_dict(self._stage_modules, self.pmesh, self._traced)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Load the whole model's FULL tensors: each rank keeps its stages' blocks."""
        return state.load_full_state_dict(self._stage_modules, self.pmesh, self._traced, state_dict, strict)

    def save_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None, extra: dict[str, Any] | None = None) -> None:
        """Write the parameters, buffers and `optimizer`'s state with torch.distributed.checkpoint, each stage its
        own (a parameter several stages hold, once): it loads under any plan or mesh, pipelined or not, and into
        one device's model and optimizer with torch alone."""
        state.save_checkpoint(self, self._stage_modules, self.pmesh, self._traced, path, optimizer, extra)

    def load_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None, extra: dict[str, Any] | None = None) -> None:
        """Fill the parameters, buffers and `optimizer`'s state from a checkpoint of `save_checkpoint`, or of a
        `ParallelModule` under any plan, or of torch's `dcp.save` of one device's `get_state_dict`."""
        state.load_checkpoint(self, self._stage_modules, self.pmesh, path, optimizer, extra)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("a pipeline module trains a batch at a time: loss = pm.step(**pm.local_batch(batch)), "
                            "then the optimizer's step (the forward and backward of its micro-batches run inside)")
