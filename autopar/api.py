"""`autopar.parallelize`: trace, profile, solve (or take a plan) and lower, in one call.

    pm = autopar.parallelize(model, {"input_ids": ids, "labels": labels}, device_mesh=(2, 2),
                             mixed_precision=autopar.MixedPrecision(torch.bfloat16))  # optional: bf16 compute
    opt = torch.optim.AdamW(pm.parameters())  # float32 masters, float32 state
    loss = pm(**pm.local_batch(batch))  # rank r feeds rows [r*B/W, (r+1)*B/W) of the global batch, whatever the plan
    loss.backward(); opt.step()

Runs inside an initialised process group (torchrun, or `autopar.runtime.launch.run_ranks`).
"""
from __future__ import annotations

import copy
import logging
import math
import os
import time
import weakref
from pathlib import Path
from typing import AbstractSet, Any, Callable, Iterable, Literal, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils.weight_norm import WeightNorm
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.codegen.module_tree import dress_like
from autopar.codegen import ParallelModule, lower
from autopar.codegen.module import Retracer
from autopar.errors import PARALLELIZE_DEVICE_ONLY_KNOBS, PARALLELIZE_KNOBS, InfeasibleError, InvalidValueError, TraceError
from autopar.mixed_precision import MixedPrecision
from autopar.profiler import profile
from autopar.profiler.types import GraphProfile
from autopar.runtime import arrival
from autopar.runtime.lockstep import from_rank0, on_every_rank
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.offload import offloaded_names
from autopar.runtime.optimizers import alike_by_design, replaced
from autopar.solver import solve, solve_keeping_params
from autopar.solver.mesh import Mesh, Precision, make_mesh, preset_for_device
from autopar.solver.offload import host_budget_per_rank, offloaded_profile, with_offload
from autopar.solver.plan import Plan
from autopar.solver.plan_io import check_plan, load_plan, plan_from_json, plan_to_json
from autopar.tracer import TracedGraph, trace
from autopar.tracer.batch_dims import BatchDim, BatchDimError
from autopar.tracer.closures import rebind_closures
from autopar.tracer.lifted import link_lifted_state
from autopar.values import mesh_shape, positive

log = logging.getLogger(__name__)


def capture_copy(model: nn.Module, sample: Any, device: str = "meta",
                 dtypes: Mapping[str, torch.dtype] | None = None) -> tuple[nn.Module, Any]:
    """A copy of `model` and `sample` holding no memory, for the tracer: tensors on `meta`, or fake
    tensors (one `FakeTensorMode`) on `device`, tied weights still tied; `dtypes[fqn]`, where given, is
    a parameter's or buffer's dtype in the copy (`model`'s own, elsewhere).

    Model code may branch on its tensors' device (transformers' MoE routing counts tokens per
    expert in float on CPU, in int elsewhere, since CPU's `histc` has no integer kernel): traced
    on meta it takes the non-CPU branch, which a CPU run cannot execute. So a run on CPU traces on
    fake CPU tensors. On GPUs the meta device stands in for CUDA, as in `autopar plan`, so that a
    plan made there matches the graph `parallelize` traces. (`copy.deepcopy(model).to(...)`
    unties weights: `.to` across device types makes a new Parameter per attribute.)
    """
    lazy = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if nn.parameter.is_lazy(t)]
    if lazy:
        raise TraceError(f"cannot trace {type(model).__name__}: {', '.join(lazy[:5])}{' ...' if len(lazy) > 5 else ''} "
                         "do not exist yet (a lazy module, nn.LazyLinear and the like, makes them in its first "
                         "forward)\n  fix: run the model once on a batch first, `model(*batch)` or `model(**batch)`, "
                         "so that every parameter has its shape")
    if device == "meta":
        make = lambda t, dtype=None: torch.empty_like(t, device="meta", dtype=dtype)  # noqa: E731
    else:
        mode = FakeTensorMode()

        def make(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
            with mode:
                return torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device=device)
    dtypes = dtypes or {}
    memo: dict[int, Any] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        memo.setdefault(id(p), nn.Parameter(make(p, dtypes.get(name)), requires_grad=p.requires_grad))
    for name, b in model.named_buffers(remove_duplicate=False):
        memo.setdefault(id(b), make(b, dtypes.get(name)))
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm):
                # torch.nn.utils.weight_norm (deprecated, in older vocoders and GANs) keeps `g * v / |v|` as a
                # plain attribute, a tensor with a gradient history that cannot be deep-copied; its pre-hook
                # computes it again at every forward, so the copy takes a placeholder of its shape
                weight = getattr(module, hook.name)
                memo.setdefault(id(weight), make(weight.detach()))
    copied = copy.deepcopy(model, memo)
    rebind_closures(copied, memo)  # a lambda over a submodule (minGPT's `mlpf`) reads the copy's, not the model's
    return copied, pytree.tree_map_only(torch.Tensor, make, sample)


