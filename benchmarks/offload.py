"""The host tier priced: a LLaMA-2-7B shape on 24 GB cards with AdamW's state on the host, against without.

    python benchmarks/offload.py                       # 1, 2, 4 and 8 x RTX 4090 (24 GB), 8 x H100 (80 GB)
    python benchmarks/offload.py --meshes rtx4090:4

For each mesh the solver plans the model (one 2048-token sequence per device, float32 AdamW) twice under the
device's memory: with every parameter's optimizer state on the host (`parallelize(..., offload="optimizer")`,
`solver.offload`) and without; each row gives the predicted step, device and host bytes per rank, or
"infeasible" with the least device memory any plan needs. The host tier's time is its own column: the
gradients' and parameters' copies over PCIe (`Mesh.host_link_bytes_per_s`) and the host's AdamW step
(`solver.offload.HOST_ADAMW_PARAMS_PER_S`), none of it overlapped with compute (as the runtime runs it).
Predictions of the cost model only: nothing here runs on a GPU.
"""
from __future__ import annotations

import argparse

from _common import load_example, provenance_line

from autopar.errors import InfeasibleError
from autopar.profiler import profile
from autopar.solver import solve
from autopar.solver.mesh import make_mesh
from autopar.solver.offload import HOST_ADAMW_PARAMS_PER_S, offloaded_profile, with_offload
from autopar.tracer import trace

GIB = 2**30


def plan_row(traced, prof, hardware: str, gpus: int, offload: bool, time_limit_s: float) -> dict:
    mesh = make_mesh(gpus, hardware=hardware)
    names = frozenset(prof.params) if offload else frozenset()
    row = {"mesh": f"{gpus} x {hardware}", "offload": offload}
    try:
        plan = with_offload(solve(traced, offloaded_profile(prof, names), mesh, time_limit_s=time_limit_s), prof, names)
    except InfeasibleError as err:
        return {**row, "fits": False, "error": str(err).split(";")[0]}
    m = plan.memory
    return {**row, "fits": True, "step_s": plan.time.total_s, "offload_s": plan.time.offload_s,
            "device_gib": m.total_bytes / GIB, "host_gib": m.host_bytes / GIB,
            "zero": sum(p.zero for p in plan.params), "recomputed": len(plan.recomputed()), "shape": plan.mesh.shape}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="rtx4090:1,rtx4090:2,rtx4090:4,rtx4090:8,h100:8", help="hardware:gpus, comma-separated")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per ILP search")
    args = parser.parse_args()
    zoo = load_example("llama")
    rows = []
    for item in args.meshes.split(","):
        hardware, gpus = item.split(":")
        model, sample = zoo.build(batch_size=int(gpus), seq_len=2048, size="7b", device="meta")
        traced = trace(model, sample)
        prof = profile(traced, optimizer="adamw")
        for offload in (False, True):
            rows.append(plan_row(traced, prof, hardware, int(gpus), offload, args.time_limit))
            print(rows[-1], flush=True)
    print(f"\nLLaMA-2-7B shape, float32 AdamW, one 2048-token sequence per device; host AdamW at "
          f"{HOST_ADAMW_PARAMS_PER_S:.2g} parameters/s")
    print(f"| {'mesh':<12} | {'optimizer state':<15} | {'step':>8} | {'of it host tier':>15} | {'device GiB':>10} | "
          f"{'host GiB':>8} | plan |")
    print(f"|{'-' * 14}|{'-' * 17}|{'-' * 10}|{'-' * 17}|{'-' * 12}|{'-' * 10}|------|")
    for r in rows:
        where = "host" if r["offload"] else "device"
        if not r["fits"]:
            print(f"| {r['mesh']:<12} | {where:<15} | infeasible: {r['error']} |")
            continue
        print(f"| {r['mesh']:<12} | {where:<15} | {r['step_s']:>6.2f} s | {r['offload_s']:>13.2f} s | {r['device_gib']:>10.2f} | "
              f"{r['host_gib']:>8.2f} | {r['zero']} ZeRO, {r['recomputed']} recomputed, mesh {r['shape']} |")
    print(provenance_line("offload", rows=rows))


if __name__ == "__main__":
    main()
