"""Predicted step time with and without pipeline stages, on the multi-node preset.

    python benchmarks/pipeline.py                       # GPT-3-175B and LLaMA-2-70B shapes on 64, 512, 1024 GPUs
    python benchmarks/pipeline.py --only gpt3-175b --devices 64
    python benchmarks/pipeline.py --only gpt3-175b --devices 1024 --search-time-limit 1800   # each pp degree's search bounded

The hardware is `h100-ib`: nodes of 8 H100s on NVLink (450 GB/s), InfiniBand NDR between nodes
(50 GB/s per GPU). Each row prices, with the same cost model:
- "no pp": the solver's plan on the (nodes, 8) mesh, the node axis over InfiniBand and the inner
  axis on NVLink (data, tensor, sequence parallelism, ZeRO and recompute chosen by the ILP);
- "pp": the pipeline search's plan (`autopar.pipeline.search.solve_pipeline`) for each pp degree
  in `PP` (stages, cuts, micro-batches, schedule and each stage's plan), the fastest kept.
Both are predictions (no GPU runs here). One `SearchCache` a model holds its traces (on the meta
device, one per micro-batch size), profiles and plans (one per structure and stage mesh) across pp
degrees and device counts; a row's CPU seconds are what it added to the cache.
Prints each row as a JSON line when it is done, what a row finds on the way (the plan without stages, each pp
degree's best) to stderr as it is found, then a table and one JSON line with the torch version and git SHA.
`--search-time-limit` bounds each pp degree's search in CPU seconds (it then keeps the best plan solved so far).

    python benchmarks/pipeline.py --megatron    # the cost model against Megatron-LM's Table 1 (pipeline_megatron.py)
    python benchmarks/pipeline.py --gloo        # pp=2 x dp=2 measured on 4 gloo ranks (pipeline_gloo.py)
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import pipeline_gloo
import pipeline_megatron
from _common import load_example, provenance_line
from autopar.api import trace_copy
from autopar.errors import AutoparError
from autopar.pipeline.api import microbatch_sample
from autopar.pipeline.choose import describe
from autopar.pipeline.cache import SearchCache
from autopar.pipeline.search import solve_pipeline
from autopar.profiler import profile
from autopar.solver import solve
from autopar.solver.mesh import make_mesh

HARDWARE = "h100-ib"
GPUS_PER_NODE = 8
# name: (examples/ file, size, sequence length, global batch in sequences)
# GPT-3: the paper's 2048 context and 1536 sequences (Narayanan et al. 2021, table 1); LLaMA-2: 4096 context, 4M tokens.
MODELS = {
    "gpt3-175b": ("gpt2", "gpt3-175b", 2048, 1536),
    "llama2-70b": ("llama", "70b", 4096, 1024),
}
DEVICES = (64, 512, 1024)
# pp degrees tried per device count (`solve_pipeline(pp=None)` tries every divisor: at these sizes each degree adds
# traces and solves of minutes on 2 cores)
PP = {64: (4, 8), 512: (8, 16), 1024: (8, 16)}


def run(name: str, devices: tuple[int, ...], time_limit_s: float, search_time_limit_s: float | None,
        pp_degrees: tuple[int, ...] | None = None) -> list[dict]:
    """One model's rows: one trace per micro-batch size and one profile and plan per structure and stage mesh,
    reused for every pp degree and device count (`SearchCache`). Each row is printed (a JSON line) when it is done,
    and what it finds on the way (the plan without stages, each pp degree's best) to stderr as it is found, so a
    run cut short keeps what it found."""
    example, size, seq, batch = MODELS[name]
    model, sample = load_example(example).build(batch, seq, size=size, device="meta")
    began = time.process_time()
    cache = SearchCache(lambda m: trace_copy(model, microbatch_sample(sample, m), "meta"), time_limit_s=time_limit_s)
    whole = cache.traced(1)
    whole_profile = profile(whole)
    rows = []
    for n in devices:
        row: dict = {"model": name, "devices": n, "batch": batch, "seq": seq, "pp_tried": {}}
        shape = (n // GPUS_PER_NODE, GPUS_PER_NODE)
        try:
            flat = solve(whole, whole_profile, make_mesh(n, shape, HARDWARE), time_limit_s=time_limit_s)
            row.update(flat_s=flat.time.total_s, flat_mesh="x".join(map(str, shape)),
                       flat_mem_gib=flat.memory.total_bytes / 2**30)
        except AutoparError as err:
            row.update(flat_s=None, flat_error=str(err).splitlines()[0])
        _progress(row, "no pp", f"{_s(row['flat_s'])} s on {shape}" if row["flat_s"] else row["flat_error"], began)
        best = None
        for pp in pp_degrees or PP.get(n, (4, 8)):
            pp_began = time.process_time()
            try:
                plan = solve_pipeline(cache, batch, n, HARDWARE, time_limit_s=time_limit_s, gpus_per_node=GPUS_PER_NODE,
                                      candidates=2, pp=pp, search_time_limit_s=search_time_limit_s)
            except AutoparError as err:
                row["pp_tried"][pp] = {"error": str(err).splitlines()[0], "cpu_s": time.process_time() - pp_began}
                _progress(row, f"pp={pp}", row["pp_tried"][pp]["error"], pp_began)
                continue
            stopped = [note for note in plan.notes if note.startswith("the pipeline search stopped")]
            row["pp_tried"][pp] = {"step_s": plan.time.step_s, "layout": describe(plan), "stopped": stopped[0] if stopped else None,
                                   "cpu_s": time.process_time() - pp_began}
            _progress(row, f"pp={pp}", f"{plan.time.step_s:.3f} s: {describe(plan)}" + (f" ({stopped[0]})" if stopped else ""),
                      pp_began)
            if best is None or plan.time.step_s < best.time.step_s:
                best = plan
        if best is not None:
            row.update(pp_s=best.time.step_s, pp=best.pp, schedule=best.schedule, microbatches=best.microbatches,
                       pp_layout=describe(best), bubble=best.time.bubble_fraction, pp_mem_gib=max(best.memory_bytes) / 2**30)
        row.update(cpu_s=time.process_time() - began, traces=cache.traces, solves=cache.solver.solves)
        began = time.process_time()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _progress(row: dict, what: str, found: str, began_cpu_s: float) -> None:
    print(f"{row['model']} on {row['devices']}, {what}: {found} [{time.process_time() - began_cpu_s:.0f} CPU s]",
          file=sys.stderr, flush=True)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_table(rows: list[dict]) -> None:
    print(f"{'model':10} {'GPUs':>5} {'no pp s':>8} {'mesh':>6} {'pp':>3} {'schedule':>16} {'m':>4} {'bubble':>6} "
          f"{'pp s':>8} {'no pp/pp':>8} {'CPU s':>6}  pipeline")
    for r in rows:
        ratio = r["flat_s"] / r["pp_s"] if r.get("flat_s") and r.get("pp_s") else None
        print(f"{r['model']:10} {r['devices']:5d} {_s(r.get('flat_s')):>8} {r.get('flat_mesh', '-'):>6} "
              f"{r.get('pp', '-'):>3} {r.get('schedule', '-'):>16} {r.get('microbatches', '-'):>4} "
              f"{r.get('bubble', 0):6.1%} {_s(r.get('pp_s')):>8} {_s(ratio):>8} {r['cpu_s']:6.0f}  "
              f"{r.get('pp_layout', r.get('flat_error', ''))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only these models (with --megatron: Table 1 rows, '145.6B')")
    parser.add_argument("--devices", type=int, action="append", help="run only these device counts")
    parser.add_argument("--time-limit", type=float, default=20.0, help="CPU seconds per ILP solve")
    parser.add_argument("--search-time-limit", type=float, help="CPU seconds each pipeline search (one pp degree of one "
                        "row) may take; where it runs out the search keeps the best plan solved so far (default: no limit)")
    parser.add_argument("--pp", type=int, action="append", help="try only these pp degrees (default: PP's for the device count)")
    parser.add_argument("--megatron", action="store_true", help="predict Megatron-LM's Table 1 configurations instead")
    parser.add_argument("--gloo", action="store_true", help="measure pp=2 x dp=2 on 4 gloo ranks instead")
    args = parser.parse_args()
    if args.gloo:
        pipeline_gloo.print_table(pipeline_gloo.measure())
        print(provenance_line("pipeline_gloo", hardware="cpu", ranks=4))
        return
    if args.megatron:
        rows = [pipeline_megatron.predict(r, args.time_limit) for r in pipeline_megatron.PIPELINED
                if not args.only or r.name in args.only]
        pipeline_megatron.print_table(rows)
        print(provenance_line("pipeline_megatron", hardware="a100", gpus_per_node=pipeline_megatron.GPUS_PER_NODE))
        return
    rows = []
    for name in args.only or list(MODELS):
        rows += run(name, tuple(args.devices or DEVICES), args.time_limit, args.search_time_limit,
                    tuple(args.pp or ()))
    print_table(rows)
    print(provenance_line("pipeline", hardware=HARDWARE, gpus_per_node=GPUS_PER_NODE))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