def trace_copy(model: nn.Module, sample: Any, device: str, dtypes: Mapping[str, torch.dtype] | None = None,
               owner: nn.Module | None = None, **trace_options: Any) -> TracedGraph:
    """`model` traced on a copy (`capture_copy`), each constant the export lifted that is a parameter or buffer of
    the copy or of `owner` (default `model`: the model whose tensors a forward may reach past its copy) read as that
    one (`tracer.lifted`). trace_options: `trace`'s."""
    copied, batch = capture_copy(model, sample, device, dtypes)
    return link_lifted_state(trace(copied, batch, **trace_options), copied, model if owner is None else owner)


def _capture_device(mesh: ProcessMesh) -> str:
    return "cpu" if mesh.device_mesh.device_type == "cpu" else "meta"


def capture_device_for(hardware: str, mixed_precision: MixedPrecision | None = None) -> str:
    """The device `parallelize` traces on where a plan for `hardware` (a `Mesh.hardware` name) runs: a plan
    made ahead (`autopar plan --save`) must be traced the same way to match. Exported on fake CPU tensors,
    a `.contiguous()` the CPU kernels already satisfy leaves no `clone` in the graph; on meta it does
    (gpt2, llama, bert-tiny: two each). Under a mixed-precision policy: on CPU everywhere (its autocast
    casts fake CPU tensors, not meta ones: `autopar.mixed_precision`)."""
    return "cpu" if mixed_precision is not None or hardware == "cpu" or hardware.endswith("-cpu") else "meta"


def traced_model(model: nn.Module, sample: Any, device: str, batch_dim: BatchDim = 0,
                 mixed_precision: MixedPrecision | None = None, dtypes: Mapping[str, torch.dtype] | None = None,
                 training: bool = True, owner: nn.Module | None = None) -> TracedGraph:
    """`model` traced on a copy holding no memory (`trace_copy` on `device`, its tensors in `dtypes` where given,
    `owner` as there), as `parallelize` traces it: under a mixed-precision policy with the parameters it computes
    on in the compute dtype, under its autocast, on fake CPU tensors."""
    if mixed_precision is None:
        return trace_copy(model, sample, device, dtypes, owner, training=training, batch_dim=batch_dim)
    dtypes = {**(dtypes or {}), **mixed_precision.compute_dtypes(model)}
    with mixed_precision.autocast():
        return trace_copy(model, sample, "cpu", dtypes, owner, training=training, batch_dim=batch_dim)


