"""The pipeline search against the single-mesh plan: stages kept only where they predict a faster step, the plan
saved and loaded as it was, and `parallelize(pp=...)` training like one device on 2 gloo ranks."""
from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from autopar.api import parallelize, trace_copy
from autopar.pipeline.api import global_batch, microbatch_sample, search_cache, stages_for
from autopar.pipeline.cost import price, stage_cost
from autopar.pipeline.choose import choose
from autopar.pipeline.cut import find_layers
from autopar.pipeline.plan import PipelinePlan, load_pipeline_plan, save_pipeline_plan
from autopar.pipeline.cache import SearchCache, unit_bounds
from autopar.pipeline.search import Config, PipelineSearchError, Topology, price_config, solve_pipeline
from autopar.profiler import profile
from autopar.runtime.launch import run_ranks
from autopar.solver import solve
from autopar.solver.mesh import PRESETS, MeshAxis, make_mesh
from autopar.solver.plan import Plan
from tests.codegen.harness import EPS, LR, trace_model
from tests.pipeline.harness import STEPS, check_steps, zoo_model
from tests.pipeline.test_cut import _Twice
from tests.zoo import load_zoo

MODEL = "mlp"  # three layers, traced in a fraction of a second at each micro-batch count


def _link(alpha_s: float, beta_bytes_per_s: float):
    """The cpu preset with every link of this latency and bandwidth, computing at 1 MFLOP/s and reading memory at
    10 MB/s: the tiny model's compute outweighs its launches, as a large model's does on GPUs."""
    cpu = PRESETS["cpu"]
    return replace(cpu, axes=tuple(replace(a, alpha_s=alpha_s, beta_bytes_per_s=beta_bytes_per_s) for a in cpu.axes),
                   flops_per_s=1e6, mem_bandwidth_bytes_per_s=1e7)


@functools.lru_cache(maxsize=None)
def trace_at(m: int):
    model, sample, _ = zoo_model(MODEL)
    return trace_copy(model, microbatch_sample(sample, m), "cpu")


def _choose(hardware) -> Plan | PipelinePlan:
    whole = trace_at(1)
    mesh = hardware.with_shape((2,))
    flat = solve(whole, profile(whole), mesh, time_limit_s=5)
    return choose(flat, trace_at, global_batch(whole), 2, "auto", hardware, time_limit_s=5)


def test_stages_kept_where_they_pay_and_saved_as_they_are(tmp_path):
    # on a slow link (10 KB/s), syncing every gradient over 2 data-parallel ranks costs more than two stages that
    # send one activation a micro-batch; on a link of no latency and no transfer time, stages only add a bubble
    slow, fast = _choose(_link(5e-5, 1e4)), _choose(_link(0.0, 1e15))
    assert isinstance(slow, PipelinePlan) and slow.pp == 2, slow
    assert isinstance(fast, Plan), fast
    assert "no pipeline stages: the best pipeline" in fast.notes[-1] and "pipeline stages predict" in slow.notes[-1]
    assert [layer for s in slow.stages for layer in s.layers] == list(find_layers(trace_at(1)).names)
    save_pipeline_plan(slow, tmp_path / "plan.json")
    assert load_pipeline_plan(tmp_path / "plan.json") == slow


