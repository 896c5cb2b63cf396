"""A pipeline plan: the stages, each with its own plan on the stage mesh, the schedule and the micro-batches.

    plan = PipelinePlan(mesh, "1f1b", 8, stages, time, memory)   # mesh: pp x (the stage mesh's axes)
    save_pipeline_plan(plan, "plan.json"); plan = load_pipeline_plan("plan.json")

Stage i holds the model's ops from `stages[i].start` up to the next stage's start (`cut.cut`), and its
`plan` is an ordinary `Plan` for that part traced at the micro-batch's size, on the mesh of one stage:
the pipeline mesh without its first axis, `pp`. With an interleaved schedule there are `virtual`
stages per pp rank, stage i on rank i % pp (torch's looped placement).

On disk a pipeline plan is the JSON of the stage plans (`plan_io.plan_to_dict`) inside an object whose
`kind` is "pipeline"; plan files without `kind` are single-mesh plans and load as before.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from autopar.compat import ZERO_BUBBLE_EXACT
from autopar.errors import PlanFormatError
from autopar.solver.mesh import Mesh, MeshAxis
from autopar.solver.plan import Plan, PlanSource
# plan_io's reader of JSON fields: a format error names the field, as in single-mesh plan files
from autopar.solver.plan_io import JsonField, mesh_from, source_from, plan_from_dict, plan_to_dict

# zero bubble only where torch's schedule trains tied weights as one device does (`compat.ZERO_BUBBLE_EXACT`)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b") + (("zero_bubble",) if ZERO_BUBBLE_EXACT else ())
PIPELINE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class StagePlan:
    start: int  # the position of its first op among the model graph's ops (0 for the first stage)
    first_op: str  # that op's node name: checked against the model traced again
    layers: tuple[str, ...]  # the numbered layers it holds ('transformer.h.3', ...)
    plan: Plan  # for its part of the graph, at the micro-batch's size, on the stage mesh
    has_embedding: bool = False  # it runs the code before the first layer (reports)
    has_head: bool = False  # it runs the code after the last layer, the loss included (reports)


@dataclass(frozen=True)
class PipelineTime:
    """Predicted seconds of one training step under the schedule (`pipeline.cost`)."""

    step_s: float
    stage_s: tuple[float, ...]  # per stage: forward and backward of one micro-batch, its p2p included
    bubble_s: float  # the time the schedule leaves the slowest rank idle
    p2p_s: float  # one micro-batch's sends and receives across the slowest boundary
    sync_s: float  # the slowest rank's gradient sync (its stage's data-parallel group, tied weights)
    update_s: float  # the slowest rank's optimizer step

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.step_s if self.step_s > 0 else 0.0


@dataclass(frozen=True)
class PipelinePlan:
    mesh: Mesh  # axes ("pp", *the stage mesh's axes), with the hardware's numbers
    schedule: str  # one of SCHEDULES
    microbatches: int
    stages: tuple[StagePlan, ...]  # in pipeline order; pp * virtual of them
    time: PipelineTime
    memory_bytes: tuple[float, ...]  # predicted peak per device of each pp rank (its stages together)
    budget_bytes: float | None = None
    model: str = ""  # the planned model's class name
    notes: tuple[str, ...] = ()
    source: PlanSource | None = None
    schema_version: int = PIPELINE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schedule == "zero_bubble" and not ZERO_BUBBLE_EXACT:
            raise ValueError(f"schedule 'zero_bubble': torch {torch.__version__}'s zero-bubble schedule gives weights tied "
                             f"across stages wrong gradients; use one of {SCHEDULES}, or torch 2.13")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: choose one of {SCHEDULES}")
        if self.mesh.axes[0].name != "pp":
            raise ValueError(f"a pipeline mesh's first axis is 'pp', got {self.mesh.axis_names}")
        if self.microbatches < 1 or len(self.stages) % self.pp or len(self.stages) < self.pp:
            raise ValueError(f"{len(self.stages)} stages over pp={self.pp} with {self.microbatches} micro-batches: "
                             "give pp * virtual stages and at least one micro-batch")
        problem = schedule_problem(self.schedule, self.pp, self.virtual, self.microbatches)
        if problem:
            raise ValueError(problem)
        if self.schedule == "zero_bubble" and any(s.plan.recomputed() for s in self.stages):
            raise ValueError("zero_bubble splits each backward into its input and weight parts by walking the autograd "
                             "graph, which a recompute region's backward hides: give its stages plans without recompute")
        shape = self.stage_mesh_shape
        odd = [i for i, s in enumerate(self.stages) if tuple(s.plan.mesh.shape) != shape]
        if odd:
            raise ValueError(f"stages {odd} are planned for meshes other than the stage mesh {shape}")

    @property
    def pp(self) -> int:
        return self.mesh.shape[0]

    @property
    def virtual(self) -> int:
        return len(self.stages) // self.pp

    @property
    def stage_mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape[1:])

    def rank_of(self, stage: int) -> int:
        """The pp rank running stage `stage` (torch's looped placement)."""
        return stage % self.pp


def with_pp(stage_mesh: Mesh, pp: int, link: MeshAxis) -> Mesh:
    """The pipeline mesh: a `pp` axis of `pp` stages over `link` (the link a stage boundary crosses) before the
    stage mesh's axes."""
    return replace(stage_mesh, axes=(replace(link, name="pp", size=pp, per_kind=()), *stage_mesh.axes), groups=())


def schedule_problem(schedule: str, pp: int, virtual: int, microbatches: int) -> str:
    """Why torch's `schedule` cannot run pp ranks of `virtual` stages each on `microbatches` ("" when it can)."""
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        return f"{schedule} runs one stage per pp rank, not {virtual}: use interleaved_1f1b or zero_bubble"
    if schedule == "1f1b" and microbatches < pp:
        return f"1f1b needs at least as many micro-batches as stages ({pp}), not {microbatches}"
    rounds = max(1, microbatches // pp)
    if schedule in ("interleaved_1f1b", "zero_bubble") and microbatches % rounds:
        return (f"{schedule} runs micro-batches in rounds of pp={pp}: {microbatches} is not a multiple of its "
                f"{rounds} rounds; use a multiple of {pp}")
    return ""


def pipeline_to_dict(plan: PipelinePlan) -> dict:
    t = plan.time
    return {
        "kind": "pipeline",
        "schema_version": plan.schema_version,
        "mesh": plan.mesh.to_json(),
        "schedule": plan.schedule,
        "microbatches": plan.microbatches,
        "time": {"step_s": t.step_s, "stage_s": list(t.stage_s), "bubble_s": t.bubble_s, "p2p_s": t.p2p_s,
                 "sync_s": t.sync_s, "update_s": t.update_s},
        "memory_bytes": list(plan.memory_bytes),
        "budget_bytes": plan.budget_bytes,
        "model": plan.model,
        "notes": list(plan.notes),
        "source": None if plan.source is None else asdict(plan.source),
        "stages": [{"start": s.start, "first_op": s.first_op, "layers": list(s.layers), "has_embedding": s.has_embedding,
                    "has_head": s.has_head, "plan": plan_to_dict(s.plan)} for s in plan.stages],
    }


def is_pipeline_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("kind") == "pipeline"


def pipeline_from_dict(obj: Any, source: str = "plan") -> PipelinePlan:
    root = JsonField(obj, "", source)
    root.of(dict)
    if root["kind"].of(str) != "pipeline":
        raise root.fail("not a pipeline plan (field 'kind' is not \"pipeline\")")
    version = root["schema_version"].of(int)
    if version != PIPELINE_SCHEMA_VERSION:
        raise root.fail(f"pipeline schema version {version} is not supported (this autopar reads version "
                        f"{PIPELINE_SCHEMA_VERSION}); re-plan with this version")
    t = root["time"]
    time = PipelineTime(t["step_s"].num(), tuple(x.num() for x in t["stage_s"].items()), t["bubble_s"].num(),
                        t["p2p_s"].num(), t["sync_s"].num(), t["update_s"].num())
    stages = tuple(StagePlan(s["start"].of(int), s["first_op"].of(str), tuple(x.of(str) for x in s["layers"].items()),
                             plan_from_dict(s["plan"].value, f"{source} {s.path}"), s.get("has_embedding", False).of(bool),
                             s.get("has_head", False).of(bool))
                   for s in root["stages"].items())
    try:
        return PipelinePlan(mesh_from(root["mesh"]), root["schedule"].of(str), root["microbatches"].of(int), stages, time,
                            tuple(x.num() for x in root["memory_bytes"].items()), root.get("budget_bytes", None).opt_num(),
                            root.get("model", "").of(str), tuple(n.of(str) for n in root.get("notes", []).items()),
                            None if root.get("source", None).value is None else source_from(root["source"]), version)
    except ValueError as err:
        raise root.fail(str(err)) from None


def save_pipeline_plan(plan: PipelinePlan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(pipeline_to_dict(plan), indent=1) + "\n")


def load_pipeline_plan(path: str | Path) -> PipelinePlan:
    p = Path(path)
    if not p.is_file():
        raise PlanFormatError(f"plan file {str(p)!r} does not exist\n  fix: write one with `autopar plan MODEL.py "
                              f"--gpus N --pp auto --save {p}`")
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise PlanFormatError(f"{p.name}: not valid JSON ({err.msg} at line {err.lineno})") from None
    return pipeline_from_dict(obj, p.name)
