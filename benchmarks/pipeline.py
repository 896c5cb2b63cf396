"""Predicted step time with and without pipeline stages, on the multi-node preset.

    python benchmarks/pipeline.py                       # GPT-3-175B and LLaMA-2-70B shapes on 64, 512, 1024 GPUs
    python benchmarks/pipeline.py --only gpt3-175b --devices 64

The hardware is `h100-ib`: nodes of 8 H100s on NVLink (450 GB/s), InfiniBand NDR between nodes
(50 GB/s per GPU). Each row prices, with the same cost model:
- "no pp": the solver's plan on the (nodes, 8) mesh, the node axis over InfiniBand and the inner
  axis on NVLink (data, tensor, sequence parallelism, ZeRO and recompute chosen by the ILP);
- "pp": the pipeline search's plan (`autopar.pipeline.search.solve_pipeline`) for each pp degree
  in --pp (stages, cuts, micro-batches, schedule and each stage's plan), the fastest kept.
Both are predictions (no GPU runs here). The traces are on the meta device and cached per
micro-batch count, so a degree costs its ILP solves and the traces it adds.
Prints a table and one JSON line with the torch version and git SHA.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import time

from _common import load_example, provenance_line
from autopar.api import trace_copy
from autopar.errors import AutoparError
from autopar.pipeline.api import microbatch_sample
from autopar.pipeline.choose import describe
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
# pp degrees tried per device count: the solver's search per degree (each degree's traces and solves cost minutes
# on 2 cores at these sizes; `solve_pipeline(pp=None)` tries every divisor)
PP = {64: (4, 8), 512: (8, 16), 1024: (8, 16)}


def run(name: str, devices: int, time_limit_s: float, degrees: tuple[int, ...]) -> dict:
    example, size, seq, batch = MODELS[name]
    model, sample = load_example(example).build(batch, seq, size=size, device="meta")
    began = time.process_time()

    @functools.lru_cache(maxsize=None)
    def trace_at(m: int):
        return trace_copy(model, microbatch_sample(sample, m), "meta")

    row: dict = {"model": name, "devices": devices, "batch": batch, "seq": seq}
    whole = trace_at(1)
    mesh = make_mesh(devices, (devices // GPUS_PER_NODE, GPUS_PER_NODE), HARDWARE)
    try:
        flat = solve(whole, profile(whole), mesh, time_limit_s=time_limit_s)
        row.update(flat_s=flat.time.total_s, flat_mem_gib=flat.memory.total_bytes / 2**30)
    except AutoparError as err:
        row.update(flat_s=None, flat_error=str(err).splitlines()[0])
    best = None
    for pp in degrees:
        try:
            plan = solve_pipeline(trace_at, batch, devices, HARDWARE, time_limit_s=time_limit_s,
                                  gpus_per_node=GPUS_PER_NODE, candidates=2, pp=pp)
        except AutoparError as err:
            logging.info("%s on %d, pp=%d: %s", name, devices, pp, err)
            continue
        if best is None or plan.time.step_s < best.time.step_s:
            best = plan
    if best is not None:
        row.update(pp_s=best.time.step_s, pp_layout=describe(best), bubble=best.time.bubble_fraction,
                   pp_mem_gib=max(best.memory_bytes) / 2**30)
    row["cpu_s"] = time.process_time() - began
    return row


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(MODELS), action="append", help="run only these models")
    parser.add_argument("--devices", type=int, action="append", help="run only these device counts")
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per ILP solve")
    args = parser.parse_args()
    rows = []
    for name in args.only or list(MODELS):
        for n in args.devices or DEVICES:
            rows.append(run(name, n, args.time_limit, PP.get(n, (4, 8))))
            r = rows[-1]
            print(json.dumps(r), flush=True)
    print(f"{'model':11} {'GPUs':>5} {'no pp s':>8} {'mem GiB':>7} {'pp s':>8} {'mem GiB':>7} {'no pp/pp':>8} "
          f"{'bubble':>6}  pipeline")
    for r in rows:
        ratio = r["flat_s"] / r["pp_s"] if r.get("flat_s") and r.get("pp_s") else None
        print(f"{r['model']:11} {r['devices']:5d} {_s(r.get('flat_s')):>8} {r.get('flat_mem_gib', 0):7.1f} "
              f"{_s(r.get('pp_s')):>8} {r.get('pp_mem_gib', 0):7.1f} {_s(ratio):>8} {r.get('bubble', 0):6.1%}  "
              f"{r.get('pp_layout', r.get('flat_error', ''))}")
    print(provenance_line("pipeline", hardware=HARDWARE, gpus_per_node=GPUS_PER_NODE))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
