"""`parallelize_pipeline`: a model as this rank's stages of a pipeline plan.

    plan = solve_pipeline(...)  or  load_pipeline_plan("plan.json")
    pm = parallelize_pipeline(model, sample, plan)      # in a world of plan.mesh.num_devices ranks
    loss = pm.step(**pm.local_batch(batch)); opt.step()

The model is traced at the size of one micro-batch (its sample's first rows), cut where the plan's
stages start, and each stage this rank runs is lowered under its stage plan on the stage mesh.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.api import _capture_device, trace_copy, traced_model
from autopar.codegen import lower
from autopar.errors import InfeasibleError
from autopar.mixed_precision import MixedPrecision
from autopar.pipeline.cache import SearchCache
from autopar.pipeline.cut import CutError, StageGraph, cut, find_layers
from autopar.pipeline.module import PipelineModule
from autopar.pipeline.choose import PP, check_pp, choose
from autopar.pipeline.plan import PipelinePlan, is_pipeline_dict, load_pipeline_plan, pipeline_from_dict, pipeline_to_dict
from autopar.pipeline.runtime import PipelineError, PipelineMesh, StageModule
from autopar.profiler import profile
from autopar.runtime.batch import batch_slice
from autopar.runtime.lockstep import from_rank0
from autopar.solver import solve
from autopar.solver.mesh import Mesh, make_mesh, preset_for_device
from autopar.solver.plan import Plan
from autopar.solver.plan_io import check_plan, plan_from_json, plan_to_json
from autopar.tracer import TracedGraph
from autopar.tracer.batch_dims import BatchDim

log = logging.getLogger(__name__)


def microbatch_sample(sample: Any, microbatches: int, batch_dim: BatchDim = 0) -> Any:
    """The first of `microbatches` equal parts of the global batch `sample`: what a pipeline's graphs are traced on."""
    return batch_slice(sample, 0, microbatches, batch_dim)


def search_cache(model: nn.Module, sample: Any, device: str, batch_dim: BatchDim = 0, optimizer: str = "adamw",
                 time_limit_s: float = 30.0, mixed_precision: MixedPrecision | None = None) -> SearchCache:
    """What the pipeline search traces and solves `model` with at each micro-batch count (`sample`: the global
    batch): traced as `parallelize` traces it, under `mixed_precision` where given (bf16 compute and activations,
    priced on the float32 masters and the reduce dtype, as the plan without stages is: `api.profiled`)."""
    def trace_at(m: int) -> TracedGraph:
        return traced_model(model, microbatch_sample(sample, m, batch_dim), device, batch_dim, mixed_precision)

    if mixed_precision is None:
        return SearchCache(trace_at, optimizer, time_limit_s)
    return SearchCache(trace_at, optimizer, time_limit_s, masters=mixed_precision.masters(model),
                       reduce_dtype=mixed_precision.reduce_dtype)


def stages_for(traced: TracedGraph, plan: PipelinePlan) -> tuple[StageGraph, ...]:
    """`traced` (at the micro-batch's size) cut where the plan's stages start, each checked to start at the op the
    plan names."""
    layers = find_layers(traced)
    if layers.batch_statistics and plan.microbatches > 1:
        raise CutError(f"{traced.model_name} normalises over the batch (batch norm in training mode): {plan.microbatches} "
                       "micro-batches would each be normalised by their own statistics, not the batch's; plan it with one "
                       "micro-batch, or without pp")
    ops = [n.name for n in traced.graph.nodes if n.op == "call_function"]
    for i, s in enumerate(plan.stages[1:], 1):
        if s.start >= len(ops) or ops[s.start] != s.first_op:
            found = ops[s.start] if s.start < len(ops) else "past the last op"
            raise CutError(f"the plan's stage {i} starts at op {s.start} ({s.first_op}), but this model's op {s.start} is "
                           f"{found}: the plan was made for another model or batch; plan again")
    return cut(traced, tuple(s.start for s in plan.stages[1:]), layers)


def is_pipeline_plan(plan: Any) -> bool:
    """`plan` is a `PipelinePlan` or the path of a pipeline plan's JSON file."""
    if isinstance(plan, PipelinePlan):
        return True
    if not isinstance(plan, (str, Path)) or not Path(plan).is_file():
        return False
    try:
        return is_pipeline_dict(json.loads(Path(plan).read_text()))
    except json.JSONDecodeError:
        return False


