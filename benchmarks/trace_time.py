"""CPU time and peak resident memory of the tracer on real model shapes (on the meta device).

    python benchmarks/trace_time.py                       # GPT-2 small, LLaMA-2-7B, GPT-3 175B (96 layers)
    python benchmarks/trace_time.py --only llama2-7b-4    # plan_scale.py's case names

Each model is traced twice, each time in a fresh process (so peak RSS, ru_maxrss, is its own): whole
(every block captured, `repeated_blocks.MIN_BLOCKS` out of reach) and as `trace` does it (a stack of
identical blocks captured two deep and copied). CPU seconds of the tracing process (`time.process_time`):
on a shared machine they are what the work took. The ratio is whole over copied, measured in the same run.
Targets (CPU s): GPT-2 small 3, LLaMA-2-7B 5, GPT-3 175B 10.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from _common import provenance_line

CASES = ("gpt2-small-2x2", "llama2-7b-4", "gpt3-175b-64")  # plan_scale.py's shapes and batches
TARGETS_S = {"gpt2-small-2x2": 3.0, "llama2-7b-4": 5.0, "gpt3-175b-64": 10.0}


def measure_one(name: str, whole: bool) -> dict:
    from plan_scale import CASES as SHAPES

    from autopar.tracer import repeated_blocks, trace

    if whole:
        repeated_blocks.MIN_BLOCKS = 10**9
    model, sample = SHAPES[name].build()
    start = time.process_time()
    traced = trace(model, sample)
    return {"case": name, "shape": SHAPES[name].shape, "ops": traced.num_ops(), "cpu_s": time.process_time() - start,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}


def run_one(name: str, whole: bool) -> dict:
    command = [sys.executable, __file__, "--one", name] + (["--whole"] if whole else [])
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names (default: all)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one model in this process
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.whole)))
        return
    rows = []
    for name in args.only.split(",") if args.only else CASES:
        whole, copied = run_one(name, whole=True), run_one(name, whole=False)
        if whole["ops"] != copied["ops"]:
            raise SystemExit(f"{name}: {copied['ops']} ops copied against {whole['ops']} whole")
        rows.append({**copied, "whole_cpu_s": whole["cpu_s"], "whole_peak_rss_gib": whole["peak_rss_gib"]})
    print(f"{'shape':<32} {'ops':>6} {'whole CPU s':>12} {'CPU s':>7} {'ratio':>6} {'target s':>9} {'peak RSS GiB':>13}")
    for r in rows:
        print(f"{r['shape']:<32} {r['ops']:>6} {r['whole_cpu_s']:>12.2f} {r['cpu_s']:>7.2f} "
              f"{r['whole_cpu_s'] / r['cpu_s']:>5.1f}x {TARGETS_S[r['case']]:>9.0f} {r['peak_rss_gib']:>13.2f}")
    print(provenance_line("trace_time", rows=rows))


if __name__ == "__main__":
    main()
