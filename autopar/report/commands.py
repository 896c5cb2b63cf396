"""The CLI's subcommands (`autopar.cli` parses arguments and handles errors; these do the work).

Each `cmd_*` drives the pipeline stages (trace -> profile -> solve) and the report
builders, prints to stdout and returns the exit code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from rich.table import Table
from rich.text import Text

from autopar.errors import InfeasibleError, PlanMismatchError, UsageError
from autopar.report.console import out_console, phase
from autopar.report.explain import ExplainContext, diff, explain, make_context
from autopar.report.html import write_html
from autopar.report.render import plan_report
from autopar.report.summary import summarize
from autopar.report.terminal import diff_report, explain_report
from autopar.report.units import fmt_bytes, fmt_seconds
from autopar.solver.mesh import Mesh
from autopar.solver.plan import Plan, PlanSource



# ---------------------------------------------------------------- model and mesh
def _source(args: Any) -> PlanSource:
    if bool(args.model) == bool(args.hf_config):
        raise UsageError(
            "give either MODEL.py or --hf-config, not " + ("both" if args.model else "neither")
            + "\n  fix: e.g. `autopar plan examples/gpt2.py --gpus 8` or `autopar plan --hf-config gpt2 --gpus 8`"
        )
    if args.model and not Path(args.model).is_file():
        raise UsageError(f"model file {args.model!r} does not exist\n  fix: pass the path of a .py file, e.g. examples/gpt2.py")
    return PlanSource(args.model or "", args.hf_config or "", args.batch_size, args.seq_len, args.size, getattr(args, "optimizer", "adamw"),
                      getattr(args, "precision", ""))


def _build(source: PlanSource):
    from autopar.model_file import load_hf_preset, load_model_file

    if source.hf_config:
        if source.size:
            raise UsageError(f"--size is for MODEL.py files, not --hf-config {source.hf_config}\n  fix: drop --size")
        return load_hf_preset(source.hf_config, source.batch_size, source.seq_len)
    extra = {"size": source.size} if source.size else {}
    return load_model_file(source.model_file, source.batch_size, source.seq_len, **extra)


def _trace_and_profile(source: PlanSource, hardware: str = ""):
    """`hardware`: the `Mesh.hardware` the plan runs on; traced as `parallelize` will trace it there (under the
    mixed-precision policy `source.precision` names, if any)."""
    from autopar.api import capture_device_for, profiled, traced_model
    from autopar.mixed_precision import POLICIES
    from autopar.model_file import model_file_batch_dim
    from autopar.tracer import trace
    from autopar.tracer.lifted import link_lifted_state

    policy = POLICIES[source.precision or "fp32"]
    with phase("loading model"):
        model, sample = _build(source)
    with phase("tracing"):
        device = capture_device_for(hardware, policy)
        batch_dim = model_file_batch_dim(source.model_file) if source.model_file else 0
        if device == "meta":
            traced = link_lifted_state(trace(model, sample, batch_dim=batch_dim), model)
        else:
            traced = traced_model(model, sample, device, batch_dim, policy)
    with phase("profiling"):
        prof = profiled(traced, source.optimizer, model, policy)
    return traced, prof


def _mesh(hardware: str, gpus: int, shape: tuple[int, ...] | None, precision: str = "") -> Mesh:
    """A preset name priced at `precision` (`autopar plan --precision`), or a mesh file from `autopar calibrate --save`
    laid out as `shape` (default: 1-D)."""
    if hardware.endswith(".json") or Path(hardware).is_file():
        from autopar.solver.plan_io import load_mesh

        if not Path(hardware).is_file():
            raise UsageError(f"hardware file {hardware!r} does not exist\n  fix: run `autopar calibrate --gpus N --save {hardware}` first, or pass a preset name")
        return load_mesh(hardware).with_shape(shape or (gpus,))
    from autopar.solver.mesh import PRESETS, make_mesh

    if hardware not in PRESETS:
        raise UsageError(f"unknown hardware {hardware!r}\n  fix: use one of {', '.join(sorted(PRESETS))}, or a mesh JSON from `autopar calibrate --save`")
    return make_mesh(gpus, shape=shape, hardware=hardware, precision=precision or None)


# ---------------------------------------------------------------- plan
def _solve(args: Any, traced, prof, budget: float | None) -> tuple[Plan, list]:
    """The plan with the textbook baselines priced on its mesh, and what each mesh shape tried would give
    (empty when --mesh or a mesh file fixes the shape); --offload's parameters on the host tier, or with --offload
    auto each parameter's tier chosen by the solver within --host-memory."""
    from autopar.solver import solve, solve_for_devices
    from autopar.solver.offload import host_budget_per_rank, offloaded_profile, with_offload

    auto = getattr(args, "offload", None) == "auto"
    if getattr(args, "host_memory", None) is not None and not auto:
        raise UsageError(f"--host-memory {args.host_memory:g} bounds the tier the solver chooses: add --offload auto")
    host_budget = host_budget_per_rank(args.host_memory, min(args.gpus, args.gpus_per_node)) if auto else None
    offloaded = frozenset() if auto else _offloaded(args, prof)
    device_prof = offloaded_profile(prof, offloaded)
    with phase("solving and pricing baselines") as progress, _offload_suggested(not auto and not offloaded):
        if args.mesh or args.hardware.endswith(".json") or Path(args.hardware).is_file():
            plan, shapes = solve(traced, device_prof, _mesh(args.hardware, args.gpus, args.mesh, args.precision),
                                 memory_budget_bytes=budget, time_limit_s=args.time_limit, baselines=True, progress=progress,
                                 host_budget_bytes=host_budget), []
        else:
            plan, shapes = solve_for_devices(traced, device_prof, args.gpus, hardware=args.hardware, memory_budget_bytes=budget,
                                             time_limit_s=args.time_limit, baselines=True, precision=args.precision,
                                             progress=progress, host_budget_bytes=host_budget)
    return with_offload(plan, offloaded), shapes


