"""The host tier as the solver chooses it: a LLaMA-2-7B shape on 24 GB cards, against the best plan without it.

    python benchmarks/offload.py                       # 1, 4 and 8 x RTX 4090 (24 GB), 8 x H100 (80 GB)
    python benchmarks/offload.py --meshes rtx4090:4 --host-memory 256GB
    python benchmarks/offload.py --precisions bf16 --meshes rtx4090:1   # bf16 compute on float32 masters

For each mesh the solver plans the model (one 2048-token sequence per device, float32 AdamW) under the device's
memory twice: with each parameter's tier its own choice (`parallelize(..., offload="auto")`, `solver.offload`:
the host tier within `--host-memory` of one machine, shared by its devices) and without the host tier. Each row
gives the predicted step, device and host bytes per rank and how many parameters the solver put on the host, or
"infeasible" with the least device memory any plan needs. Under `--precisions bf16` (`autopar.MixedPrecision`) a
parameter on the host tier and off ZeRO takes ZeRO-Offload's layout: only its bf16 copy and its gradient in flight
on the device. The host tier's time is its own column: the
gradients' and parameters' copies over PCIe (`Mesh.host_link_bytes_per_s`) and the host's AdamW step
(`solver.offload.HOST_ADAMW_PARAMS_PER_S`), none of it overlapped with compute (as the runtime runs it).
Predictions of the cost model only: nothing here runs on a GPU.

Last, ZeRO-Offload's published single-GPU configuration (Ren et al. 2021, arXiv 2101.06840: a 10B GPT-2-like model,
50 layers of width 4096, on one V100 32 GB, about 40 TFLOP/s reported): the solver's plan for it on the `v100` preset
under bf16 (the preset's half-precision rate is fp16's) with the host tier its choice, its predicted step and TFLOP/s
(the step's forward and backward FLOPs, recompute not counted, over the predicted step) beside the paper's.
"""
from __future__ import annotations

import argparse

import torch

from _common import load_example, provenance_line

from autopar.api import profiled, traced_model
from autopar.errors import InfeasibleError
from autopar.mixed_precision import POLICIES
from autopar.solver import solve_for_devices
from autopar.solver.offload import HOST_ADAMW_PARAMS_PER_S, host_budget_per_rank

GIB = 2**30
GPUS_PER_MACHINE = 8


def plan_row(traced, prof, hardware: str, gpus: int, host_budget_bytes: float | None, time_limit_s: float,
             precision: str = "fp32") -> dict:
    row = {"mesh": f"{gpus} x {hardware}", "precision": precision,
           "tier": "solver's choice" if host_budget_bytes is not None else "device only"}
    try:
        plan, _ = solve_for_devices(traced, prof, gpus, hardware=hardware, time_limit_s=time_limit_s,
                                    host_budget_bytes=host_budget_bytes, precision=precision)
    except InfeasibleError as err:
        return {**row, "fits": False, "error": str(err).split(";")[0]}
    m = plan.memory
    return {**row, "fits": True, "step_s": plan.time.total_s, "offload_s": plan.time.offload_s,
            "compute_s": plan.time.compute_s, "recompute_s": plan.time.recompute_s, "comm_s": plan.time.comm_s,
            "device_gib": m.total_bytes / GIB, "host_gib": m.host_bytes / GIB, "hosted": len(plan.offloaded()),
            "params": len(plan.params), "zero": sum(p.zero for p in plan.params), "recomputed": len(plan.recomputed()),
            "shape": plan.mesh.shape}


# ZeRO-Offload (arXiv 2101.06840) on one V100 32 GB: a 10B GPT-2-like model (50 layers, hidden 4096, 32 heads,
# 1024-token context), about 40 TFLOP/s reported. The micro-batch (8 sequences of 1024 tokens) is this script's
# choice: the plan is priced at it.
PAPER_TFLOPS = 40.0
PAPER_LAYERS, PAPER_WIDTH, PAPER_HEADS, PAPER_BATCH = 50, 4096, 32, 8