def test_a_configuration_priced_alone_costs_what_the_search_chose_and_a_second_search_reuses_the_first():
    hardware = _link(5e-5, 1e4)
    cache = SearchCache(trace_at, time_limit_s=5)
    best = solve_pipeline(cache, global_batch(trace_at(1)), 2, hardware, time_limit_s=5)
    traces, solves, profiles = cache.traces, cache.solver.solves, cache.solver.profiles
    assert solve_pipeline(cache, global_batch(trace_at(1)), 2, hardware, time_limit_s=5, pp=2) == best
    assert (cache.traces, cache.solver.solves, cache.solver.profiles) == (traces, solves, profiles)

    config = Config(best.pp, best.mesh.shape[1:], best.microbatches, len(best.stages) // best.pp)
    alone = price_config(lambda m: trace_at(m), config, best.schedule, hardware, time_limit_s=5)  # nothing cached
    assert alone.time == best.time and alone.memory_bytes == best.memory_bytes
    assert [s.layers for s in alone.stages] == [s.layers for s in best.stages]
    bounds = unit_bounds(find_layers(trace_at(best.microbatches)))
    starts = [bounds.index(s.start) for s in best.stages[1:]]
    assert price_config(cache, config, best.schedule, hardware, time_limit_s=5, starts=starts).time == best.time
    with pytest.raises(PipelineSearchError, match="must be 1 ascending unit indices"):
        price_config(cache, config, best.schedule, hardware, time_limit_s=5, starts=[0])


def test_a_search_out_of_time_answers_with_the_best_plan_solved_so_far():
    hardware = _link(5e-5, 1e4)
    batch = global_batch(trace_at(1))
    cache = SearchCache(trace_at, time_limit_s=5)
    zero_bubble = ("zero_bubble",)  # (its configurations differ in their stage graphs, not only in their schedule)
    first = solve_pipeline(cache, batch, 2, hardware, time_limit_s=5, candidates=1, schedules=zero_bubble)
    # the first candidate's solves are cached, the second's are new: the limit stops the search before them
    solves = cache.solver.solves
    cut = solve_pipeline(cache, batch, 2, hardware, time_limit_s=5, candidates=3, schedules=zero_bubble,
                         search_time_limit_s=1e-9)
    assert cache.solver.solves == solves
    assert (cut.time, cut.stages, cut.schedule, cut.microbatches) == (first.time, first.stages, first.schedule,
                                                                       first.microbatches)
    assert "time limit of 1e-09 CPU s ran out" in cut.notes[-1] and cut.notes[-1].endswith("the best plan solved so far")
    # nothing solved (a fresh cache traces first): `choose` keeps the plan without stages and says the limit stopped it
    whole = trace_at(1)
    flat = solve(whole, profile(whole), hardware.with_shape((2,)), time_limit_s=5)
    kept = choose(flat, SearchCache(trace_at, time_limit_s=5), batch, 2, "auto", hardware, time_limit_s=5,
                  search_time_limit_s=1e-9)
    assert isinstance(kept, Plan) and kept.nodes == flat.nodes
    assert kept.notes[-1].startswith("no pipeline stages:") and "time limit of 1e-09 CPU s ran out" in kept.notes[-1]


def _train(rank: int, world: int) -> dict[str, float]:
    model, sample, ref = zoo_model(MODEL)
    pm = parallelize(model, sample, (world,), hardware="cpu", pp=2, time_limit_s=5)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    return check_steps(pm, opt, sample, ref, range(STEPS), f"parallelize(pp=2) on {world} ranks")


@pytest.mark.timeout(300)
def test_parallelize_pp_trains_like_one_device():
    zoo_model(MODEL)  # the reference, made once in the parent
    worst = run_ranks(_train, 2, timeout_s=240)
    assert all(w["loss"] < 1e-5 for w in worst)


def test_a_model_that_cannot_be_cut_keeps_its_plan_and_says_why():
    x = torch.randn(4, 8)
    traced = trace_model(_Twice(), (x,))
    flat = solve(traced, profile(traced), make_mesh(2, (2,), "cpu"), time_limit_s=5)
    kept = choose(flat, lambda m: traced, 4, 2, "auto", "cpu")
    assert isinstance(kept, Plan) and kept.nodes == flat.nodes
    assert kept.notes[-1].startswith("no pipeline stages:") and "do not run one after another" in kept.notes[-1]
    with pytest.raises(PipelineSearchError, match="do not run one after another"):
        choose(flat, lambda m: traced, 4, 2, 2, "cpu")


def test_a_stage_recomputes_to_fit_its_micro_batches_in_flight():
    # the tiny MLP at 65,536 rows (megabytes of activations a micro-batch), 2 stages of one CPU rank, 1F1B over 4
    # micro-batches: rank 0 holds 2 of them in flight. Its memory as planned with the whole budget, less 4%, leaves
    # no plan without recompute: the stage is solved again within less until its plan recomputes and the rank fits
    model, sample = load_zoo(MODEL).build(batch_size=65536, seq_len=8, size="tiny", device="cpu")
    link = MeshAxis("link", 1, 0.0, 1e9)
    cache = search_cache(model, sample, "cpu", time_limit_s=5)
    config, topology = Config(2, (1,), 4), Topology(link, link, 8, PRESETS["cpu"])
    ample = price_config(cache, config, "1f1b", topology=topology, time_limit_s=5, starts=(2,))
    assert not any(s.plan.recomputed() for s in ample.stages)
    budget = 0.96 * ample.memory_bytes[0]
    tight = price_config(cache, config, "1f1b", topology=topology, time_limit_s=5, starts=(2,), memory_budget_bytes=budget)
    assert tight.stages[0].plan.recomputed() and max(tight.memory_bytes) <= budget
    # rank 0: its stage's parameters, gradients, optimizer state and largest transient, 2 micro-batches' activations,
    # and torch's buffers for the 4 micro-batches it sends (each 65,536 / 4 rows of 32 float32)
    memory = tight.stages[0].plan.memory
    sent = 4 * 65536 // 4 * 32 * 4
    assert tight.memory_bytes[0] == memory.total_bytes + memory.activations_bytes + sent
    assert tight.time.stage_s[0] > ample.time.stage_s[0]  # the recomputed forward runs again in backward


def test_a_stage_off_the_pace_keeps_the_plan_that_syncs_less():
    # GPT-2 tiny as pp=2 x dp=2, zero bubble, 4 micro-batches: stage 0 (the embeddings and a layer) is faster a
    # micro-batch than stage 1 (a layer, the head and loss), which sets the pace. Solved for 4 micro-batches, stage 0
    # buys a faster micro-batch with a larger gradient sync and optimizer step, which the step pays whole; its plan
    # solved for one pass a step, which syncs less, gives the faster step and is kept
    model, sample = load_zoo("gpt2").build(batch_size=8, seq_len=8, size="tiny", device="cpu")
    cache = search_cache(model, sample, "cpu", time_limit_s=10)
    plan = price_config(cache, Config(2, (2,), 4), "zero_bubble", "cpu", time_limit_s=10)
    assert [s.plan.mesh.microbatches for s in plan.stages] == [1, 4]
    assert plan.time.stage_s[0] < plan.time.stage_s[1]
    stages = stages_for(cache.traced(2), plan)
    mesh = plan.stages[1].plan.mesh
    fast = [stage_cost(cache.solver(s.traced, mesh, plan.budget_bytes), s, stages[i + 1] if i == 0 else None,
                       frozenset(["transformer.wte.weight"])) for i, s in enumerate(stages)]
    kept = stage_cost(plan.stages[0].plan, stages[0], stages[1], frozenset(["transformer.wte.weight"]))
    assert kept.sync_s + kept.update_s < fast[0].sync_s + fast[0].update_s
    assert plan.time.step_s < price(fast, "zero_bubble", plan.mesh, 4)[0].step_s