@contextlib.contextmanager
def _offload_suggested(device_only: bool) -> Iterator[None]:
    """An infeasible plan whose optimizer state was all kept on the device: its fix names the host tier too (`cli`)."""
    try:
        yield
    except InfeasibleError as err:
        err.device_only = device_only
        raise


def _offloaded(args: Any, prof) -> frozenset[str]:
    """The parameters `--offload` names ("optimizer": all; else FQNs separated by commas)."""
    from autopar.runtime.offload import offloaded_names

    given = getattr(args, "offload", None)
    if not given:
        return frozenset()
    names = given if given in ("optimizer", "all") else [n.strip() for n in given.split(",") if n.strip()]
    try:
        return offloaded_names(names, prof.params)
    except ValueError as err:
        raise UsageError(f"--offload {given}: {err}") from None


def _load_checked(args: Any, traced, budget: float | None) -> Plan:
    from autopar.solver.assemble import budget_of
    from autopar.solver.plan_io import check_plan, load_plan

    plan = load_plan(args.load)
    shape = args.mesh or (plan.mesh.shape if math.prod(plan.mesh.shape) == args.gpus else (args.gpus,))
    mesh = _mesh(args.hardware, args.gpus, shape, args.precision)
    check_plan(plan, traced, mesh, budget_of(mesh, budget))  # the solver's default budget when none is given
    return plan


def cmd_plan(args: Any) -> int:
    source = _source(args)
    if args.mesh and math.prod(args.mesh) != args.gpus:
        shape = "x".join(map(str, args.mesh))
        raise UsageError(f"--mesh {shape} has {math.prod(args.mesh)} devices but --gpus is {args.gpus}\n  fix: make the product of the --mesh sizes equal --gpus (or drop --mesh to try every shape)")
    hardware = _mesh(args.hardware, args.gpus, args.mesh).hardware  # unknown hardware fails before tracing
    if args.load and _is_pipeline_file(args.load):
        return _emit_pipeline(_load_pipeline(args.load), args.json)
    traced, prof = _trace_and_profile(source, hardware)
    budget = args.memory
    shapes: list = []
    if args.pp:
        return _plan_pipeline(args, source, traced, prof, hardware)
    if args.load:
        plan = _load_checked(args, traced, budget)
    else:
        plan, shapes = _solve(args, traced, prof, budget)
        plan = replace(plan, source=source)
    if args.save:
        from autopar.solver.plan_io import save_plan

        save_plan(plan, args.save)
    summary = summarize(plan)
    if args.html:
        write_html(summary, args.html)
    if shapes:
        summary["mesh_shapes_tried"] = [
            {"shape": list(r.shape), "step_s": r.step_s, "memory_bytes": r.memory_bytes, "error": r.error,
             "textbook_step_s": r.textbook_s, "searched": r.searched, "bound_step_s": r.bound_s} for r in shapes
        ]
    _emit(summary, args.json, saved=args.save, html=args.html)
    return 0