def parallelize(
    model: nn.Module,
    sample_input: Any,
    device_mesh: tuple[int, ...] | DeviceMesh,
    memory_budget: float | None = None,
    hardware: str | Mesh | None = None,
    plan: Plan | str | Path | None = None,
    optimizer: str = "adamw",
    input_layout: Literal["shard", "replicate"] = "shard",
    time_limit_s: float = 30.0,
    batch_dim: BatchDim = 0,
    mixed_precision: MixedPrecision | None = None,
    call_timeout_s: float = arrival.TIMEOUT_S,
    drift_check_every: int = 100,
    pp: Literal["auto"] | int | None = None,
    offload: str | Iterable[str] | None = None,
    host_memory_bytes: float | None = None,
) -> ParallelModule:
    """Return `model` parallelized over `device_mesh` as a `ParallelModule` (local shards, same FQNs).

    sample_input: the GLOBAL batch (tensor, tuple of args, dict of kwargs, or `autopar.tracer.CallArguments(args,
        kwargs)` for both), used for tracing only.
    memory_budget: bytes per device (default: the hardware's memory).
    hardware: a preset name of `autopar.solver.mesh.PRESETS` (default: "cpu", or on CUDA the preset of this rank's
      GPU by its name, `preset_for_device`) or a `Mesh` whose numbers the solver uses; ignored when `plan` is given.
      A preset is priced at the model's math mode (`training_precision`).
    plan: a `Plan` or the path of a JSON plan file; checked against the traced model.
    time_limit_s: CPU seconds the plan search may take in all (`autopar.solver.clock`); stopped there, it answers
      with the best plan found, never slower than the fastest textbook plan that fits.
    input_layout: "shard": each rank feeds its contiguous slice of the global batch along dim 0
      (global_batch / world_size rows, ranks in row-major mesh order; `autopar.runtime.batch`), the
      same for every plan, and gets non-loss outputs back sliced the same way; "replicate": every
      rank feeds (and gets back) the whole batch. The loss is always the global loss on every rank.
    batch_dim: which dim of each input holds the batch, for input_layout "shard" (`autopar.tracer.batch_dims`):
      0, or 1 for a sequence-first model's `(seq, batch)` inputs (nn.LSTM's and nn.Transformer's default), or
      one per input shaped as `sample_input` (`(1, 0)` for `(x, labels)` with labels `(batch,)`; None for an
      input fed whole). Each rank then feeds its slice along those dims, as a DDP loop does; a non-loss output
      comes back cut along the first batched input's dim (or dim 0) where it has the batch's size there.
    pp: "auto" lets the solver cut the model into pipeline stages where that predicts a faster step than any plan
      without them; a number asks for that many pp ranks. A pipeline comes back as an
      `autopar.pipeline.module.PipelineModule` (train with `loss = pm.step(**pm.local_batch(batch))`, then the optimizer's
      step), and so does a pipeline plan given as `plan` (`PipelinePlan` or its JSON file). Its ranks agree on
      the plan by rank 0's broadcast; call_timeout_s and drift_check_every apply to plans without stages.
    call_timeout_s: how long a call every rank must make (a state dict, a checkpoint, the first forward and each
      change of mode) waits for the other ranks before raising `CallMismatchError`, naming those that did not
      come and the call each was last in (`runtime.arrival`); `pm.call_timeout_s` changes it later.
    drift_check_every: compare the copies of every replicated parameter across ranks every this many training
      forwards (`runtime.drift`: a checksum each), raising `DriftError` naming the parameter when they differ;
      0: only before each save, where it always runs. `pm.drift_check_every` changes it later.
    mixed_precision: `autopar.MixedPrecision(param_dtype, reduce_dtype)`: forward and backward compute in `param_dtype`
      on copies of the float32 parameters (which the optimizer steps), the losses in float32 as autocast computes
      them, gradients summed over ranks in `reduce_dtype` (`autopar.mixed_precision`); None: the model's own dtypes.

    offload: keep optimizer state on the host and step it there (`runtime.offload`): "optimizer" for every
      parameter, or the FQNs of some; the optimizer made over `pm.parameters()` then holds host tensors for them
      (pinned where CUDA is), and the plan's device memory leaves their optimizer state out. "auto": the solver
      chooses each parameter's tier with its sharding, ZeRO and recompute, where the host tier makes a plan fit or
      faster (`solver.offload`); None (the default): every optimizer state on the device, and `pm.parameters()`
      the device tensors. With `plan` given, the plan's tiers are used (`autopar plan --offload`).
    host_memory_bytes: with offload="auto", the host memory of this machine the host tier may use, shared by
      its ranks (LOCAL_WORLD_SIZE, else the world); default: 3/4 of the machine's physical memory.

    Errors are raised on every rank alike: one raised while tracing or checking a plan on any rank, or while
    solving on rank 0, so that a loop catching it and calling `parallelize` again does so on every rank.
    """
    from autopar.pipeline.api import is_pipeline_plan, pipeline_or_flat  # (it builds on this module)

    if pp is not None or is_pipeline_plan(plan):
        if mixed_precision is not None:
            raise ValueError("pipeline stages run in the model's own dtypes: pass mixed_precision or pp, not both (cast "
                             "the model with model.to(dtype) for a low-precision pipeline)")
        if offload is not None:
            raise InvalidValueError(f"offload={offload!r} with pipeline stages: the pipeline's stages keep their optimizer "
                                    "state on the device; pass offload or pp, not both")
        return pipeline_or_flat(model, sample_input, device_mesh, pp, plan, memory_budget, hardware, optimizer, time_limit_s,
                                batch_dim, lambda flat: parallelize(model, sample_input, device_mesh, memory_budget, hardware,
                                                                    flat, optimizer, input_layout, time_limit_s, batch_dim,
                                                                    call_timeout_s=call_timeout_s,
                                                                    drift_check_every=drift_check_every))
    if input_layout == "replicate" and batch_dim != 0:
        raise BatchDimError(f"batch_dim={batch_dim!r} says along which dims the ranks split the batch, but with "
                            "input_layout='replicate' every rank feeds the whole batch: leave batch_dim out, or use 'shard'")
    if memory_budget is not None:
        memory_budget = positive("memory_budget", memory_budget, "bytes per device, e.g. 80e9, or None for the hardware's memory")
    time_limit_s = positive("time_limit_s", time_limit_s, "seconds per ILP search, e.g. 30.0")
    call_timeout_s = positive("call_timeout_s", call_timeout_s, "seconds, e.g. 60.0")
    if isinstance(drift_check_every, bool) or not isinstance(drift_check_every, int) or drift_check_every < 0:
        raise InvalidValueError(f"drift_check_every={drift_check_every!r}: a whole number of training steps, e.g. "
                                "100, or 0 to compare replicated parameters only before each save")
    if not isinstance(device_mesh, DeviceMesh):
        device_mesh = mesh_shape("device_mesh", device_mesh)
    auto = offload == "auto"
    if host_memory_bytes is not None:
        if not auto:
            raise InvalidValueError(f"host_memory_bytes={host_memory_bytes!r} bounds the host tier the solver chooses; "
                                    "pass offload='auto' with it, or leave it out")
        host_memory_bytes = positive("host_memory_bytes", host_memory_bytes, "bytes of host memory, e.g. 256e9")
    offloaded = frozenset() if auto else offloaded_names(offload, dict(model.named_parameters()))
    start = time.perf_counter()
    pmesh = ProcessMesh(device_mesh)
    device = _capture_device(pmesh)

    def traced_and_checked() -> tuple[TracedGraph, Plan | None]:
        traced = traced_model(model, sample_input, device, batch_dim, mixed_precision)
        if plan is None:
            return traced, None
        given = plan if isinstance(plan, Plan) else load_plan(plan)
        # Checked against the mesh we run on (the plan's hardware numbers, this world's shape), so a plan
        # made for another device count fails here, naming the mesh, rather than somewhere in lowering.
        running = given.mesh.with_shape(pmesh.shape, pmesh.axis_names)
        check_plan(given, traced, running, given.fingerprint.budget_bytes)
        if offload is not None and not auto and offloaded != set(given.offloaded()):
            raise InvalidValueError(f"offload={offload!r}, but the plan given keeps {len(given.offloaded())} parameters' "
                                    "optimizer state on the host: a plan records each parameter's tier. Leave offload "
                                    "out to use the plan's, or plan again with `autopar plan --offload`")
        return traced, given

    # an error on any rank (a trace that fails, a plan that does not match) is raised on every rank, as is the
    # solver's on rank 0: a loop that catches it and tries again starts again on every rank at once
    traced, given = on_every_rank(traced_and_checked)
    host_budget = host_budget_per_rank(host_memory_bytes, int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))) \
        if auto else None
    plan = given or _solve_on_rank0(traced, pmesh, memory_budget, hardware, optimizer, time_limit_s, model, mixed_precision,
                                    offloaded, host_budget)
    gm = lower(
        traced, plan, pmesh,
        params=dict(model.named_parameters(remove_duplicate=False)),
        buffers=dict(model.named_buffers(remove_duplicate=False)),
        input_layout=input_layout,
        reduce_dtype=None if mixed_precision is None else mixed_precision.reduce_dtype,
    )
    if dist.get_rank() == 0:
        log.info("parallelize: %s on mesh %s in %.2f s (est. step %.1f ms)", type(model).__name__, pmesh.shape,
                 time.perf_counter() - start, plan.time.total_s * 1e3)
        for note in plan.notes:  # what `autopar plan` prints under the plan (`solver.notes`)
            log.info("parallelize: %s", note)
        # (weight_norm's pre-hook computes the weight, which the graph does too: nothing is lost there)
        hooked = [name or type(model).__name__ for name, m in model.named_modules()
                  if m._forward_hooks or any(not isinstance(h, WeightNorm) for h in m._forward_pre_hooks.values())]
        if hooked:
            log.warning("parallelize: forward hooks on %s ran once, while tracing (what they changed in the outputs is "
                        "in the graph), and do not run in the parallel module's forward, which calls ops, not modules: "
                        "read activations from the module's outputs instead", hooked[:5])
    retracer = make_retracer(model, sample_input, device, optimizer, time_limit_s, batch_dim, mixed_precision)
    pm = ParallelModule(gm, traced, pmesh, plan, retracer, mixed_precision)
    pm.call_timeout_s = call_timeout_s
    pm.drift_check_every = drift_check_every
    dress_like(pm, model)  # submodules of the model's classes: code that sorts parameters by module type
    replaced(model, pm)  # an optimizer made from the model's parameters is refused at its first step
    pm.expect_equal_blocks(*alike_by_design(dict(model.named_parameters()), pm.param_storage(), pmesh))
    _warn_when_read_stale(model, pm)
    # code written against the model reads its plain attributes (a Hugging Face model's config, generation_config,
    # name_or_path): the parallel module has them too; its own names and the model's methods are not copied
    for name, value in vars(model).items():
        if not (name.startswith("_") or hasattr(pm, name) or callable(value) or isinstance(value, torch.Tensor)):
            setattr(pm, name, value)
    if not model.training:  # as the model would run (`from_pretrained` returns a model in eval mode)
        pm.eval()
        if dist.get_rank() == 0:
            log.warning("parallelize: %s is in eval mode, and so is the parallel module (dropout off, batch norm's "
                        "running statistics used): call pm.train() to train in training mode", type(model).__name__)
    return pm


