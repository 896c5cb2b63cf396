"""The pipeline cost model against Megatron-LM's published throughput (Narayanan et al. 2021, arXiv 2104.04473).

    python benchmarks/pipeline.py --megatron                  # every row of the paper's Table 1 with p > 1
    python benchmarks/pipeline.py --megatron --only 145.6B

Table 1 of the paper trains GPT models (vocabulary 51,200, sequence 2,048) on Selene: nodes of 8 A100
80 GB on NVLink 3 and NVSwitch, 8 HDR InfiniBand adapters (200 Gb/s) a node. Each row gives the tensor
(t) and pipeline (p) degrees, the GPUs n (data-parallel degree d = n / (t p)), the global batch B and the
achieved TFLOP/s per GPU, counted by the paper's formula (its eq. 3, activation recomputation included):
F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) per step.

Each row is priced here with the same configuration forced: the model in bf16 (the paper's 16-bit
activations and communication; its float32 master weights and optimizer state, 16 bytes a parameter with
Adam, are 8 here), the `a100` preset's GPUs, 8 a node on its NVLink
axis and InfiniBand between nodes (25 GB/s per GPU), pp = p ranks each holding l / p layers (the first
also the embeddings, the last the head and loss), each stage on a (d, t) mesh, 1F1B, micro-batches of one
sequence per data-parallel rank (the table does not list the micro-batch size; the paper's section 5
uses 1 for its largest models) -- `autopar.pipeline.search.price_config`. What each stage does on its
(d, t) mesh (tensor parallelism on t or not, ZeRO, recompute) is the ILP's choice. The predicted TFLOP/s
per GPU is F over the predicted step and n, so predicted / published is published step / predicted step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from _common import load_example
from autopar.api import trace_copy
from autopar.errors import AutoparError
from autopar.pipeline.api import microbatch_sample
from autopar.pipeline.cache import SearchCache
from autopar.pipeline.search import Config, Topology, price_config
from autopar.solver.mesh import PRESETS, MeshAxis

VOCAB, SEQ = 51200, 2048
GPUS_PER_NODE = 8
# Selene's InfiniBand: 8 HDR adapters of 200 Gb/s a node, 25 GB/s per GPU; latency as the h100-ib preset's node axis
A100_IB = Topology(intra=PRESETS["a100"].axes[0], inter=MeshAxis("node", 1, 2e-5, 25e9), gpus_per_node=GPUS_PER_NODE,
                   base=PRESETS["a100"])


@dataclass(frozen=True)
class Row:
    """One row of Table 1: the model and its configuration, and what the paper measured."""

    name: str  # billions of parameters, as the paper writes it
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    published_tflops: float  # achieved TFLOP/s per GPU

    @property
    def d(self) -> int:
        return self.gpus // (self.t * self.p)

    def flops(self) -> float:
        """The paper's eq. 3: model FLOPs of one step, the recomputed forward included."""
        b, s, l, h = self.batch, SEQ, self.layers, self.hidden
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))


