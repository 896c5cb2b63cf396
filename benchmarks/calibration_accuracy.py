"""Does a calibrated mesh predict single ops and collectives on this machine? Predicted vs measured, op by op.

    python benchmarks/calibration_accuracy.py --ranks 4

On --ranks forked gloo ranks (one thread each): `calibrate()` a 1-D mesh, then time,
with every rank busy at once (as in a training step), held-out work the cost model
prices: matmuls and elementwise ops of several sizes (`cost.compute_time_s` plus one
`op_overhead_s`), a forward + backward chain of tiny ops (overhead only) and every
collective kind at three sizes (`cost.collective_time_s`), back to back and, for
small messages, in situ (right after some compute, net of it: what calibrate's latency
models, so back-to-back small collectives come out over-predicted by design). Prints a table with the
ratio predicted / measured, the geometric mean of |log ratio| per group and the worst
ratio, then one JSON provenance line. Timing is `calibrate.time_op` (median block,
slowest rank), the same code calibrate() measures with.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "benchmarks":
    sys.path[0] = str(ROOT)  # import helpers as the `benchmarks` package (see vs_baselines.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from autopar.runtime.calibrate import _SITU_COMPUTE_S, calibrate, collective_call, model_bytes, time_op, time_ops  # noqa: E402
from autopar.runtime.launch import run_ranks  # noqa: E402
from autopar.solver.cost import collective_time_s, compute_time_s  # noqa: E402
from autopar.solver.mesh import COLLECTIVE_KINDS  # noqa: E402

from benchmarks._common import provenance_line  # noqa: E402

MATMULS = ((128, 64, 64), (256, 64, 256), (1024, 64, 256), (384, 128, 192), (512, 512, 512))
ELEMENTWISE_NUMEL = (16 * 1024, 128 * 1024, 1024 * 1024)
COLLECTIVE_BYTES = (8 * 1024, 256 * 1024, 4 * 1024 * 1024)
CHAIN_OPS = 100


def _rows(rank: int, world: int, reps: int) -> list[tuple[str, str, float, float]] | None:
    """(group, what, predicted_s, measured_s) per held-out case; on rank 0 only."""
    cpu = torch.device("cpu")
    mesh = calibrate(mesh_shape=(world,), reps=reps)
    over = mesh.op_overhead_s
    rows = []
    for m, k, n in MATMULS:
        a, b = torch.randn(m, k), torch.randn(k, n)
        pred = compute_time_s(2 * m * k * n, 4 * m * n, mesh) + over
        rows.append(("matmul", f"mm {m}x{k}x{n}", pred, time_op(lambda: a @ b, cpu, reps, None)))
    for numel in ELEMENTWISE_NUMEL:
        x, y = torch.randn(numel), torch.randn(numel)
        pred = compute_time_s(0.0, 4 * numel, mesh) + over
        rows.append(("elementwise", f"mul {numel * 4 // 1024} KB", pred, time_op(lambda: x * y, cpu, reps, None)))
        rows.append(("elementwise", f"gelu {numel * 4 // 1024} KB", pred, time_op(lambda: F.gelu(x), cpu, reps, None)))
    w = torch.ones(16, requires_grad=True)

    def chain() -> None:
        h = w
        for _ in range(CHAIN_OPS - 1):
            h = torch.sin(h)
        h.sum().backward()

    rows.append(("overhead", f"{CHAIN_OPS} tiny ops fwd+bwd", 2 * CHAIN_OPS * over, time_op(chain, cpu, reps, None)))
    axis = mesh.axes[0]
    for kind in COLLECTIVE_KINDS:
        for nbytes in COLLECTIVE_BYTES:
            pred = collective_time_s(kind, model_bytes(kind, nbytes, world), axis)
            meas = time_op(collective_call(kind, nbytes, world, None, cpu), cpu, reps, None)
            rows.append(("collective", f"{kind} {nbytes // 1024} KB/rank", pred, meas))
    # in situ: after a layer's forward and backward worth of compute (~5 ms, as calibrate's latency), net of it
    a, b = torch.randn(192, 320), torch.randn(320, 256)  # held out: not calibrate's in-situ matmul
    repeats = max(1, round(_SITU_COMPUTE_S / time_op(lambda: a @ b, cpu, 1, None)))

    def compute() -> None:
        for _ in range(repeats):
            a @ b

    for kind in ("all_reduce", "all_gather"):
        call = collective_call(kind, 8 * 1024, world, None, cpu)
        with_coll, alone = time_ops([lambda: (compute(), call()), compute], cpu, reps, None)
        pred = collective_time_s(kind, model_bytes(kind, 8 * 1024, world), axis)
        rows.append(("in situ", f"{kind} 8 KB/rank after compute", pred, max(with_coll - alone, 1e-6)))
    return rows if rank == 0 else None


def _table(rows: list[tuple[str, str, float, float]]) -> tuple[str, dict]:
    lines = [f"{'group':<12} {'case':<30} {'pred ms':>9} {'meas ms':>9} {'pred/meas':>9}"]
    for group, what, pred, meas in rows:
        lines.append(f"{group:<12} {what:<30} {pred * 1e3:9.3f} {meas * 1e3:9.3f} {pred / meas:9.2f}")
    summary = {}
    lines.append("")
    for group in dict.fromkeys(g for g, *_ in rows):
        logs = [abs(math.log(p / m)) for g, _, p, m in rows if g == group]
        worst = max((p / m for g, _, p, m in rows if g == group), key=lambda r: abs(math.log(r)))
        summary[group] = {"geomean_factor": round(math.exp(sum(logs) / len(logs)), 3), "worst_ratio": round(worst, 3)}
        lines.append(f"{group:<12} typical factor off {summary[group]['geomean_factor']:.2f}x, worst pred/meas {worst:.2f}")
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="gloo ranks to fork (2 or 4)")
    ap.add_argument("--reps", type=int, default=5, help="timed blocks per measurement (median kept)")
    args = ap.parse_args(argv)
    rows = run_ranks(_rows, args.ranks, args.reps, timeout_s=600)[0]
    text, summary = _table(rows)
    print(text)
    print(provenance_line("calibration_accuracy", ranks=args.ranks, summary=summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
