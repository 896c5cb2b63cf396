"""One model on the live world: calibrate, plan on rank 0, then measure every baseline and autopar's plans.

    results = run_ranks(run_model, 4, Case("gpt2", "tiny", 8, 128), timeout_s=900)
    results[0]          # ModelResult on rank 0 (None elsewhere)

Order matters for the numbers: calibration runs first on an idle world; rank 0
then traces, profiles and solves every plan (baselines' prices, autopar per budget)
while the others wait; measurements come last so no solve competes with them.
"""
from __future__ import annotations

import copy
import json
import logging
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.api import parallelize
from autopar.profiler.measure import block_paths, make_optimizer
from autopar.runtime.calibrate import calibrate
from autopar.solver.ilp import MEMORY_SLACK_BYTES
from autopar.solver.mesh import LinkCost, Mesh, MeshAxis, mesh_from_json, mesh_to_json
from autopar.solver.plan import Plan
from autopar.solver.plan_io import plan_from_json, plan_to_json
from autopar.tracer import split_sample_input

from benchmarks._common import load_example
from benchmarks.baselines.measure import Trainable, measure_interleaved
from benchmarks.baselines.overheads import tp_module_overhead_s
from benchmarks.baselines.predict import Predictor, scalar_reshard_s
from benchmarks.baselines.systems import SYSTEMS, build_system, global_loss_ddp

log = logging.getLogger(__name__)

BUDGET_MERGE = 0.03  # baselines whose predicted memory is within 3% share one budget


@dataclass(frozen=True)
class Case:
    model: str  # zoo file name: gpt2, llama, bert
    size: str = "tiny"
    batch: int = 8  # global batch
    seq: int = 128
    tp: int = 2  # tensor-parallel degree of the Megatron baseline (inner mesh axis)
    steps: int = 90  # timed steps per system (after 2 warm-up steps): fewer leave the ratio's interval too wide to judge
    optimizer: str = "adamw"
    max_budgets: int = 0  # keep only the largest N budgets (0: all); the smoke test uses 1


@dataclass(frozen=True)
class SystemResult:
    name: str  # "ddp", "fsdp+ac", "autopar@<budget MB>"...
    mesh: tuple[int, ...]
    predicted_s: float
    predicted_bytes: float
    step_s: float  # measured: median over steps of the slowest rank
    peak_bytes: int  # measured: max over ranks of the peak live-tensor bytes
    steps_s: tuple[float, ...] = ()
    # predicted seconds of the 0-d reshards the ILP charged (`predict.scalar_reshard_s`: none for a mean loss,
    # whose deferred all-reduce is free): the hand-written baselines (local loss) run none, priced without them
    loss_sync_s: float = 0.0


@dataclass(frozen=True)
class BudgetResult:
    budget_bytes: float
    autopar: str | None  # key into ModelResult.autopar_plans, None when no plan fits
    solver_note: str = ""


@dataclass(frozen=True)
class ModelResult:
    case: Case
    meshes: dict[str, str]  # "1d"/"2d" -> str(calibrated Mesh)
    baselines: tuple[SystemResult, ...]
    autopar_plans: dict[str, SystemResult]  # distinct plans, keyed by "autopar#k"
    budgets: tuple[BudgetResult, ...] = field(default=())
    plans: dict[str, str] = field(default_factory=dict)  # "autopar#k" -> its plan file (JSON), for `autopar show`
    mesh_files: dict[str, dict] = field(default_factory=dict)  # "1d"/"2d" -> the calibrated Mesh as JSON
    # measured beside the baselines, not one of them (`systems.global_loss_ddp`): DDP returning the global loss
    references: tuple[SystemResult, ...] = ()


def _plan_key(plan: Plan) -> str:
    """Identity of a plan's decisions (the budget and predictions aside): equal keys run the same code."""
    return json.dumps([plan.mesh.shape, [(d.node, str(d.strategy), d.recompute) for d in plan.nodes],
                       [(p.fqn, str(p.use), str(p.storage)) for p in plan.params]])


