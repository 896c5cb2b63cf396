"""What a pipeline's step costs: the schedule's bubble, sends between stages, memory in flight, gradient sync.

    costs = [stage_cost(plan, stage, pipeline_mesh) for ...]          # from each stage's solved plan
    time, memory = price(costs, "1f1b", pipeline_mesh, microbatches=8)

A stage's plan prices one training step of its part at the micro-batch's size (`solver.solve`): its
forward and backward, its collectives, its gradient sync and its optimizer step. A pipeline runs the
forward and backward once per micro-batch and the sync and the step once (`runtime`), so a stage is
priced as `micro_s` per micro-batch plus `sync_s` and `update_s` per step.

Time, with c_s the time of stage s for one micro-batch (its sends included) and w_r the time of
pp rank r (its stages' c_s), for M micro-batches on pp ranks:
- GPipe and 1F1B: (M - 1) * max c_s + sum of c_s (the first micro-batch's way through every stage,
  then one slowest stage per micro-batch); the bubble is what exceeds M * max c_s: (pp - 1) * c for
  equal stages, Narayanan et al. 2021 (arXiv 2104.04473), section 2.2.1;
- interleaved 1F1B with v stages a rank: M * max w_r + (pp - 1) * max w_r / v (ibid., 2.2.2);
- zero bubble (ZB-H1, Qi et al. 2023, arXiv 2401.10241): the weight gradients fill the bubble, which
  leaves (pp - 1) * (F + B - W), a third of 1F1B's with forward, input and weight gradients equal.
After the schedule, each rank syncs its gradients and steps: the slowest rank's sum is added.

Sends are point-to-point on the link the boundary crosses (the pp axis' link): a stage's activations
forward and their gradients back, each rank its slice, once per micro-batch each way.

Memory of a rank: its stages' parameters, gradients, optimizer state and largest transient (their
plans' own), the activations of the micro-batches in flight (GPipe: all M; 1F1B: pp - r on rank r;
interleaved and zero bubble: torch's warm-up count of forward chunks, `in_flight`), and torch's
receive buffers, which it allocates for every micro-batch up front.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from autopar.pipeline.cut import StageGraph
from autopar.pipeline.plan import PipelineTime
from autopar.solver.cost import bucketed_all_reduce_s, collective_time_s, sync_latency_s
from autopar.solver.mesh import Mesh, MeshAxis
from autopar.solver.plan import Plan
from autopar.solver.spec import Replicate, Shard


@dataclass(frozen=True)
class StageCost:
    """One stage as the pipeline's price reads it (per device)."""

    micro_s: float  # forward and backward of one micro-batch, its collectives included
    sync_s: float  # its gradient sync, once a step
    update_s: float  # its optimizer step, once a step
    static_bytes: float  # parameters, gradients, optimizer state and the largest transient
    activation_bytes: float  # what one micro-batch's forward keeps for its backward
    send_bytes: float  # this rank's part of the activations it sends the next stage, per micro-batch
    receive_bytes: float  # of those it receives
    shared_bytes: float = 0.0  # gradients of parameters other stages hold too (summed over those stages a step)


def _local_bytes(stage: StageGraph, names: Sequence[str], dims: Sequence[int | None], stage_size: int) -> float:
    total = 0.0
    for name, dim in zip(names, dims):
        val = stage.traced.node(name).meta["val"]
        total += val.numel() * val.element_size() / (stage_size if dim is not None else 1)
    return total


def data_parallel_axes(plan: Plan, stage: StageGraph) -> tuple[int, ...]:
    """Mesh axes on which the stage's plan splits the batch of its first batched input (the axes a replicated
    parameter's gradient is summed over)."""
    traced = stage.traced
    for name, dim in zip(traced.input_names, traced.input_batch_dims):
        if dim is not None:
            spec = plan.node(name).strategy.output_specs[0]
            return tuple(k for k, p in enumerate(spec.placements) if p == Shard(dim) and plan.mesh.shape[k] > 1)
    return ()


def stage_cost(plan: Plan, stage: StageGraph, next_stage: StageGraph | None, shared: frozenset[str] = frozenset()) -> StageCost:
    """A stage's price from its plan (made for one micro-batch on the stage mesh; a mesh of M `microbatches` prices
    1/M of the sync and the optimizer's step in it, as the ILP weighs them, and the stage's price takes them
    whole). `shared`: FQNs of parameters other stages hold too."""
    mesh, n = plan.mesh, plan.mesh.num_devices
    dp = data_parallel_axes(plan, stage)
    sync, groups = 0.0, set()
    shared_bytes = 0.0
    sizes = {p.fqn: _param_bytes(stage, p.node) for p in plan.params}
    for p in plan.params:
        local = sizes[p.fqn] / p.storage.shard_factor(mesh.shape)
        if p.fqn in shared:
            shared_bytes += local
        axes = tuple(k for k in dp if isinstance(p.use.placements[k], Replicate))
        if axes and not p.zero:  # (ZeRO's reduce-scatter runs in the graph, per micro-batch)
            sync += bucketed_all_reduce_s(local, mesh, axes)
            groups.add(axes)
    sync += sum(sync_latency_s(mesh, g) for g in groups)
    update = plan.time.update_s
    passes = mesh.microbatches  # the plan's sync and update are per micro-batch (`solver.cost`): a step's are these times
    received_dims = stage.traced.input_batch_dims[len(stage.user_inputs):]
    sent_dims = () if next_stage is None else next_stage.traced.input_batch_dims[len(next_stage.user_inputs):]
    return StageCost(
        micro_s=max(plan.time.total_s - update - sync, 0.0), sync_s=sync * passes, update_s=update * passes,
        static_bytes=plan.memory.total_bytes - plan.memory.activations_bytes,
        activation_bytes=plan.memory.activations_bytes,
        send_bytes=_local_bytes(stage, stage.sent, sent_dims, n),
        receive_bytes=_local_bytes(stage, stage.received, received_dims, n), shared_bytes=shared_bytes)


