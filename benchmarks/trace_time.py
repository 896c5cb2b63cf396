"""Trace time and peak resident memory of the tracer on real model shapes (on the meta device).

    python benchmarks/trace_time.py            # GPT-2 small and LLaMA-7B shape
    python benchmarks/trace_time.py --models gpt2:small,hf_llama:7b

Each model runs in a fresh subprocess so that peak RSS (ru_maxrss) is its own.
Targets: GPT-2 small under 3 s, LLaMA-7B shape under 30 s and 2 GiB.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from _common import load_example, provenance_line

TARGETS_S = {"gpt2:small": 3.0, "llama:7b": 30.0}


def measure_one(name: str, size: str) -> dict:
    from autopar.tracer import trace

    zoo = load_example(name)
    model, sample = zoo.build(size=size, device="meta")
    start = time.perf_counter()
    traced = trace(model, sample)
    trace_s = time.perf_counter() - start
    return {"model": f"{name}:{size}", "ops": traced.num_ops(), "params": len(traced.param_fqns),
            "trace_s": trace_s, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2:small,llama:7b", help="comma-separated zoo:size pairs")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one model in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(*args.one.split(":"))))
        return
    rows = []
    for item in args.models.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", item], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'model':<16} {'ops':>6} {'params':>7} {'trace s':>8} {'target s':>9} {'peak RSS GiB':>13}")
    for r in rows:
        target = TARGETS_S.get(r["model"])
        print(f"{r['model']:<16} {r['ops']:>6} {r['params']:>7} {r['trace_s']:>8.2f} "
              f"{(f'{target:.0f}' if target else '-'):>9} {r['peak_rss_gib']:>13.2f}")
    print(provenance_line("trace_time", rows=rows))


if __name__ == "__main__":
    main()