def _warn_when_read_stale(model: nn.Module, pm: ParallelModule) -> None:
    """`model.state_dict()` after the parallel module trained, the model untouched, warns (once a process).

    DDP trains the model's own parameters, so a DDP loop saves `model.state_dict()` at the end; the
    parallel module trains its own tensors, and that saved the weights of before training, silently.
    Version counters tell, at no cost: an optimizer's step bumps the module's; the model's stay as
    they were unless something changed them (the model trained eagerly beside: no warning)."""
    model_versions = [p._version for p in model.parameters()]
    module_versions = [p._version for p in pm.parameters()]
    module = weakref.ref(pm)

    def hook(_: nn.Module, prefix: str, keep_vars: bool) -> None:
        pm = module()
        if prefix or pm is None or _stale_warned or dist.get_rank() != 0:
            return
        trained = any(p._version != v for p, v in zip(pm.parameters(), module_versions))
        untouched = all(p._version == v for p, v in zip(model.parameters(), model_versions))
        if trained and untouched:
            _stale_warned.append(True)
            log.warning("parallelize: %s.state_dict() gives the weights it had when parallelized: the parallel module "
                        "trains its own tensors, not the model's. Save pm.state_dict() (full tensors, every rank "
                        "calls it) or pm.save_checkpoint(path)", type(model).__name__)

    model.register_state_dict_pre_hook(hook)


