"""Planning time end to end: trace + profile + strategies + ILP, per model and mesh.

    python benchmarks/plan_time.py                 # GPT-2 small 2x2, GPT-2-XL shape on 8, GPT-3-175B shape on 8x8
    python benchmarks/plan_time.py --only small

Targets (2-core machine): small < 3 s, xl < 10 s, gpt3-175b < 60 s. Building the
model object (on the meta device) is excluded; everything after it is timed, per
stage (wall) and in total (wall, and this process' CPU time: everything runs on one
thread, HiGHS included, so that is the wall time on an idle machine).
Prints a table and one JSON line with the torch version and git SHA.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from _common import load_example
from autopar.profiler import profile
from autopar.solver.anytime import solve_problem
from autopar.solver.mesh import make_mesh
from autopar.solver.problem import build_problem
from autopar.solver.strategies import enumerate_strategies
from autopar.tracer import trace

ROOT = Path(__file__).resolve().parents[1]
# (size in examples/gpt2.py, batch, seq, devices, mesh shape, target seconds)
CASES = {
    "small": ("small", 8, 1024, 4, (2, 2), 3.0),
    "xl": ("xl", 8, 1024, 8, (8,), 10.0),
    "gpt3-175b": ("gpt3-175b", 8, 2048, 64, (8, 8), 60.0),
}


def _gpt2():
    return load_example("gpt2")


def run(case: str) -> dict:
    size, batch, seq, n, shape, target_s = CASES[case]
    model, sample = _gpt2().build(batch, seq, size=size, device="meta")
    marks = [("start", time.perf_counter())]
    cpu_start = time.process_time()
    traced = trace(model, sample)
    marks.append(("trace", time.perf_counter()))
    prof = profile(traced).evaluate()
    marks.append(("profile", time.perf_counter()))
    mesh = make_mesh(n, shape, "h100")
    strategies = enumerate_strategies(traced, mesh)
    marks.append(("strategies", time.perf_counter()))
    built = build_problem(traced, prof, mesh, strategies, mesh.memory_bytes)
    marks.append(("build", time.perf_counter()))
    sol = solve_problem(built.problem, time_limit_s=max(5.0, target_s / 2))
    marks.append(("ilp", time.perf_counter()))
    cpu_s = time.process_time() - cpu_start
    stages = {name: t - prev for (_, prev), (name, t) in zip(marks, marks[1:])}
    return {
        "model": f"gpt2-{size} B={batch} S={seq}", "mesh": "x".join(map(str, shape)),
        "nodes": built.num_graph_nodes, "clusters": len(built.grouping.clusters), "ilp_nodes": len(built.problem.nodes),
        "ilp_vars": sol.report.num_variables, "stages_s": stages, "ilp_s": stages["ilp"],
        "total_s": marks[-1][1] - marks[0][1], "cpu_s": cpu_s, "target_s": target_s,
        "step_ms": sol.time.total_s * 1e3, "memory_gib": sol.memory.total_bytes / 2**30, "status": sol.report.status,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append", help="run only these cases")
    args = parser.parse_args()
    rows = [run(c) for c in (args.only or list(CASES))]
    head = (f"{'model':28} {'mesh':5} {'nodes':>6} {'merged':>6} {'tied':>5} {'vars':>7} {'trace':>6} {'prof':>5} "
            f"{'strat':>5} {'build':>5} {'ilp':>5} {'total s':>8} {'cpu s':>6} {'target':>6} {'step ms':>8} {'mem GiB':>8}")
    print(head)
    for r in rows:
        st = r["stages_s"]
        print(f"{r['model']:28} {r['mesh']:5} {r['nodes']:6d} {r['clusters']:6d} {r['ilp_nodes']:5d} {r['ilp_vars']:7,d} "
              f"{st['trace']:6.2f} {st['profile']:5.2f} {st['strategies']:5.2f} {st['build']:5.2f} {st['ilp']:5.2f} "
              f"{r['total_s']:8.2f} {r['cpu_s']:6.2f} {r['target_s']:6.0f} {r['step_ms']:8.1f} {r['memory_gib']:8.2f}")
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = "unknown"
    print(json.dumps({"benchmark": "plan_time", "torch": torch.__version__, "device": "cpu", "git_sha": sha, "rows": rows}))


if __name__ == "__main__":
    main()