def pipeline_or_flat(model: nn.Module, sample_input: Any, device_mesh: Any, pp: PP | None, plan: Any,
                     memory_budget: float | None, hardware: str | Mesh | None, optimizer: str, time_limit_s: float,
                     batch_dim: BatchDim, flat: Callable[[Plan | None], Any]) -> Any:
    """`autopar.parallelize` with `pp` or a pipeline plan: the plan given, or rank 0's choice between pipeline
    stages and the single-mesh plan (`choose`), run as a `PipelineModule` or handed to `flat` (`parallelize`
    with that plan)."""
    if pp is not None:
        check_pp(pp)
    if plan is not None:
        if not isinstance(plan, PipelinePlan):
            plan = load_pipeline_plan(plan)
        return parallelize_pipeline(model, sample_input, plan, batch_dim)
    shape = tuple(device_mesh.shape) if hasattr(device_mesh, "shape") else tuple(device_mesh)
    num_devices = math.prod(shape)

    def chosen() -> Plan | PipelinePlan:  # on rank 0
        device = "meta" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        preset = hardware or (_local_gpu_preset() if device == "meta" else "cpu")
        mesh = preset.with_shape(shape) if isinstance(preset, Mesh) else make_mesh(num_devices, shape, preset)
        whole = trace_copy(model, sample_input, device, batch_dim=batch_dim)
        try:
            flat_plan = solve(whole, profile(whole, optimizer=optimizer), mesh, memory_budget_bytes=memory_budget,
                              time_limit_s=time_limit_s)
        except InfeasibleError:
            flat_plan = None
        return choose(flat_plan, search_cache(model, sample_input, device, batch_dim, optimizer, time_limit_s),
                      global_batch(whole), num_devices, pp or "auto", preset, memory_budget, optimizer, time_limit_s)

    # (what rank 0 raises, no plan fitting the budget, is raised on every rank)
    found = from_rank0(chosen, _plan_text, _plan_of_text)
    if isinstance(found, PipelinePlan):
        return parallelize_pipeline(model, sample_input, found, batch_dim)
    return flat(found)


def _plan_text(plan: Plan | PipelinePlan) -> str:
    return json.dumps(pipeline_to_dict(plan)) if isinstance(plan, PipelinePlan) else plan_to_json(plan)


def _plan_of_text(text: str) -> Plan | PipelinePlan:
    obj = json.loads(text)
    return pipeline_from_dict(obj) if is_pipeline_dict(obj) else plan_from_json(text)


def _local_gpu_preset() -> str:
    device = torch.cuda.current_device()
    return preset_for_device(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)


def global_batch(traced: TracedGraph) -> int:
    """The batch size the model was traced at: its first batched input's size along its batch dim."""
    for name, dim in traced.batch_dim_of().items():
        if dim is not None:
            return int(traced.node(name).meta["val"].shape[dim])
    raise CutError(f"{traced.model_name} has no input with a batch dim to cut into micro-batches: pass batch_dim, or "
                   "leave pp out")


def parallelize_pipeline(model: nn.Module, sample_input: Any, plan: PipelinePlan, batch_dim: BatchDim = 0) -> PipelineModule:
    """This rank's stages of `model` under `plan`, in an initialised world of the plan's size.

    sample_input: the GLOBAL batch (as for `autopar.parallelize`), traced at one micro-batch's size."""
    pmesh = PipelineMesh(plan)
    micro = microbatch_sample(sample_input, plan.microbatches, batch_dim)
    traced = trace_copy(model, micro, _capture_device(pmesh.stage), batch_dim=batch_dim)
    pm = build_pipeline(model, traced, plan, pmesh)
    if dist.get_rank() == 0:
        log.info("pipeline: %s as %d stages on pp=%d x %s, %s over %d micro-batches", type(model).__name__,
                 len(plan.stages), plan.pp, "x".join(map(str, plan.stage_mesh_shape)), plan.schedule, plan.microbatches)
    return pm


def build_pipeline(model: nn.Module, traced: TracedGraph, plan: PipelinePlan, pmesh: PipelineMesh | None = None) -> PipelineModule:
    """`parallelize_pipeline` for `model` traced already at the micro-batch's size (`microbatch_sample`): cut
    as the plan says, this rank's stages lowered under their plans with `model`'s tensors."""
    pmesh = pmesh or PipelineMesh(plan)
    stages = stages_for(traced, plan)
    if len(stages) != len(plan.stages):
        raise PipelineError(f"cut into {len(stages)} stages for a plan of {len(plan.stages)}")
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    modules = {}
    for i, stage in enumerate(stages):
        if plan.rank_of(i) != pmesh.pp_rank:
            continue
        stage_plan = plan.stages[i].plan
        running = stage_plan.mesh.with_shape(pmesh.stage.shape, pmesh.stage.axis_names)
        check_plan(stage_plan, stage.traced, running, stage_plan.fingerprint.budget_bytes)
        gm = lower(stage.traced, stage_plan, pmesh.stage, params=params, buffers=buffers)
        modules[i] = StageModule(gm, stage)
    return PipelineModule(plan, traced, stages, modules, pmesh)