_stale_warned: list[bool] = []  # the warning was given in this process


def make_retracer(model: nn.Module, sample_input: Any, device: str, optimizer: str = "adamw", time_limit_s: float = 30.0,
                  batch_dim: BatchDim = 0, mixed_precision: MixedPrecision | None = None) -> Retracer:
    """How a `ParallelModule` of `model` traces it again (on `device`, as it was first) for inputs it was not
    lowered for, and plans a graph with other ops than its plan's (on rank 0: every rank calls it at once).
    The model's code is kept with its parameters on `meta`. Under a mixed-precision policy every graph is
    traced under it (a caller's autocast adds no casts of its own: the graph casts where the policy does)."""
    shape_only = capture_copy(model, sample_input, "meta")[0]

    def traced(batch: Any, training: bool, autocast: torch.dtype | None, dtypes: Mapping[str, torch.dtype]) -> TracedGraph:
        if autocast is None or mixed_precision is not None:
            return traced_model(shape_only, batch, device, batch_dim, mixed_precision, dtypes, training, owner=model)
        # autocast casts the tensors of its device type, so on GPUs the model is traced on fake CUDA tensors
        # (meta ones it would leave alone)
        cast_device = "cpu" if device == "cpu" else "cuda"
        with torch.autocast(cast_device, dtype=autocast):
            return trace_copy(shape_only, batch, cast_device, dtypes, model, training=training, batch_dim=batch_dim)

    return Retracer(
        trace=traced,
        replan=lambda graph, planned, buffers: _on_rank0(lambda: solve_keeping_params(
            graph, profiled(graph, optimizer, shape_only, mixed_precision), planned.mesh, planned.params, planned.fingerprint.budget_bytes,
            time_limit_s, buffers)),
    )


