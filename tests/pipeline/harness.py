"""Pipelines against one device: random cuts, micro-batch counts, schedules and stage plans.

The parent traces each zoo model at the micro-batch's size and computes one device's reference
(`tests.codegen.harness.reference`, at the global batch); every forked rank builds its stages of
each case, trains the reference's steps and compares its blocks of every gradient, parameter and
buffer with the reference's (each rank its blocks: together they cover the tensors).
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import torch

from autopar.api import trace_copy
from autopar.codegen.shapes import local_block
from autopar.pipeline.api import build_pipeline, microbatch_sample
from autopar.pipeline.cut import cut, find_layers
from autopar.pipeline.module import PipelineModule
from autopar.pipeline.plan import PipelinePlan, PipelineTime, StagePlan, schedule_problem, with_pp
from autopar.solver.plan_io import with_fingerprint
from autopar.tracer import TracedGraph, split_sample_input
from tests.codegen.harness import EPS, LR, Reference, reference
from tests.codegen.plans import cpu_mesh, random_plan
from tests.zoo import load_zoo

BATCH = 8  # the global batch: divides over 2 ranks of a stage and 1, 2 or 4 micro-batches
STEPS = 3


@functools.lru_cache(maxsize=None)
def zoo_model(name: str) -> tuple[torch.nn.Module, Any, Reference]:
    """A zoo model, its global batch and one device's reference over STEPS steps (once a process)."""
    model, sample = load_zoo(name).build(batch_size=BATCH, seq_len=8, size="tiny", device="cpu")
    return model, sample, reference(model, sample, STEPS)


@functools.lru_cache(maxsize=None)
def micro_trace(name: str, microbatches: int) -> TracedGraph:
    model, sample, _ = zoo_model(name)
    return trace_copy(model, microbatch_sample(sample, microbatches), "cpu")


def ops_of(traced: TracedGraph) -> list[str]:
    return [n.name for n in traced.graph.nodes if n.op == "call_function"]


def random_pipeline_plan(traced: TracedGraph, pp: int, virtual: int, stage_shape: tuple[int, ...], schedule: str,
                         microbatches: int, rng: random.Random, axis_names: tuple[str, ...] | None = None,
                         zero_p: float = 0.5) -> PipelinePlan:
    """pp * virtual stages cut at random layer boundaries, each under a random plan (random strategies, ZeRO
    storage, and recompute but under zero_bubble) on the stage mesh."""
    layers = find_layers(traced)
    starts = tuple(sorted(rng.sample(layers.cut_points(), pp * virtual - 1)))
    stages = cut(traced, starts, layers)
    mesh = cpu_mesh(stage_shape)
    if axis_names:
        from dataclasses import replace
        mesh = replace(mesh, axes=tuple(replace(a, name=n) for a, n in zip(mesh.axes, axis_names)))
    spans = 0 if schedule == "zero_bubble" else 3
    plans = [with_fingerprint(random_plan(s.traced, mesh, rng, recompute_spans=spans, zero_p=zero_p), s.traced, mesh, None)
             for s in stages]
    ops = ops_of(traced)
    return PipelinePlan(with_pp(mesh, pp, mesh.axes[0]), schedule, microbatches,
                        tuple(StagePlan(s.start, ops[s.start], s.layers, p) for s, p in zip(stages, plans)),
                        PipelineTime(0.0, (0.0,) * len(stages), 0.0, 0.0, 0.0, 0.0), (0.0,) * pp)


@dataclass(frozen=True)
class Case:
    label: str
    model: str  # zoo name
    plan: PipelinePlan


def random_case(name: str, pp: int, stage_shape: tuple[int, ...], rng: random.Random, schedules: tuple[str, ...],
                axis_names: tuple[str, ...] | None = None, zero_p: float = 0.5) -> Case:
    """A random valid case: schedule, micro-batch count (1 for a model with batch norm), cuts and stage plans."""
    world = stage_shape[0] if stage_shape else 1
    counts = [m for m in (2, 4, 8) if BATCH % (m * world) == 0]  # (one micro-batch: a model with batch norm)
    m = rng.choice(counts)
    if find_layers(micro_trace(name, m)).batch_statistics:
        m = 1  # its micro-batches would be normalised by their own statistics (`parallelize_pipeline` refuses more)
    cut_points = find_layers(micro_trace(name, m)).cut_points()
    options = [(s, v) for s in schedules for v in ((1, 2) if s in ("interleaved_1f1b", "zero_bubble") else (1,))
               if len(cut_points) >= pp * v - 1 and not schedule_problem(s, pp, v, m)]
    schedule, virtual = rng.choice(options)
    plan = random_pipeline_plan(micro_trace(name, m), pp, virtual, stage_shape, schedule, m, rng, axis_names, zero_p)
    return Case(f"{name} pp={pp} x {stage_shape} {schedule} M={m} stages at {[s.start for s in plan.stages]}", name, plan)


def check_case(case: Case) -> dict[str, float]:
    """Train the case's steps on this rank; raise AssertionError naming the first mismatch; the worst errors."""
    model, sample, ref = zoo_model(case.model)
    pm = build_pipeline(model, micro_trace(case.model, case.plan.microbatches), case.plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    return check_steps(pm, opt, sample, ref, range(STEPS), case.label)


def check_steps(pm: PipelineModule, opt: torch.optim.Optimizer, sample: Any, ref: Reference, steps: range,
                label: str) -> dict[str, float]:
    """Train `pm` the reference's `steps` (numbers: a run may resume mid-way) on this rank's slice of `sample`,
    comparing the loss, this rank's blocks of every gradient, parameter and buffer with the reference's."""
    args, kwargs = split_sample_input(pm.local_batch(sample))
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in steps:
        opt.zero_grad()
        loss = pm.step(*args, **kwargs)
        rel = abs(loss.item() - ref.losses[step]) / abs(ref.losses[step])
        assert rel < 1e-5, f"{label}: step {step} loss {loss.item()} vs one device's {ref.losses[step]}"
        worst["loss"] = max(worst["loss"], rel)
        for fqn, p in pm.named_parameters():
            worst["grad"] = max(worst["grad"], _compare(pm, fqn, p.grad, ref.grads[step][fqn], f"{label}: step {step} grad"))
        opt.step()
        for fqn, p in pm.named_parameters():
            worst["param"] = max(worst["param"], _compare(pm, fqn, p.detach(), ref.params[step][fqn], f"{label}: step {step} param"))
        for fqn, b in pm.named_buffers():
            if fqn in ref.buffers[step]:
                _compare(pm, fqn, b.float(), ref.buffers[step][fqn].float(), f"{label}: step {step} buffer")
    return worst


def _compare(pm: PipelineModule, fqn: str, got: torch.Tensor | None, full: torch.Tensor, what: str) -> float:
    assert got is not None, f"{what} of {fqn}: none"
    mesh = pm.pmesh.stage
    want = local_block(full, pm.storage[fqn], mesh.shape, mesh.coordinate)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} of {fqn}: {m}")
    return (got - want).abs().max().item()


def run_cases(rank: int, world: int, cases: list[Case]) -> list[tuple[str, dict[str, float]]]:
    return [(c.label, check_case(c)) for c in cases]