def zero_offload_row(host_memory_bytes: float, time_limit_s: float) -> dict:
    """The solver's plan for ZeRO-Offload's single-V100 configuration: step, TFLOP/s, and where the time goes."""
    gpt2 = load_example("gpt2")
    cfg = gpt2.GPTConfig(n_layer=PAPER_LAYERS, n_head=PAPER_HEADS, n_embd=PAPER_WIDTH)
    with torch.device("meta"):
        model = gpt2.GPT(cfg).train()
        ids = torch.randint(0, cfg.vocab_size, (PAPER_BATCH, cfg.block_size))
    sample = {"input_ids": ids, "labels": ids}
    policy = POLICIES["bf16"]
    traced = traced_model(model, sample, "cpu", mixed_precision=policy)
    prof = profiled(traced, "adamw", model, policy)
    flops = sum(n.fwd_flops + n.bwd_flops for n in prof.evaluate().nodes.values())
    params = sum(p.numel() for p in model.parameters())
    row = plan_row(traced, prof, "v100", 1, host_budget_per_rank(host_memory_bytes, 1), time_limit_s, "bf16")
    row.update(numel=params, step_tflop=flops / 1e12)
    if row["fits"]:
        row["tflops"] = flops / row["step_s"] / 1e12
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="rtx4090:1,rtx4090:4,rtx4090:8,h100:8", help="hardware:gpus, comma-separated")
    parser.add_argument("--host-memory", type=float, default=256e9, help="host bytes of one machine (8 devices at most)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per search (all mesh shapes)")
    parser.add_argument("--precisions", default="fp32,bf16", help="fp32 and/or bf16 (bf16 compute on float32 masters)")
    args = parser.parse_args()
    zoo = load_example("llama")
    rows = []
    for precision in args.precisions.split(","):
        policy = POLICIES[precision]
        for item in args.meshes.split(","):
            hardware, gpus = item.split(":")
            model, sample = zoo.build(batch_size=int(gpus), seq_len=2048, size="7b", device="meta")
            traced = traced_model(model, sample, "meta" if policy is None else "cpu", mixed_precision=policy)
            prof = profiled(traced, "adamw", model, policy)
            host = host_budget_per_rank(args.host_memory, min(int(gpus), GPUS_PER_MACHINE))
            for budget in (None, host):
                rows.append(plan_row(traced, prof, hardware, int(gpus), budget, args.time_limit, precision))
                print(rows[-1], flush=True)
    print(f"\nLLaMA-2-7B shape, float32 AdamW (on float32 masters under bf16), one 2048-token sequence per device; host AdamW at "
          f"{HOST_ADAMW_PARAMS_PER_S:.2g} parameters/s; {args.host_memory / 1e9:.0f} GB of host memory per machine")
    print(f"| {'mesh':<12} | {'precision':<9} | {'tier':<15} | {'step':>8} | {'vs device only':>14} | {'of it host tier':>15} | "
          f"{'device GiB':>10} | {'host GiB':>8} | {'on host':>9} | plan |")
    print(f"|{'-' * 14}|{'-' * 11}|{'-' * 17}|{'-' * 10}|{'-' * 16}|{'-' * 17}|{'-' * 12}|{'-' * 10}|{'-' * 11}|------|")
    for base, r in zip(rows[::2], rows[1::2]):
        for row in (base, r):
            if not row["fits"]:
                print(f"| {row['mesh']:<12} | {row['precision']:<9} | {row['tier']:<15} | infeasible: {row['error']} |")
                continue
            ratio = f"{row['step_s'] / base['step_s']:.2f}x" if base["fits"] else "(infeasible)"
            print(f"| {row['mesh']:<12} | {row['precision']:<9} | {row['tier']:<15} | {row['step_s']:>6.2f} s | {ratio:>14} | "
                  f"{row['offload_s']:>13.2f} s | {row['device_gib']:>10.2f} | {row['host_gib']:>8.2f} | "
                  f"{row['hosted']:>3} of {row['params']:<3} | {row['zero']} ZeRO, {row['recomputed']} recomputed, "
                  f"mesh {row['shape']} |")
    paper = zero_offload_row(args.host_memory, args.time_limit)
    print(paper, flush=True)
    print(f"\nZeRO-Offload's single-GPU configuration: {paper['numel'] / 1e9:.1f}B GPT-2-like, batch {PAPER_BATCH} x 1024, "
          f"one V100 32 GB (v100 preset, bf16 standing for fp16), {paper['step_tflop']:.0f} TFLOP a step")
    if paper["fits"]:
        print("| source | step | TFLOP/s | of it host tier | device GiB | host GiB | on host | plan |")
        print("|--------|------|---------|-----------------|------------|----------|---------|------|")
        print(f"| predicted (autopar) | {paper['step_s']:.2f} s | {paper['tflops']:.1f} | {paper['offload_s']:.2f} s | "
              f"{paper['device_gib']:.2f} | {paper['host_gib']:.2f} | {paper['hosted']} of {paper['params']} | "
              f"{paper['zero']} ZeRO, {paper['recomputed']} recomputed |")
        print(f"| published (Ren et al. 2021) | | ~{PAPER_TFLOPS:.0f} | | | | | |")
    else:
        print(f"infeasible: {paper['error']}")
    print(provenance_line("offload", rows=rows, zero_offload=paper))


if __name__ == "__main__":
    main()