def profiled(traced: TracedGraph, optimizer: str, model: nn.Module, mixed_precision: MixedPrecision | None) -> GraphProfile:
    """`profile(traced)` of `model` traced under `mixed_precision` (its masters, its reduce dtype) if any."""
    if mixed_precision is None:
        return profile(traced, optimizer=optimizer)
    return profile(traced, optimizer=optimizer, masters=mixed_precision.masters(model), reduce_dtype=mixed_precision.reduce_dtype)


def _solve_on_rank0(traced: TracedGraph, pmesh: ProcessMesh, memory_budget: float | None, hardware: str | Mesh | None,
                    optimizer: str, time_limit_s: float, model: nn.Module, mixed_precision: MixedPrecision | None,
                    offloaded: AbstractSet[str] = frozenset(), host_budget_bytes: float | None = None) -> Plan:
    """Rank 0 solves and broadcasts the plan (with `offloaded` on the host tier: their state off the device; with
    `host_budget_bytes`, each parameter's tier chosen by the solver)."""
    def solved() -> Plan:
        if isinstance(hardware, Mesh):
            mesh = hardware.with_shape(pmesh.shape, pmesh.axis_names)
        else:
            mesh = make_mesh(math.prod(pmesh.shape), pmesh.shape, hardware or local_preset(pmesh), pmesh.axis_names,
                             precision="bf16" if mixed_precision is not None else training_precision(traced))
        prof = profiled(traced, optimizer, model, mixed_precision)
        try:
            plan = solve(traced, offloaded_profile(prof, offloaded), mesh, memory_budget_bytes=memory_budget,
                         time_limit_s=time_limit_s, host_budget_bytes=host_budget_bytes)
        except InfeasibleError as err:  # its fix in parallelize's words: memory_budget=, offload=
            device_only = host_budget_bytes is None and not offloaded
            raise err.worded_for(PARALLELIZE_DEVICE_ONLY_KNOBS if device_only else PARALLELIZE_KNOBS) from None
        return with_offload(plan, offloaded)
    return _on_rank0(solved)


def local_preset(pmesh: ProcessMesh) -> str:
    """The preset of the devices `pmesh` runs on: "cpu", or this rank's GPU's by its name (an error naming the
    fix for a GPU no preset describes)."""
    if pmesh.device_mesh.device_type != "cuda":
        return "cpu"
    device = torch.cuda.current_device()
    return preset_for_device(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)


def training_precision(traced: TracedGraph) -> Precision:
    """The math mode the model's matmuls run in: bf16 where its floating-point parameters are all bf16 or fp16,
    else TF32 or fp32 as torch is set for float32 matmuls (`torch.set_float32_matmul_precision`: "highest", its
    default, keeps fp32)."""
    values = (traced.node(name).meta.get("val") for name in traced.param_fqns)
    dtypes = {v.dtype for v in values if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}
    if dtypes and dtypes <= {torch.bfloat16, torch.float16}:
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _on_rank0(make_plan: Callable[[], Plan]) -> Plan:
    """The plan rank 0 makes, on every rank (as JSON): a time-limited ILP need not agree across ranks. What it
    raises (no plan fits the budget) is raised on every rank."""
    return from_rank0(make_plan, plan_to_json, plan_from_json)