def _budgets(predicted: list[float], max_budgets: int) -> list[float]:
    """Distinct predicted baseline memories, largest first: from 'all fit' to 'only the most sharded fits'.
    Each with the ILP's slack on top (`MEMORY_SLACK_BYTES`), so the baseline's own plan is one autopar may choose."""
    out: list[float] = []
    for b in sorted(predicted, reverse=True):
        if not out or b < out[-1] * (1 - BUDGET_MERGE):
            out.append(b)
    out = [b + MEMORY_SLACK_BYTES for b in out]
    return out[:max_budgets] if max_budgets else out


def _shared_device_numbers(meshes: dict[str, Mesh]) -> dict[str, Mesh]:
    """Every mesh with the mean of the calibrations' per-device numbers, and of their numbers for the
    group of all ranks (the 1-D axis, the 2-D mesh's group over both axes): the devices and that group
    are the same, and load drift between two calibrations would otherwise decide which mesh shape
    looks faster (measured: 1.08 ms vs 0.78 ms per ring step for the one group of 4 ranks)."""
    def mean(field: str) -> float:
        return statistics.fmean(getattr(m, field) for m in meshes.values())

    world = _mean_link([a for m in meshes.values() for a in _world_links(m)])
    out = {}
    for k, m in meshes.items():
        axes = tuple(replace(world, name=a.name) if a.size == m.num_devices else a for a in m.axes)
        groups = tuple(replace(g, link=replace(world, name=g.link.name)) if g.link.size == m.num_devices else g
                       for g in m.groups)
        out[k] = replace(m, axes=axes, groups=groups, flops_per_s=mean("flops_per_s"),
                         mem_bandwidth_bytes_per_s=mean("mem_bandwidth_bytes_per_s"), op_overhead_s=mean("op_overhead_s"),
                         recompute_op_overhead_s=mean("recompute_op_overhead_s"), recompute_region_s=mean("recompute_region_s"))
    return out


def _world_links(mesh: Mesh) -> list[MeshAxis]:
    """The measured groups of `mesh` that span every rank."""
    return [a for a in (*mesh.axes, *(g.link for g in mesh.groups)) if a.size == mesh.num_devices and a.per_kind]


def _mean_link(links: list[MeshAxis]) -> MeshAxis:
    """One axis with the mean alpha and beta, kind by kind, of `links` (measurements of the same group)."""
    kinds = [LinkCost(c.kind, statistics.fmean(ln.link(c.kind)[0] for ln in links),
                      statistics.fmean(ln.link(c.kind)[1] for ln in links)) for c in links[0].per_kind]
    scalars = [ln.scalar_alpha_s for ln in links if ln.scalar_alpha_s is not None]
    return replace(links[0], alpha_s=kinds[0].alpha_s, beta_bytes_per_s=kinds[0].beta_bytes_per_s, per_kind=tuple(kinds),
                   scalar_alpha_s=statistics.fmean(scalars) if scalars else None)


def _plan_all(case: Case, model, sample, meshes, tp_overhead_s: float) -> dict[str, Any]:
    """Rank 0: every prediction, as plain data to broadcast."""
    pred = Predictor(model, sample, meshes, block_paths(model), case.model, case.optimizer,
                     tp_module_overhead_s=tp_overhead_s)
    baselines = {}
    for system in SYSTEMS:
        for ac in (False, True):
            plan = pred.baseline(system, ac)
            baselines[f"{system}+ac" if ac else system] = (plan.time.total_s, plan.memory.total_bytes, plan.mesh.shape)
    budgets, plans, loss_sync_s = [], {}, {}
    keys: dict[str, str] = {}
    for budget in _budgets([b for _, b, _ in baselines.values()], case.max_budgets):
        plan = pred.autopar(budget)
        if plan is None:
            budgets.append((budget, None, "no plan fits"))
            continue
        key = keys.setdefault(_plan_key(plan), f"autopar#{len(keys)}")
        plans.setdefault(key, plan_to_json(plan))
        loss_sync_s[key] = scalar_reshard_s(pred.traced, plan)
        budgets.append((budget, key, ""))
    return {"baselines": baselines, "budgets": budgets, "plans": plans, "loss_sync_s": loss_sync_s}


