"""This rank's pipeline stages, driven by torch.distributed.pipelining's schedules.

    pm = parallelize_pipeline(model, sample, plan)    # `autopar.pipeline.api`
    opt = torch.optim.AdamW(pm.parameters())
    loss = pm.step(**pm.local_batch(batch))  # every micro-batch's forward and backward; gradients synced once
    opt.step(); opt.zero_grad()

Each stage is its part of the model (`cut.cut`) lowered by codegen under its own plan on the stage
mesh: a GraphModule taking the activations the stage before sends and returning those the next one
reads (the last stage: its micro-batch's part of the loss, `loss.split_loss`). `StageModule` wraps it
as the `nn.Module` torch's `PipelineStage` runs, and torch's schedules (GPipe, 1F1B, interleaved 1F1B,
interleaved zero bubble) order the micro-batches and the sends: we write no scheduler. Every stage
knows the shapes of what it sends and receives from its trace, so the stages are built with them
(torch's static mode): no forward runs to find them out, which would update batch norm's statistics.

After the schedule, once per step and not per micro-batch (`_finish`):
1. each stage's gradients the plan leaves partial are summed over the stage mesh, one all-reduce
   per group of axes (the in-graph collectives, tensor parallelism's and ZeRO's, ran per micro-batch);
2. a parameter several stages read (a tied embedding and LM head) has its gradients summed over
   those stages, as Megatron keeps its embedding group in sync: both copies then take the same step;
3. every gradient is divided by the loss's divisor (`loss.LossSplit`), which the last stage knows
   once its micro-batches are done and sends to the others with the loss.

Ranks are laid out as a DeviceMesh (pp, *stage axes): stage s runs on the ranks whose pp coordinate is
s % pp, and ranks with the same coordinate on the stage axes are one pipeline (they exchange
activations). Every rank of a stage feeds its slice of each micro-batch (`local_batch`).
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

from autopar.codegen.lower import LoweringInfo, share_tree
from autopar.codegen.module import _slot
from autopar.errors import AutoparError
from autopar.pipeline.cut import StageGraph
from autopar.pipeline.plan import PipelinePlan
from autopar.runtime.mesh import ProcessMesh
from autopar.tracer import TracedGraph

log = logging.getLogger(__name__)


class PipelineError(AutoparError):
    """A pipeline cannot run as asked (a schedule's rule on micro-batches, inputs of another structure)."""


class PipelineMesh:
    """The ranks as a DeviceMesh (pp, *stage axes): this rank's pp coordinate, its pipeline group (one rank of each
    pp coordinate) and its stage's `ProcessMesh`."""

    def __init__(self, plan: PipelinePlan, device_type: str | None = None):
        names = tuple(plan.mesh.axis_names)
        device_type = device_type or ("cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")
        if math.prod(plan.mesh.shape) != dist.get_world_size():
            dims = " * ".join(f"{a.name}({a.size})" for a in plan.mesh.axes)
            raise PipelineError(f"the plan's mesh {dims} = {math.prod(plan.mesh.shape)} != WORLD_SIZE({dist.get_world_size()}); "
                                "run it on as many ranks, or plan for this world")
        self.device_mesh = init_device_mesh(device_type, tuple(plan.mesh.shape), mesh_dim_names=names)
        self.pp_rank = self.device_mesh.get_coordinate()[0]
        self.pp_group = self.device_mesh.get_group("pp")
        self.stage = ProcessMesh(self.device_mesh[names[1:]])
        # Groups spanning several stage axes (a gradient summed over dp and tp) are made by every rank at once
        # here: a stage making one alone, as its plan first asks for it, would wait for the other stages forever.
        for k in range(2, self.stage.ndim + 1):
            for axes in itertools.combinations(range(self.stage.ndim), k):
                self.stage.flat_group_name(axes)
        self.stage_rank = _flat_index(self.stage.coordinate, self.stage.shape)  # its slice of each micro-batch
        self.stage_size = math.prod(self.stage.shape)

    def global_rank(self, pp_rank: int) -> int:
        """The rank running pp coordinate `pp_rank` at this rank's stage coordinate (its peer in the pipeline)."""
        return pp_rank * self.stage_size + self.stage_rank


def _flat_index(coordinate: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for c, n in zip(coordinate, shape):
        index = index * n + c
    return index


@dataclass(frozen=True)
class _Lowered:
    """A stage's generated graph, kept outside the module tree (its parameters are the `StageModule`'s own)."""

    gm: fx.GraphModule


class StageModule(nn.Module):
    """One stage's lowered graph as the module torch's `PipelineStage` runs: the activations received are its
    positional arguments, the model's inputs it reads its keyword arguments (each rank's slice of the micro-batch)."""

    def __init__(self, gm: fx.GraphModule, stage: StageGraph):
        super().__init__()
        share_tree(self, gm)
        self.info: LoweringInfo = gm.meta["autopar"]
        self.stage = stage
        self._lowered = _Lowered(gm)
        self._slots = [_slot(self, fqn) for fqn in self.info.state_inputs]

    def forward(self, *received: torch.Tensor, **inputs: Any) -> tuple[torch.Tensor, ...]:
        state = [owner[name] for owner, name in self._slots]
        fed = [_contiguous(inputs[n]) for n in self.stage.user_inputs]
        outs = self._lowered.gm(*state, *fed, *received)[:len(self.stage.traced.output_names)]  # (buffers: in the graph)
        # torch's zero-bubble backward detaches each output in place, which a view (a recompute region's output, a
        # reshape) refuses: those leave as copies
        return tuple(o.clone() if o._is_view() else o for o in outs)


def _contiguous(x: Any) -> Any:
    # torch splits a micro-batch along a dim other than 0 as a strided view: fed as a data loader would hand it over
    return x.contiguous() if isinstance(x, torch.Tensor) else x


def _examples(stage: StageGraph, names: Sequence[str], dims: Sequence[int | None], grads: Sequence[bool],
              world: int) -> tuple[torch.Tensor, ...]:
    """Meta tensors shaped as one rank's part of each value (cut along its dim into `world` parts): the shapes
    torch's `PipelineStage` sends and receives, given up front."""
    out = []
    for name, dim, grad in zip(names, dims, grads, strict=True):
        val = stage.traced.node(name).meta["val"]
        shape = list(val.shape)
        if dim is not None:
            shape[dim] //= world
        out.append(torch.empty(shape, dtype=val.dtype, device="meta").requires_grad_(grad))
    return tuple(out)


def pipeline_stage(module: StageModule, stage: StageGraph, next_stage: StageGraph | None, num_stages: int,
                   pmesh: PipelineMesh, device: torch.device) -> PipelineStage:
    """torch's `PipelineStage` for `module`, with the shapes it receives and sends."""
    traced = stage.traced
    received_dims = traced.input_batch_dims[len(stage.user_inputs):]
    inputs = _examples(stage, stage.received, received_dims, stage.receives_grad, pmesh.stage_size)
    if next_stage is None:  # the loss's part carries a gradient, its count none
        outputs = _examples(stage, traced.output_names, [None] * len(traced.output_names),
                            [i == 0 for i in range(len(traced.output_names))], pmesh.stage_size)
    else:
        sent_dims = next_stage.traced.input_batch_dims[len(next_stage.user_inputs):]
        outputs = _examples(stage, stage.sent, sent_dims, stage.sends_grad, pmesh.stage_size)
    return PipelineStage(module, stage.index, num_stages, device, input_args=inputs, output_args=outputs,
                         group=pmesh.pp_group)


_SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # one stage per rank
_LOOPED = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zero_bubble": ScheduleInterleavedZeroBubble}  # several


def make_schedule(kind: str, stages: list[PipelineStage], microbatches: int, loss_fn: Any,
                  chunk_spec: Mapping[str, Any]) -> Any:
    """torch's schedule `kind` over this rank's stages. Gradients are not scaled by the micro-batch count
    (`scale_grads=False`): the step divides them by the loss's own divisor (`PipelineModule`)."""
    if kind in _SINGLE:
        return _SINGLE[kind](stages[0], microbatches, loss_fn=loss_fn, kwargs_chunk_spec=dict(chunk_spec), scale_grads=False)
    return _LOOPED[kind](stages, microbatches, loss_fn=loss_fn, kwargs_chunk_spec=dict(chunk_spec), scale_grads=False)


def chunk_spec(traced: TracedGraph, names: Sequence[str]) -> dict[str, Any]:
    """How torch cuts each model input a rank feeds into micro-batches: along its batch dim, or whole
    (torch's `_Replicate`: an input fed whole, a position table or a Python number)."""
    dims = traced.batch_dim_of()
    return {n: _Replicate() if dims[n] is None else TensorChunkSpec(dims[n]) for n in names}