def _plan_pipeline(args: Any, source: PlanSource, traced, prof, hardware: str) -> int:
    """`plan --pp`: the single-mesh plan against the pipeline search's (`pipeline.choose`), the chosen one saved
    and shown."""
    from autopar.api import capture_device_for
    from autopar.errors import InfeasibleError
    from autopar.mixed_precision import POLICIES
    from autopar.model_file import model_file_batch_dim
    from autopar.pipeline.api import global_batch, search_cache
    from autopar.pipeline.choose import choose
    from autopar.pipeline.plan import PipelinePlan, save_pipeline_plan

    try:
        flat = replace(_solve(args, traced, prof, args.memory)[0], source=source)
    except InfeasibleError:
        flat = None
    model, sample = _build(source)
    batch_dim = model_file_batch_dim(source.model_file) if source.model_file else 0
    policy = POLICIES[source.precision or "fp32"]  # the stages traced and priced as the plan without them is
    cache = search_cache(model, sample, capture_device_for(hardware, policy), batch_dim, source.optimizer, args.time_limit,
                         policy)
    with phase("searching pipeline stages"):
        chosen = choose(flat, cache, global_batch(traced), args.gpus, args.pp, _hardware_arg(args), args.memory,
                        source.optimizer, args.time_limit, args.gpus_per_node, args.pp_time_limit)
    if not isinstance(chosen, PipelinePlan):
        if args.save:
            from autopar.solver.plan_io import save_plan

            save_plan(chosen, args.save)
        _emit(summarize(chosen), args.json, saved=args.save)
        return 0
    chosen = replace(chosen, source=source)
    if policy is not None:
        chosen = replace(chosen, notes=(*chosen.notes, f"stages priced under --precision {source.precision} ({policy.describe()}); "
                                        "parallelize runs pipeline stages in the model's own dtypes, not under "
                                        "mixed_precision"))
    if args.save:
        save_pipeline_plan(chosen, args.save)
    return _emit_pipeline(chosen, args.json, args.save)


def _hardware_arg(args: Any) -> Mesh:
    """--hardware as the pipeline search takes it: the preset at --precision's matmul rate (as the plan without
    stages prices it), or the mesh a calibration file holds."""
    if args.hardware.endswith(".json") or Path(args.hardware).is_file():
        return _mesh(args.hardware, args.gpus, None)
    from autopar.solver.mesh import PRESETS

    preset = PRESETS[args.hardware]
    return preset.at_precision(args.precision) if args.precision and preset.rates is not None else preset


def _is_pipeline_file(path: str) -> bool:
    from autopar.pipeline.api import is_pipeline_plan

    return is_pipeline_plan(path)


def _load_pipeline(path: str):
    from autopar.pipeline.plan import load_pipeline_plan

    return load_pipeline_plan(path)


def _emit_pipeline(plan: Any, as_json: bool, saved: str | None = None) -> int:
    from autopar.report.pipeline import pipeline_report, pipeline_summary

    summary = pipeline_summary(plan)
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=1) + "\n")
        return 0
    console = _print(pipeline_report(summary))
    if saved:
        console.print(f"plan saved to {saved}")
    return 0


def _print(parts: list) -> Any:
    """Each renderable on lines of its own (one `print` of several would join short ones on a line); the console."""
    console = out_console()
    for part in parts:
        console.print(part)
    return console


def _emit(summary: dict, as_json: bool, saved: str | None = None, html: str | None = None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=1) + "\n")
        return
    console = _print(plan_report(summary))
    tried = summary.get("mesh_shapes_tried", [])
    if len(tried) > 1:
        console.print("Mesh shapes tried: " + ", ".join(
            f"{'x'.join(map(str, r['shape']))} {_shape_outcome(r)}" for r in tried))
    for what, path in (("plan saved to", saved), ("HTML report written to", html)):
        if path:
            console.print(f"{what} {path}")


def _shape_outcome(r: dict) -> str:
    if r["step_s"] is not None:
        return fmt_seconds(r["step_s"])
    if r.get("bound_step_s") is not None:
        return f"no plan faster than {fmt_seconds(r['bound_step_s'])} (proven), slower than the plan chosen"
    return "does not fit" if r.get("searched", True) else "not searched (time limit spent)"


# ---------------------------------------------------------------- show / explain / diff
def _load(path: str) -> Plan:
    from autopar.solver.plan_io import load_plan

    if not Path(path).is_file():
        raise UsageError(f"plan file {path!r} does not exist\n  fix: create one with `autopar plan MODEL.py --gpus N --save {path}`")
    if _is_pipeline_file(path):
        raise UsageError(f"{path} is a pipeline plan, which explain and diff do not read yet\n  fix: `autopar show {path}` "
                         "lists its stages; each stage's plan is under \"stages\" in the JSON")
    return load_plan(path)


def cmd_show(args: Any) -> int:
    if Path(args.plan).is_file() and _is_pipeline_file(args.plan):
        return _emit_pipeline(_load_pipeline(args.plan), args.json)
    plan = _load(args.plan)
    summary = summarize(plan)
    if args.html:
        write_html(summary, args.html)
    _emit(summary, args.json, html=args.html)
    return 0