def local_inputs(pm, sample) -> tuple[tuple, dict]:
    """This rank's rows of the global batch (the plan-independent convention), copied so they own their storage."""
    local = pm.local_batch(split_sample_input(sample))
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, local)


def _autopar_system(name: str, case: Case, model, sample, plan: Plan) -> Trainable:
    pm = parallelize(copy.deepcopy(model), sample, tuple(plan.mesh.shape), plan=plan, optimizer=case.optimizer)
    args, kwargs = local_inputs(pm, sample)
    opt = make_optimizer(pm, case.optimizer)

    def step() -> None:
        pm(*args, **kwargs).backward()

    def live() -> list[torch.Tensor]:
        return [*pm.parameters(), *pm.buffers(), *(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))]

    return Trainable(name, step, opt, live)


def calibrate_all(rank: int, world: int, tp: int) -> dict[str, Any]:
    """The cost model's numbers for this world, as plain data: the 1-D and (world/tp, tp) meshes and
    DTensor's per-module cost. Measured once for every model of a run, so that all are priced alike
    (calibrated per model, minutes apart, the host's drift moved one model's prices against another's)."""
    if world % tp:
        raise ValueError(f"tp={tp} does not divide the world size {world}")
    meshes = _shared_device_numbers({"1d": calibrate(mesh_shape=(world,)), "2d": calibrate(mesh_shape=(world // tp, tp))})
    return {"meshes": {k: mesh_to_json(m) for k, m in meshes.items()},
            "tp_overhead_s": tp_module_overhead_s(world, tp)}  # every rank: it runs collectives


def run_model(rank: int, world: int, case: Case, calibration: dict[str, Any] | None = None) -> ModelResult | None:
    """`calibration`: `calibrate_all`'s, for the same world and case.tp (None: measured here)."""
    if rank != 0:
        logging.disable(logging.INFO)  # one log, from rank 0 (autopar's stages log on every rank)
    calibration = calibration or calibrate_all(rank, world, case.tp)
    meshes = {k: mesh_from_json(m) for k, m in calibration["meshes"].items()}
    tp_overhead_s = calibration["tp_overhead_s"]
    model, sample = load_example(case.model).build(case.batch, case.seq, size=case.size, device="cpu")
    payload = [_plan_all(case, model, sample, meshes, tp_overhead_s) if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    pred = payload[0]
    systems = [build_system(system, case.model, model, sample, ac=ac, tp=case.tp, optimizer=case.optimizer)
               for system in SYSTEMS for ac in (False, True)]
    reference = global_loss_ddp(model, sample, case.optimizer)
    plans = {key: plan_from_json(text) for key, text in pred["plans"].items()}
    systems += [reference, *(_autopar_system(key, case, model, sample, plan) for key, plan in plans.items())]
    measured = measure_interleaved(systems, steps=case.steps)
    baselines, autopar, references = [], {}, []
    for system, m in zip(systems, measured):
        if system is reference:  # priced as DDP: the cost model prices no loss all-reduce for the baselines
            p_s, p_bytes, shape = pred["baselines"]["ddp"]
            references.append(SystemResult(system.name, tuple(shape), p_s, p_bytes, m.step_s, m.peak_bytes, m.steps_s))
        elif system.name in plans:
            plan = plans[system.name]
            autopar[system.name] = SystemResult(system.name, tuple(plan.mesh.shape), plan.time.total_s,
                                                plan.memory.total_bytes, m.step_s, m.peak_bytes, m.steps_s,
                                                pred["loss_sync_s"][system.name])
        else:
            p_s, p_bytes, shape = pred["baselines"][system.name]
            baselines.append(SystemResult(system.name, tuple(shape), p_s, p_bytes, m.step_s, m.peak_bytes, m.steps_s))
        log.info("%s %s: %.1f ms, %.2f MB", case.model, system.name, m.step_s * 1e3, m.peak_bytes / 1e6)
    if rank != 0:
        return None
    budgets = tuple(BudgetResult(b, key, note) for b, key, note in pred["budgets"])
    return ModelResult(case, {k: str(m) for k, m in meshes.items()}, tuple(baselines), autopar, budgets,
                       dict(pred["plans"]), {k: m.to_json() for k, m in meshes.items()}, tuple(references))
