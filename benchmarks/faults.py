"""Faults injected into a training job, and what each does: the table of docs/guide/reliability.md.

    python -m benchmarks.faults                          # every fault (about 6 minutes on 2 idle cores)
    python -m benchmarks.faults --only kill-during-save,drift

Each row forks a world of 2 gloo ranks (`run_ranks`, one thread each) that trains gpt2-tiny (batch 4,
16 tokens) under `autopar.parallelize`'s plan for the CPU preset, which stores the position table split,
and injects one fault: a rank SIGKILLed, SIGSTOPped or sent SIGTERM, a byte flipped in a checkpoint, a
crafted file, a call or an input only one rank makes. It reports what the ranks raised (the first line of
each distinct error), the seconds from the fault to that error on the slowest rank, and what was lost:
for a checkpoint, whether the newest complete one loads and equals the state of the step it was saved at
(full tensors, bit for bit). Timeouts are autopar's defaults (a checked call waits 60 s) except the
process group's, 30 s here where torchrun's gloo default is 30 minutes. One JSON line follows the table.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import pickle
import signal
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem

import autopar
from autopar.cli import main as cli_main
from autopar.model_file import import_model_file
from autopar.runtime.checkpoints import latest_checkpoint
from autopar.runtime.launch import run_ranks
from autopar.solver.plan import PlanSource
from autopar.solver.plan_io import load_plan, plan_to_json, save_plan

from benchmarks._common import ROOT, load_example, provenance_line

GROUP_TIMEOUT_S = 30.0
TRAIN = import_model_file(ROOT / "examples" / "train.py")
TRAIN_ARGV = ["--model", "gpt2", "--size", "tiny", "--batch-size", "4", "--seq-len", "16"]


@dataclass(frozen=True)
class Row:
    fault: str
    saw: str
    seconds: float | None
    lost: str


def _gpt2():
    return load_example("gpt2").build(batch_size=4, seq_len=16, size="tiny", device="cpu")


def _module(rank: int, world: int, **kwargs):
    model, batch = _gpt2()
    pm = autopar.parallelize(model, batch, (world,), **kwargs)
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), pm.local_batch(batch)


def _step(pm, opt, batch) -> float:
    opt.zero_grad()
    loss = pm(**batch)
    loss.backward()
    opt.step()
    return loss.item()


def _caught(fn: Callable[[], Any], since: float | None = None) -> tuple[str, str, float] | None:
    """(error type, its first line, seconds since `since` or the call) if `fn` raises, else None."""
    start = time.monotonic() if since is None else since
    try:
        fn()
    except Exception as err:  # noqa: BLE001 -- what the user sees is the measurement
        return type(err).__name__, _opening(str(err)), time.monotonic() - start
    return None


def _opening(message: str) -> str:
    """An error's first line, with the next ones while it ends in a colon (a heading over a list)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    shown = lines[:1]
    while shown[-1].endswith(":") and len(shown) < min(len(lines), 4):
        shown.append(lines[len(shown)])
    return " ".join(shown)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _summary(outcomes: list) -> tuple[str, float | None]:
    seen = [o for o in outcomes if isinstance(o, tuple)]
    if not seen:
        return "no error", None
    distinct = []
    for kind, line, _ in seen:
        if f"{kind}: {line}" not in distinct:
            distinct.append(f"{kind}: {line}")
    return " / ".join(distinct), max(s for _, _, s in seen)