def _explain_context(plan: Plan, model_file: str | None) -> ExplainContext | None:
    """Re-trace the planned model so alternatives can be priced: the MODEL.py given on the command line, or the
    Hugging Face preset the plan names; None without either. The model file a plan records is never imported (a
    plan is data: whoever wrote it must not choose the code that runs), only named when --model is missing."""
    from autopar.solver.plan_io import plan_differences

    source = plan.source or PlanSource()
    if model_file:
        if not Path(model_file).is_file():
            raise UsageError(f"model file {model_file!r} does not exist\n  fix: pass the path of a .py file, e.g. examples/gpt2.py")
        source = replace(source, model_file=model_file, hf_config="")
    elif source.model_file:
        return None  # `cmd_explain` says to pass --model
    if not (source.model_file or source.hf_config):
        return None
    traced, prof = _trace_and_profile(source, plan.mesh.hardware)
    diffs = [d for d in plan_differences(plan, traced, plan.mesh, plan.fingerprint.budget_bytes) if "mesh" not in d and "hardware" not in d]
    if diffs:
        raise PlanMismatchError(f"the plan was made for a different model than {source.model_file or source.hf_config}: {'; '.join(diffs)}\n  fix: pass --model with the file the plan was made from", tuple(diffs))
    with phase("building the solver's problem"):
        return make_context(plan, traced, prof.evaluate())


def cmd_explain(args: Any) -> int:
    plan = _load(args.plan)
    from autopar.report.explain import find_nodes

    find_nodes(plan, args.target)  # an unknown name fails before the slow re-trace
    result = explain(plan, args.target, _explain_context(plan, args.model))
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
        return 0
    _print(explain_report(result))
    return 0


def cmd_diff(args: Any) -> int:
    a, b = _load(args.a), _load(args.b)
    d = diff(a, b)
    if args.json:
        sys.stdout.write(json.dumps(d, indent=1) + "\n")
        return 0
    _print(diff_report(d, args.a, args.b))
    return 0


# ---------------------------------------------------------------- profile / calibrate
def _flops(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} FLOP"


def cmd_profile(args: Any) -> int:
    from autopar.profiler import profile_table

    traced, prof = _trace_and_profile(_source(args))
    rows = profile_table(traced, prof)
    if args.json:
        sys.stdout.write(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
        return 0
    t = Table(title="Profile per layer (one training step, whole batch, one device)", title_justify="left")
    for col in ("module", "forward", "backward", "saved activations", "parameters"):
        t.add_column(col, justify="left" if col == "module" else "right")
    for r in rows:
        t.add_row(r.module or "(top level)", _flops(r.fwd_flops), _flops(r.bwd_flops), fmt_bytes(r.activation_bytes), fmt_bytes(r.param_bytes))
    t.add_row(Text("total", style="bold"), _flops(sum(r.fwd_flops for r in rows)), _flops(sum(r.bwd_flops for r in rows)),
              fmt_bytes(sum(r.activation_bytes for r in rows)), fmt_bytes(sum(r.param_bytes for r in rows)))
    out_console().print(t)
    return 0


def cmd_calibrate(args: Any) -> int:
    from autopar.runtime.launch import init_from_env

    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        init_from_env()
    try:
        _calibrate_and_report(args)
        if owned:
            dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        if owned:
            # Torn down before exit: left to interpreter shutdown, gloo's threads die with it and
            # a rank now and then aborts ("terminate called without an active exception").
            dist.destroy_process_group()
    return 0


def _calibrate_and_report(args: Any) -> None:
    from autopar.runtime.calibrate import calibrate
    from autopar.solver.plan_io import mesh_to_json

    import torch.distributed as dist

    if dist.get_world_size() != args.gpus:
        raise UsageError(f"--gpus {args.gpus} but the process group has {dist.get_world_size()} ranks\n  fix: launch with `torchrun --nproc_per_node {args.gpus} -m autopar.cli calibrate --gpus {args.gpus}`")
    mesh = calibrate()
    if dist.get_rank() == 0:
        if args.json:
            sys.stdout.write(mesh_to_json(mesh) + "\n")
        else:
            out_console().print(str(mesh))
            for a in mesh.axes:
                out_console().print(f"  axis {a.name}: size {a.size}, latency {fmt_seconds(a.alpha_s)}, bandwidth {a.beta_bytes_per_s / 1e9:.2f} GB/s")
            out_console().print(f"  compute {mesh.flops_per_s / 1e12:.2f} TFLOP/s, memory bandwidth {mesh.mem_bandwidth_bytes_per_s / 1e9:.1f} GB/s, memory {fmt_bytes(mesh.memory_bytes)}")
        if args.save:
            Path(args.save).write_text(mesh_to_json(mesh) + "\n")