TABLE_1 = (
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142), Row("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138), Row("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148), Row("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163), Row("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
PIPELINED = tuple(r for r in TABLE_1 if r.p > 1)


def predict(row: Row, time_limit_s: float) -> dict:
    """The row's configuration priced by the cost model: its step, TFLOP/s per GPU, and the plan's bubble."""
    example = load_example("gpt2")
    example.CONFIGS[row.name] = example.GPTConfig(n_layer=row.layers, n_head=row.heads, n_embd=row.hidden,
                                                  vocab_size=VOCAB, block_size=SEQ)
    model, sample = example.build(row.batch, SEQ, size=row.name, device="meta")
    model.to(torch.bfloat16)  # the paper's 16-bit activations and communication (its fp16 has bf16's size)
    microbatches = row.batch // row.d  # one sequence per data-parallel rank
    began = time.process_time()
    cache = SearchCache(lambda m: trace_copy(model, microbatch_sample(sample, m), "meta"), time_limit_s=time_limit_s)
    per_stage = row.layers // row.p
    starts = tuple(1 + s * per_stage for s in range(1, row.p))  # unit 0: the embeddings; unit 1 + i: layer i
    out = {"row": row.name, "t": row.t, "p": row.p, "d": row.d, "gpus": row.gpus, "batch": row.batch,
           "microbatches": microbatches, "published_tflops": row.published_tflops,
           "published_step_s": row.flops() / (row.gpus * row.published_tflops * 1e12)}
    try:
        plan = price_config(cache, Config(row.p, (row.d, row.t), microbatches), "1f1b", topology=A100_IB,
                            time_limit_s=time_limit_s, starts=starts)
        slowest = max(range(len(plan.stages)), key=lambda i: plan.time.stage_s[i])
        t = plan.stages[slowest].plan.time  # one micro-batch's, with 1/m of the sync and the optimizer's step
        out.update(step_s=plan.time.step_s, tflops=row.flops() / (plan.time.step_s * row.gpus) / 1e12,
                   bubble=plan.time.bubble_fraction, sync_s=plan.time.sync_s, p2p_s=plan.time.p2p_s,
                   recomputed=sum(len(s.plan.recomputed()) > 0 for s in plan.stages),
                   zero_params=sum(p.zero for s in plan.stages for p in s.plan.params),
                   # the stage that sets 1F1B's pace: a micro-batch's forward and backward, its compute, communication
                   # (less its share of the once-a-step sync) and recomputed forward
                   slowest=slowest, slowest_s=plan.time.stage_s[slowest], compute_s=t.compute_s - t.update_s,
                   comm_s=plan.time.stage_s[slowest] - (t.compute_s - t.update_s) - t.recompute_s,
                   recompute_s=t.recompute_s, mem_gib=max(plan.memory_bytes) / 2**30)
        # Megatron recomputes every layer's forward (its eq. 3 counts it): the step if the slowest stage ran a third
        # of its compute again each micro-batch beyond what its plan recomputes, over 1F1B's m + p - 1 slots
        again_s = max(out["compute_s"] / 3 - t.recompute_s, 0.0) * (microbatches + row.p - 1)
        out["tflops_recomputed"] = row.flops() / ((plan.time.step_s + again_s) * row.gpus) / 1e12
    except AutoparError as err:
        out["error"] = str(err).splitlines()[0]
    out["cpu_s"] = time.process_time() - began
    return out


def print_table(rows: list[dict]) -> None:
    """recomp.: predicted / published were every layer's forward recomputed, as Megatron's are (an estimate: a third
    of the slowest stage's compute again each micro-batch); compute, comm, recomp: ms of one micro-batch's forward and backward on the stage that sets 1F1B's pace (its
    compute, its in-graph collectives and sends, its recomputed forward); sync s: the slowest rank's gradient sync."""
    print(f"{'params':>8} {'t':>2} {'p':>3} {'d':>3} {'GPUs':>5} {'batch':>5} {'m':>4} {'published':>9} {'predicted':>9} "
          f"{'pred/pub':>8} {'recomp.':>7} {'bubble':>6} {'sync s':>6} {'compute':>7} {'comm':>6} {'recomp':>6} {'mem GiB':>7} {'CPU s':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['row']:>8} {r['t']:2d} {r['p']:3d} {r['d']:3d} {r['gpus']:5d} {r['batch']:5d} "
                  f"{r['microbatches']:4d} {r['published_tflops']:9.0f}  {r['error']}")
            continue
        print(f"{r['row']:>8} {r['t']:2d} {r['p']:3d} {r['d']:3d} {r['gpus']:5d} {r['batch']:5d} {r['microbatches']:4d} "
              f"{r['published_tflops']:9.0f} {r['tflops']:9.1f} {r['tflops'] / r['published_tflops']:8.2f} "
              f"{r['tflops_recomputed'] / r['published_tflops']:7.2f} {r['bubble']:6.1%} {r['sync_s']:6.2f} {r['compute_s'] * 1e3:7.1f} {r['comm_s'] * 1e3:6.1f} "
              f"{r['recompute_s'] * 1e3:6.1f} {r['mem_gib']:7.1f} {r['cpu_s']:6.0f}")