# ------------------------------------------------------------------ checkpoints
def _save_then_fault(rank, world, root, phase, background):
    """Step, save, step, save again with rank 1 killed at `phase` of the second save. Rank 0 returns its full state
    after the first save and what it saw."""
    pm, opt, batch = _module(rank, world)
    _step(pm, opt, batch)
    pm.save_checkpoint(root, opt)
    saved = pm.state_dict()
    _step(pm, opt, batch)
    if rank == 1:
        if phase == "before":
            _die()
        write, calls = filesystem._write_item, []

        def write_then_die(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                _die()
            return write(*args, **kwargs)
        filesystem._write_item = write_then_die

    def save():
        written = pm.save_checkpoint(root, opt, background=background)
        if written is not None:
            written.result()
    return saved, _caught(save)


def _load_newest(rank, world, root):
    pm, opt, _ = _module(rank, world)
    loaded = pm.load_checkpoint(root, opt)
    return os.path.basename(loaded), pm.state_dict()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _checkpoint_row(fault: str, phase: str, background: bool, tmp: Path) -> Row:
    root = str(tmp / f"{phase}-{background}")
    results = run_ranks(_save_then_fault, 2, root, phase, background, timeout_s=300, group_timeout_s=GROUP_TIMEOUT_S,
                        may_die={1})
    saved, seen = results[0]
    name, state = run_ranks(_load_newest, 2, root, timeout_s=300)[0]
    lost = f"nothing: {name} (the save before) loads, {'equal to' if _same(saved, state) else 'DIFFERENT from'} its step's state"
    saw, seconds = _summary([seen])
    return Row(fault, saw, seconds, lost)


def _flip_and_load(rank, world, root):
    pm, opt, batch = _module(rank, world)
    _step(pm, opt, batch)
    pm.save_checkpoint(root, opt)
    dist.barrier()
    directory = Path(latest_checkpoint(root))
    if rank == 0:
        shard = directory / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    dist.barrier()
    before = pm.state_dict()
    seen = _caught(lambda: pm.load_checkpoint(root, opt))
    return seen, _same(before, pm.state_dict())


def _craft_and_load(rank, world, root, marker):
    pm, opt, batch = _module(rank, world)
    pm.save_checkpoint(root, opt)
    dist.barrier()
    directory = Path(latest_checkpoint(root))
    if rank == 0:
        (directory / "autopar-manifest.json").unlink()
        (directory / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    dist.barrier()
    return _caught(lambda: pm.load_checkpoint(root, opt))


class _Touch:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _resume_after_kill(rank, world, argv, killed_at_save):
    """examples/train.py; rank 1 killed as its `killed_at_save`-th save starts. The time to error runs from the
    start of the last save rank 0 began."""
    save, started = autopar.codegen.module.ParallelModule.save_checkpoint, []

    def save_or_die(self, *args, **kwargs):
        started.append(time.monotonic())
        if rank == 1 and len(started) == killed_at_save:
            _die()
        return save(self, *args, **kwargs)
    autopar.codegen.module.ParallelModule.save_checkpoint = save_or_die
    losses: list[float] = []
    try:
        losses.extend(TRAIN.train(TRAIN.parse_args(argv)))
    except Exception as err:  # noqa: BLE001 -- what the user sees is the measurement
        return losses, (type(err).__name__, _opening(str(err)), time.monotonic() - started[-1])
    return losses, None


def _train_py_row(tmp: Path) -> Row:
    argv = TRAIN_ARGV + ["--steps", "9", "--checkpoint-every", "3", "--checkpoint", str(tmp / "train")]
    straight = run_ranks(_resume_after_kill, 2, TRAIN_ARGV + ["--steps", "9"], 0, timeout_s=300)[0][0]
    first = run_ranks(_resume_after_kill, 2, argv, 2, timeout_s=300, group_timeout_s=GROUP_TIMEOUT_S, may_die={1})
    _, seen = first[0]
    resumed, _ = run_ranks(_resume_after_kill, 2, argv, 0, timeout_s=300)[0]
    same = resumed == straight[9 - len(resumed):]
    saw, seconds = _summary([seen])
    return Row("examples/train.py --checkpoint-every 3: rank 1 SIGKILLed as the step-6 save starts", saw, seconds,
               f"steps 3-5 trained again: the resumed run starts at step {9 - len(resumed)}, its losses "
               f"{'equal to' if same else 'DIFFERENT from'} an uninterrupted run's (bit for bit)")


# ------------------------------------------------------------------ planning, calls, steps
def _infeasible_then_retry(rank, world):
    model, batch = _gpt2()
    seen = _caught(lambda: autopar.parallelize(model, batch, (world,), memory_budget=1e3, time_limit_s=10))
    pm = autopar.parallelize(model, batch, (world,))
    return seen, plan_to_json(pm.plan)


def _state_dict_on_rank0(rank, world):
    pm, opt, batch = _module(rank, world)
    _step(pm, opt, batch)
    start = time.monotonic()
    if rank == 0:
        return _caught(pm.state_dict, start)
    return _caught(lambda: [_step(pm, opt, batch) for _ in range(3)], start)


def _different_calls(rank, world, root):
    pm, opt, batch = _module(rank, world)
    _step(pm, opt, batch)
    return _caught(pm.state_dict if rank == 0 else (lambda: pm.save_checkpoint(root, opt)))


def _lose_peer(rank, world, how):
    pm, opt, batch = _module(rank, world)
    _step(pm, opt, batch)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        os.kill(os.getpid(), how)
        time.sleep(GROUP_TIMEOUT_S * 3)
    seen = _caught(lambda: _step(pm, opt, batch))
    if how == signal.SIGSTOP:
        os.kill(pids[1], signal.SIGKILL)
    return seen


def _drift(rank, world, root):
    pm, opt, batch = _module(rank, world)
    if rank == 1:
        def scale(optimizer, args, kwargs):
            next(pm.parameters()).grad.mul_(1.01)
        opt.register_step_pre_hook(scale)
    start = time.monotonic()
    seen = _caught(lambda: [_step(pm, opt, batch) for _ in range(pm.drift_check_every + 1)], start)
    saved = _caught(lambda: pm.save_checkpoint(root, opt))
    return seen, saved is not None and latest_checkpoint(root) is None


def _lengths(rank, world):
    pm, opt, _ = _module(rank, world)
    _, batch = _gpt2()
    length = 16 if rank == 0 else 12
    mine = {k: v[2 * rank:2 * rank + 2, :length] for k, v in batch.items()}
    return _caught(lambda: _step(pm, opt, mine))


def _sigterm_in_wait(rank, world):
    pm, opt, batch = _module(rank, world)
    _step(pm, opt, batch)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    sent = dist.distributed_c10d._get_default_store()
    if rank == 1:
        time.sleep(1.0)  # rank 0 is in the wait by now
        sent.set("sigterm-sent", repr(time.time()))  # wall clock: both ranks run on this host
        os.kill(pids[0], signal.SIGTERM)
        return None

    def on_term(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    signal.signal(signal.SIGTERM, on_term)
    try:
        pm.state_dict()
    except KeyboardInterrupt:
        raised = time.time()
        return "KeyboardInterrupt", "raised by the SIGTERM handler inside the wait", raised - float(sent.get("sigterm-sent"))
    return None


def _rows(only: set[str] | None, tmp: Path) -> list[Row]:
    rows: list[Row] = []

    def want(name: str) -> bool:
        return only is None or name in only

    if want("train-py-resume"):
        rows.append(_train_py_row(tmp))
    for name, phase, background, fault in (
            ("kill-before-save", "before", False, "rank 1 SIGKILLed just before save_checkpoint"),
            ("kill-during-save", "during", False, "rank 1 SIGKILLed while writing its shards (synchronous save)"),
            ("kill-during-background-save", "during", True, "rank 1 SIGKILLed while writing its shards (background save)")):
        if want(name):
            rows.append(_checkpoint_row(fault, phase, background, tmp))
    if want("flipped-byte"):
        seen, untouched = run_ranks(_flip_and_load, 2, str(tmp / "flip"), timeout_s=300)[0]
        saw, seconds = _summary([seen])
        rows.append(Row("one bit flipped in rank 1's shard file, then load_checkpoint", saw, seconds,
                        "nothing: the module is " + ("untouched" if untouched else "CHANGED")))
    if want("crafted-metadata"):
        marker = tmp / "ran"
        seen = run_ranks(_craft_and_load, 2, str(tmp / "craft"), str(marker), timeout_s=300)[0]
        saw, seconds = _summary([seen])
        rows.append(Row("a checkpoint's .metadata replaced by a pickle that runs code (manifest removed)", saw, seconds,
                        "nothing ran" if not marker.exists() else "THE PAYLOAD RAN"))
    if want("infeasible"):
        results = run_ranks(_infeasible_then_retry, 2, timeout_s=300)
        saw, seconds = _summary([seen for seen, _ in results])
        rows.append(Row("parallelize(memory_budget=1 KB) on every rank, caught, then retried without a budget", saw,
                        seconds, "nothing: both ranks raised the same error, and the retry gave them one plan"
                        if results[0][1] == results[1][1] else "the retries' plans DIFFER"))
    if want("state-dict-on-rank-0"):
        saw, seconds = _summary(run_ranks(_state_dict_on_rank0, 2, timeout_s=300, group_timeout_s=GROUP_TIMEOUT_S))
        rows.append(Row("pm.state_dict() on rank 0 alone (a DDP habit), rank 1 trains on", saw, seconds, "nothing"))
    if want("different-calls"):
        saw, seconds = _summary(run_ranks(_different_calls, 2, str(tmp / "calls"), timeout_s=300))
        rows.append(Row("rank 0 pm.state_dict(), rank 1 pm.save_checkpoint() at once", saw, seconds, "nothing"))
    for name, how, fault in (("dead-peer", signal.SIGKILL, "rank 1 SIGKILLed between steps; rank 0 steps"),
                             ("stopped-peer", signal.SIGSTOP, "rank 1 SIGSTOPped between steps; rank 0 steps")):
        if want(name):
            results = run_ranks(_lose_peer, 2, how, timeout_s=300, group_timeout_s=GROUP_TIMEOUT_S, may_die={1})
            saw, seconds = _summary(results[:1])
            rows.append(Row(fault, saw, seconds, "the step in flight (its checkpoint before is intact)"))
    if want("drift"):
        seen, refused = run_ranks(_drift, 2, str(tmp / "drift"), timeout_s=300)[0]
        saw, seconds = _summary([seen])
        rows.append(Row("an optimizer hook scaling one gradient on rank 1 only", saw, seconds,
                        "nothing: the save after it refused, none written" if refused else "a MIXED checkpoint was saved"))
    if want("lengths"):
        saw, seconds = _summary(run_ranks(_lengths, 2, timeout_s=300))
        rows.append(Row("ranks fed 16 and 12 tokens in one step (the plan gathers the split position table)", saw,
                        seconds, "nothing: refused before any collective"))
    if want("sigterm"):
        seen = run_ranks(_sigterm_in_wait, 2, timeout_s=300)[0]
        saw, seconds = _summary([seen])
        rows.append(Row("SIGTERM (a Python handler installed) to rank 0 waiting in a checked call", saw, seconds,
                        "nothing: the handler ran in the wait"))
    if want("hostile-plan"):
        rows.append(_hostile_plan_row(tmp))
    if want("pickled-plan"):
        path = tmp / "plan.json"
        path.write_bytes(pickle.dumps({"a": 1}))
        saw, seconds = _summary([_caught(lambda: load_plan(path))])
        rows.append(Row("a pickle saved as plan.json, loaded", saw, seconds, "nothing: not unpickled"))
    if want("nan-budget"):
        model, batch = _gpt2()
        saw, seconds = _summary([_caught(lambda: autopar.parallelize(model, batch, (2,), memory_budget=math.nan))])
        rows.append(Row("parallelize(memory_budget=nan)", saw, seconds, "nothing"))
    return rows


def _hostile_plan_row(tmp: Path) -> Row:
    """`autopar explain` of a plan whose recorded model file would leave a file behind if imported."""
    marker, hostile = tmp / "explained", tmp / "hostile.py"
    hostile.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    plan_path = tmp / "hostile.json"
    with contextlib.redirect_stdout(io.StringIO()):
        cli_main(["plan", str(ROOT / "examples" / "mlp.py"), "--gpus", "2", "--hardware", "cpu", "--size", "tiny",
                  "--save", str(plan_path), "--json"])
        save_plan(replace(load_plan(plan_path), source=PlanSource(str(hostile), "", 8, None, "tiny", "adamw")), plan_path)
        start = time.monotonic()
        code = cli_main(["explain", str(plan_path), "layers.0.fc1", "--json"])
    return Row("autopar explain of a plan naming a model file that runs code", f"exit code {code}, alternatives not priced",
               time.monotonic() - start, "nothing ran" if not marker.exists() else "THE FILE RAN")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated fault names (default: all)")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="autopar-faults-") as tmp:
        rows = _rows(set(opts.only.split(",")) if opts.only else None, Path(tmp))
    print("| fault injected | what the user saw | time to error | what was lost |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        seconds = "-" if r.seconds is None else f"{r.seconds:.1f} s"
        print(f"| {r.fault} | {r.saw[:300]} | {seconds} | {r.lost} |")
    print(provenance_line("faults", ranks=2, group_timeout_s=GROUP_TIMEOUT_S,
                          rows=[{"fault": r.fault, "seconds": r.seconds} for r in rows]))


if __name__ == "__main__":
    main()
