"""Profiler accuracy: predicted vs measured FLOPs and peak training-step memory on real CPU runs.

    python benchmarks/profiler_accuracy.py                 # every zoo model, tiny, two batch sizes
    python benchmarks/profiler_accuracy.py --models gpt2 --speed   # + GPT-2 small (B=8, S=1024) profiling time
    python benchmarks/profiler_accuracy.py --hf            # the 40 Hugging Face families of hf_families.py
    python benchmarks/profiler_accuracy.py --hf llama,t5   # some of them

FLOPs are compared with FlopCounterMode (CPU SDPA formulas registered, see
autopar/profiler/flops.py); memory with the peak of live tensor storage of one
AdamW step (autopar/profiler/measure.py), without recomputation and with every
transformer block checkpointed (each call of a block its own region, `block_call_of`: ALBERT runs
one shared layer at every depth). "profile s" is `profile(traced)` from a cold
probe cache; "step s" is one real training step. `--speed` times GPT-2 small in a
fresh process (wall and CPU seconds: CPU time is what a loaded machine does not inflate).
`--hf` does the same for the Hugging Face families, each traced at each batch size (16 tokens a row,
the families' own sample, its rows repeated), with its config's dropout off, and measured as traced: KV cache off.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autopar.profiler import block_call_of, block_of, peak_memory, profile  # noqa: E402
from autopar.profiler import probe as probe_mod  # noqa: E402
from autopar.profiler.measure import block_paths, checkpoint_modules, measure_flops, measure_step, time_step  # noqa: E402
from autopar.tracer import trace  # noqa: E402
from autopar.tracer.capture import without_kv_cache  # noqa: E402
from tests.profiler.zoo import DYNAMIC, load_example  # noqa: E402

BATCHES = {"mlp": (64, 512), "vit": (4, 16)}


def _err(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.2f}%"


def run_model(name: str, seq: int) -> list[dict]:
    example = load_example(name)
    model, sample = example.build(2, seq, size="tiny", device="meta")  # models without a seq symbol trace at `seq`
    traced = trace(model, sample, dynamic_dims=DYNAMIC.get(name, {"batch": 0}))
    probe_mod._CACHE.clear()
    start = time.perf_counter()
    prof = profile(traced)
    profile_s = time.perf_counter() - start
    rows = []
    for batch in BATCHES.get(name, (4, 8)):
        sizes = {"batch": batch, "seq": seq}
        cost = prof.evaluate(**sizes)
        pred_flops = sum(c.fwd_flops + c.bwd_flops for c in cost.nodes.values())
        real, real_in = example.build(batch, seq, size="tiny", device="cpu")
        meas_flops = measure_flops(real, real_in)
        step_s = time_step(real, real_in)
        row = {"model": name, "batch": batch, "pred_flops": pred_flops, "meas_flops": meas_flops,
               "flops_err": _err(pred_flops, meas_flops), "profile_s": profile_s, "step_s": step_s}
        for label, ckpt in (("mem", False), ("mem_ckpt", True)):
            real, real_in = example.build(batch, seq, size="tiny", device="cpu")
            recompute = frozenset()
            if ckpt:
                blocks = block_paths(real)
                checkpoint_modules(real, blocks)
                recompute = frozenset(n.name for n in traced.graph.nodes if block_of(n) in blocks)
            pred = peak_memory(traced, cost, recompute, region_of=block_call_of).peak_bytes
            meas = measure_step(real, real_in).peak_bytes
            row.update({f"{label}_pred": pred, f"{label}_meas": meas, f"{label}_err": _err(pred, meas)})
        rows.append(row)
    return rows


def _hf_row(name: str, build, kind: str, batch: int) -> dict:
    from autopar.api import capture_copy
    from hf_families import sample_for, without_dropout

    sample = {k: v.repeat(batch // v.shape[0], *([1] * (v.dim() - 1))) for k, v in sample_for(kind).items()}

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return without_dropout(build())

    model = fresh()
    traced = trace(*capture_copy(model, sample, "cpu"))
    cost = profile(traced).evaluate()
    row = {"model": name, "batch": batch, "pred_flops": sum(c.fwd_flops + c.bwd_flops for c in cost.nodes.values()),
           "meas_flops": measure_flops(model, sample)}
    row["flops_err"] = _err(row["pred_flops"], row["meas_flops"])
    for label, ckpt in (("mem", False), ("mem_ckpt", True)):
        model, recompute = fresh(), frozenset()
        if ckpt:
            blocks = block_paths(model)
            checkpoint_modules(model, blocks)
            recompute = frozenset(n.name for n in traced.graph.nodes if block_of(n) in blocks)
        # Measured as traced: with the KV cache off. A checkpointed block would otherwise append its keys and
        # values to the cache again when it is recomputed, and the cache would keep both alive through backward.
        with without_kv_cache(model):
            meas = measure_step(model, sample).peak_bytes
        pred = peak_memory(traced, cost, recompute, region_of=block_call_of).peak_bytes
        row.update({f"{label}_pred": pred, f"{label}_meas": meas, f"{label}_err": _err(pred, meas)})
    return row


def run_hf(names: list[str]) -> list[dict]:
    from hf_families import FAMILIES
    rows = []
    for name in names or FAMILIES:
        build, kind = FAMILIES[name]
        for batch in (4, 8):
            try:
                rows.append(_hf_row(name, build, kind, batch))
            except Exception as err:  # one family failing should not hide the others' numbers
                rows.append({"model": name, "batch": batch, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"})
                break
    return rows


def gpt2_small_speed() -> dict:
    """Profiling time of GPT-2 small in this process right after its trace (run it in a fresh process)."""
    model, sample = load_example("gpt2").build(8, 1024, size="small", device="meta")
    traced = trace(model, sample, dynamic_dims={"batch": 0, "seq": 1})
    probe_mod._CACHE.clear()
    start, start_cpu = time.perf_counter(), time.process_time()
    prof = profile(traced)
    profile_s, profile_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    start = time.perf_counter()
    cost = prof.evaluate(batch=8, seq=1024)
    est = peak_memory(traced, cost)
    return {"profile_s": profile_s, "profile_cpu_s": profile_cpu_s, "evaluate_and_memory_s": time.perf_counter() - start,
            "tflops_per_step": sum(c.fwd_flops + c.bwd_flops for c in cost.nodes.values()) / 1e12,
            "peak_gib": est.peak_bytes / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["mlp", "gpt2", "bert", "vit", "llama", "hf_gpt2", "hf_llama"])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--speed", action="store_true", help="also time profiling GPT-2 small (B=8, S=1024)")
    parser.add_argument("--speed-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf", nargs="?", const="", default=None,
                        help="the Hugging Face families instead (comma-separated names; default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.speed_child:
        print(json.dumps(gpt2_small_speed()))
        return
    cols = ["model", "batch", "pred_flops", "meas_flops", "flops_err", "mem_pred", "mem_meas", "mem_err",
            "mem_ckpt_pred", "mem_ckpt_meas", "mem_ckpt_err", "profile_s", "step_s"]
    print(" | ".join(cols))
    results = []
    if args.hf is not None:
        cols = [c for c in cols if c not in ("profile_s", "step_s")]
        for row in run_hf([n for n in args.hf.split(",") if n]):
            results.append(row)
            print(f"{row['model']} | {row['batch']} | failed: {row['error']}" if "error" in row else
                  " | ".join(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in cols), flush=True)
    for name in args.models if args.hf is None else ():
        try:
            rows = run_model(name, args.seq)
        except Exception as err:  # one model failing should not hide the others' numbers
            print(f"{name}: failed: {type(err).__name__}: {str(err).splitlines()[0]}")
            continue
        for row in rows:
            results.append(row)
            print(" | ".join(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in cols))
    speed = None
    if args.speed:  # a fresh process: the cold cost a user pays once per `autopar plan`
        child = subprocess.run([sys.executable, __file__, "--speed-child"], capture_output=True, text=True, check=True)
        speed = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"GPT-2 small B=8 S=1024: profile {speed['profile_s']:.2f} s wall, {speed['profile_cpu_s']:.2f} s CPU "
              f"(target < 1 s, fresh process), "
              f"evaluate+peak_memory {speed['evaluate_and_memory_s']:.2f} s, "
              f"{speed['tflops_per_step']:.1f} TFLOP/step, peak {speed['peak_gib']:.2f} GiB")
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"torch": torch.__version__, "device": "cpu", "git": sha, "results": results, "gpt2_small": speed}))


if __name__ == "__main__":
    main()
