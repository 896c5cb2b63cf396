"""One rank's training step run on fake tensors: the plan's real peak memory without the ranks or the data.

    python benchmarks/simulate_memory.py vs_baselines.json bert autopar#4 [--rank 0] [--top 20]

Reads a plan from a `vs_baselines.py` results file (its `plans`), builds the model's ParallelModule for
one rank of the plan's mesh under torch's fake process group (`FakeStore`: collectives return at once,
shapes only), and runs forward, backward and the optimizer step under `FakeTensorMode` with a storage
tracker. It prints the peak of live storage bytes, what backward keeps after forward, the plan's
prediction beside them, and the largest tensors live at the peak with the line of `gm.code` that
made each. This is how the memory model's under-counts of the tightest plans were found (design
notes). `tests/codegen/test_memory.py` checks it against the measured peaks of five plans (data
parallel, ZeRO, recompute, weights gathered at their use, with and without recompute): equal to 1%.

The fake process group is the default group of this process: run it in a process of its own, not
beside a real one.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "benchmarks":
    sys.path[0] = str(ROOT)  # run as a script: import `benchmarks._common` the way the package does

from autopar.api import parallelize  # noqa: E402
from autopar.profiler.measure import FakeStorageTracker, make_optimizer  # noqa: E402
from autopar.solver.plan import Plan  # noqa: E402
from autopar.solver.plan_io import plan_from_json  # noqa: E402
from benchmarks.baselines.bench import local_inputs  # noqa: E402


@dataclass(frozen=True)
class Live:
    nbytes: int
    phase: str  # forward / backward / optimizer
    op: str
    shape: tuple[int, ...]
    line: str  # the generated code's line that made it ('' in autograd's backward)


@dataclass(frozen=True)
class Simulated:
    peak_bytes: int
    static_bytes: int  # parameters, buffers, optimizer state and the local batch, alive between steps
    saved_bytes: int  # what the step holds when forward ends, beyond the static bytes
    at_peak: tuple[Live, ...]  # made during the step and alive at the peak, largest first


class _FakeStorageTracker(FakeStorageTracker):
    """Live storages of fake tensors, and where each was made."""

    def __init__(self, already_live) -> None:
        self.phase, self.op = "forward", ""
        self.made: dict[int, Live] = {}
        self.at_peak: list[Live] = []
        super().__init__(already_live)

    def _track(self, t: torch.Tensor, finalize: bool = True) -> None:
        key = self._key(t.untyped_storage())
        new = key not in self._live
        super()._track(t, finalize)
        if new and finalize:
            self.made[key] = Live(self._live[key], self.phase, self.op, tuple(t.shape), _generated_line())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op = str(func)
        before = self.peak_bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # only while the peak's tensors are all alive: an op that decomposes reaches its peak in an inner op,
        # whose scratch is gone when the outer op returns
        if self.peak_bytes > before and self.current_bytes == self.peak_bytes:
            self.at_peak = [self.made[k] for k in self._live if k in self.made]  # records now: addresses get reused
        return out


def _generated_line() -> str:
    """The line of a generated GraphModule (its file is '<eval_with_key>...') on the stack, if any."""
    for frame in reversed(traceback.extract_stack(limit=60)):
        if frame.filename.startswith("<eval_with_key>"):
            return (frame.line or "").strip()
    return ""


def simulate_step(model: torch.nn.Module, sample, plan: Plan, rank: int = 0, optimizer: str = "adamw") -> Simulated:
    """Peak memory of `rank`'s training step under `plan`, on fake tensors: the third step (optimizer state
    exists), grads set to None between steps as `vs_baselines.py` trains."""
    world = 1
    for n in plan.mesh.shape:
        world *= n
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        pm = parallelize(copy.deepcopy(model), sample, tuple(plan.mesh.shape), plan=plan, optimizer=optimizer)
        # this rank's rows copied, as vs_baselines feeds them: a slice of the global batch is a view that keeps
        # the whole batch's storage alive (counted as static, it added the other ranks' rows to the peak)
        args, kwargs = local_inputs(pm, sample)
        opt = make_optimizer(pm, optimizer, foreach=plan.mesh.optimizer_foreach)  # as the plan's devices step
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            for _ in range(2):
                pm(*args, **kwargs).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            state = [v for s in opt.state.values() for v in pytree.tree_leaves(s) if isinstance(v, torch.Tensor)]
            batch = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            # a real tensor (a parameter, the batch) enters each op as its memoized fake copy: count that copy
            static_tensors = [t if isinstance(t, FakeTensor) else fake.from_tensor(t)
                              for t in (*pm.parameters(), *pm.buffers(), *state, *batch)]
            tracker = _FakeStorageTracker(static_tensors)
            static = tracker.current_bytes
            with tracker:
                loss = pm(*args, **kwargs)
                saved = tracker.current_bytes - static
                tracker.phase = "backward"
                loss.backward()
                tracker.phase = "optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
        at_peak = sorted(tracker.at_peak, key=lambda live: -live.nbytes)
        return Simulated(tracker.peak_bytes, static, saved, tuple(at_peak))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a vs_baselines.py --out JSON file")
    parser.add_argument("model", help="a model in it: gpt2, llama, bert")
    parser.add_argument("plan", help="a plan key in it, e.g. autopar#4")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--top", type=int, default=20, help="how many live tensors at the peak to list")
    args = parser.parse_args(argv)
    from benchmarks._common import load_example

    results = json.loads(Path(args.results).read_text())
    entry = next((m for m in results["models"] if m["case"]["model"] == args.model), None)
    if entry is None or args.plan not in entry["plans"]:
        known = {m["case"]["model"]: sorted(m["plans"]) for m in results["models"]}
        raise SystemExit(f"no plan {args.plan!r} for model {args.model!r} in {args.results}; it has {known}")
    text = entry["plans"][args.plan]
    plan = plan_from_json(text if isinstance(text, str) else json.dumps(text))
    case = entry["case"]
    model, sample = load_example(case["model"]).build(case["batch"], case["seq"], size=case["size"], device="cpu")
    sim = simulate_step(model, sample, plan, args.rank, case.get("optimizer", "adamw"))
    mb = 1e6
    m = plan.memory
    print(f"{args.model} {args.plan} on {'x'.join(map(str, plan.mesh.shape))}, rank {args.rank}")
    print(f"  simulated: peak {sim.peak_bytes / mb:.3f} MB  static {sim.static_bytes / mb:.3f}  saved after forward {sim.saved_bytes / mb:.3f}")
    print(f"  predicted: total {m.total_bytes / mb:.3f} MB  params+grads+optimizer {(m.params_bytes + m.grads_bytes + m.optimizer_bytes) / mb:.3f}"
          f"  activations {m.activations_bytes / mb:.3f}  largest transient {m.temp_bytes / mb:.3f}")
    measured = entry.get("autopar_plans", {}).get(args.plan, {}).get("peak_bytes")
    if measured:
        print(f"  measured:  peak {measured / mb:.3f} MB (the benchmark's, max over ranks and steps)")
    print(f"  largest tensors made during the step and live at the peak:")
    for live in sim.at_peak[:args.top]:
        print(f"    {live.nbytes / 1024:8.1f} KB  {live.phase:9s} {live.op:40s} {str(live.shape):18s} {live.line[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