def _param_bytes(stage: StageGraph, placeholder: str) -> float:
    val = stage.traced.node(placeholder).meta["val"]
    return float(val.numel() * val.element_size())


def send_s(nbytes: float, link: MeshAxis) -> float:
    """One point-to-point send of `nbytes` over `link` (alpha-beta, as a collective's ring step)."""
    return 0.0 if nbytes == 0 else link.alpha_s + nbytes / link.beta_bytes_per_s


def in_flight(schedule: str, pp: int, virtual: int, microbatches: int, rank: int) -> float:
    """Micro-batches whose activations a stage of pp rank `rank` holds at once, at the schedule's worst."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, pp - rank)
    # torch's warm-up, in forward chunks over the rank's `virtual` stages before its first backward: (virtual - 1)
    # rounds of micro-batches, and 2 more per later rank (interleaved 1F1B) or 1 (zero bubble, whose input
    # gradients come sooner)
    per_round = microbatches // max(1, microbatches // pp)
    later = pp - 1 - rank
    chunks = (virtual - 1) * per_round + (2 * later + 1 if schedule == "interleaved_1f1b" else later + 1)
    return min(microbatches * virtual, chunks) / virtual


def price(costs: Sequence[StageCost], schedule: str, mesh: Mesh, microbatches: int,
          links: Sequence[MeshAxis] | None = None) -> tuple[PipelineTime, tuple[float, ...]]:
    """The step's predicted time and each pp rank's peak bytes for stages `costs` (pipeline order) under
    `schedule` on `mesh` (axes pp, *stage axes). links[i]: the link boundary i (stage i to i + 1) crosses
    (default: the pp axis' link for every boundary)."""
    pp, num = mesh.shape[0], len(costs)
    virtual = num // pp
    links = list(links) if links is not None else [mesh.axes[0]] * (num - 1)
    per_stage = []
    for s, c in enumerate(costs):
        out = send_s(c.send_bytes, links[s]) if s + 1 < num else 0.0  # activations forward
        back = send_s(c.receive_bytes, links[s - 1]) if s > 0 else 0.0  # their gradients back
        per_stage.append(c.micro_s + out + back)
    per_rank = [sum(per_stage[s] for s in range(r, num, pp)) for r in range(pp)]
    slowest = max(per_rank)
    if schedule in ("gpipe", "1f1b"):
        schedule_s = (microbatches - 1) * max(per_stage) + sum(per_stage)
    elif schedule == "interleaved_1f1b":
        schedule_s = microbatches * slowest + (pp - 1) * slowest / virtual
    else:
        schedule_s = microbatches * slowest + (pp - 1) * slowest / (3 * virtual)
    shared = _shared_sync_s(costs, pp, mesh.axes[0])
    after = max(sum(costs[s].sync_s + costs[s].update_s for s in range(r, num, pp)) + shared[r] for r in range(pp))
    p2p = max((send_s(costs[s].send_bytes, links[s]) * 2 for s in range(num - 1)), default=0.0)
    time = PipelineTime(schedule_s + after, tuple(per_stage), schedule_s - microbatches * slowest, p2p,
                        max(sum(costs[s].sync_s for s in range(r, num, pp)) + shared[r] for r in range(pp)),
                        max(sum(costs[s].update_s for s in range(r, num, pp)) for r in range(pp)))
    memory = tuple(sum(costs[s].static_bytes + in_flight(schedule, pp, virtual, microbatches, r) * costs[s].activation_bytes
                       + microbatches * (costs[s].receive_bytes + costs[s].send_bytes) for s in range(r, num, pp))
                   for r in range(pp))
    return time, memory


def _shared_sync_s(costs: Sequence[StageCost], pp: int, link: MeshAxis) -> list[float]:
    """Per pp rank: the all-reduce of its shared parameters' gradients with the other ranks holding them (the
    first and the last stage's tied embedding: a group of two on the pp link)."""
    holders = sum(1 for c in costs if c.shared_bytes)
    if holders < 2:
        return [0.0] * pp
    group = replace(link, size=holders)
    out = [0.0] * pp
    for s, c in enumerate(costs):
        out[s % pp] += collective_time_s("all_reduce", c.shared_bytes, group)
    return out


def bubble_fraction(schedule: str, pp: int, virtual: int, microbatches: int) -> float:
    """The schedule's idle share of a step for equal stages and no sends: (pp - 1) / (M + pp - 1) for 1F1B."""
    c = [1.0] * (pp * virtual)
    mesh = Mesh((MeshAxis("pp", pp, 0.0, math.inf),), 1.0, 1.0, 1.0)
    costs = [StageCost(x / virtual, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0) for x in c]
    time, _ = price(costs, schedule, mesh, microbatches)
    return time.bubble_s / time.step_s
