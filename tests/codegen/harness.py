"""Equivalence harness: a parallelized model vs the single-device model, step by step.

The parent traces the model and computes the single-device reference (losses,
gradients and parameters after each AdamW step); every forked rank then loops
over the plans, lowers each one, trains the same steps on its slice of the
batch and compares gathered gradients and parameters with the reference.
"""
from __future__ import annotations

import copy
import functools
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from autopar.api import make_retracer, trace_copy
from autopar.codegen import ParallelModule, lower
from autopar.codegen.module import Retracer
from autopar.codegen.shapes import local_block
from autopar.mixed_precision import MixedPrecision
from autopar.runtime.batch import batch_slice
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.plan import Plan
from autopar.solver.strategies import enumerate_strategies
from autopar.tracer import TracedGraph, split_sample_input
from autopar.tracer.closures import deep_copy
from tests.codegen.plans import cpu_mesh, greedy_plan, load_zoo, random_plan

LR = 1e-3
# Some gradients are exactly zero in exact arithmetic (ViT's key bias: softmax ignores it) and fp noise
# (~1e-9) in practice; with the default eps=1e-8 AdamW turns noise into steps of ~LR in either direction.
# eps=1e-6 keeps noise-driven steps ~1000x smaller while real gradients (>1e-4) step as usual.
EPS = 1e-6


@dataclass
class Reference:
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]  # per step, by FQN
    params: list[dict[str, torch.Tensor]]  # after each step
    buffers: list[dict[str, torch.Tensor]]  # after each step (BatchNorm's running statistics)
    requires_grad: list[dict[str, bool]] = field(default_factory=list)  # per step, by FQN, as the model had them


def loss_of(out: Any) -> torch.Tensor:
    """The loss a model returns: alone, first of a tuple (`(loss, logits)`), or as a Hugging Face output's `.loss`."""
    if isinstance(out, tuple):
        return out[0]
    return out if isinstance(out, torch.Tensor) else out.loss


def call(model: torch.nn.Module, sample: Any) -> Any:
    args, kwargs = split_sample_input(sample)
    return model(*args, **kwargs)


def trace_model(model: torch.nn.Module, sample: Any) -> TracedGraph:
    return trace_copy(model, sample, "cpu")


@functools.lru_cache(maxsize=None)
def zoo_case(name: str) -> tuple[torch.nn.Module, Any, TracedGraph, Reference]:
    """A zoo model at the smallest batch every test mesh splits, its sample, its trace and its reference over 3
    steps (the first steps of it are those of fewer). Once per process: the random-plan and the solver-plan tests,
    which xdist runs on one worker (their `xdist_group`), share it."""
    model, sample = load_zoo(name).build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    return model, sample, trace_model(model, sample), reference(model, sample, 3)


def reference(model: torch.nn.Module, sample: Any, steps: int) -> Reference:
    return reference_steps(model, [sample] * steps)


def reference_steps(model: torch.nn.Module, samples: Sequence[Any], before_step: Callable[[torch.nn.Module, int], None] | None = None) -> Reference:
    """One device's AdamW steps, one per sample (their shapes may differ); `before_step(model, step)` first."""
    ref = deep_copy(model)  # (a lambda stored on the model trains the copy's weights, as the model's own)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    out = Reference([], [], [], [], [])
    for step, sample in enumerate(samples):
        if before_step:
            before_step(ref, step)
        opt.zero_grad()
        loss = loss_of(call(ref, copy.deepcopy(sample)))  # a forward may change its inputs: the test's stay as they are
        loss.backward()
        out.losses.append(loss.item())
        out.grads.append({n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})  # none when frozen
        out.requires_grad.append({n: p.requires_grad for n, p in ref.named_parameters()})
        opt.step()
        out.params.append({n: p.detach().clone() for n, p in ref.named_parameters()})
        out.buffers.append({n: b.clone() for n, b in ref.named_buffers()})
    return out


def local_sample(sample: Any, pm: ParallelModule) -> Any:
    """(args, kwargs) this rank feeds: its contiguous slice of the global batch in rank order, whatever the plan
    (along the batch dims the module was traced with: dim 0 unless `batch_dim` said otherwise)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return split_sample_input(batch_slice(sample, rank, world, pm._traced.batch_dim))


def train(pm: ParallelModule, sample: Any, steps: int) -> list[float]:
    """`steps` AdamW steps of `pm` on this rank's slice of `sample`, as `reference` trains one device: the losses."""
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    args, kwargs = local_sample(sample, pm)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(pm(*args, **kwargs))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def retracer(model: torch.nn.Module, sample: Any, mixed_precision: MixedPrecision | None = None) -> Retracer:
    """What `parallelize` gives a `ParallelModule` to trace `model` again for inputs of other shapes."""
    return make_retracer(model, sample, "cpu", mixed_precision=mixed_precision)


def check_plan(model: torch.nn.Module, sample: Any, traced: TracedGraph, plan: Plan, ref: Reference, steps: int,
               mesh: ProcessMesh, label: str, samples: Sequence[Any] | None = None,
               before_step: Callable[[torch.nn.Module, int], None] | None = None) -> dict[str, float]:
    """Train `steps` steps under `plan`; raise AssertionError naming the first mismatch; return the max errors.
    samples: one per step (shapes may differ from `sample`, the one traced), else `sample` at every step.
    before_step(module, step): called first at each step (as `reference_steps` calls it)."""
    t0 = time.perf_counter()
    pm = parallel_module(model, sample, traced, plan, mesh, retrace=bool(samples or before_step))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    lower_s = time.perf_counter() - t0
    return {**check_steps(pm, opt, ref, range(steps), label, samples or [sample] * steps, before_step), "lower_s": lower_s}


def parallel_module(model: torch.nn.Module, sample: Any, traced: TracedGraph, plan: Plan, mesh: ProcessMesh,
                    retrace: bool = False, mixed_precision: MixedPrecision | None = None) -> ParallelModule:
    """`model` under `plan` on this rank (its parameters' values; retrace: able to take other inputs), `traced` under
    `mixed_precision` if given (`tests.codegen.mixed.trace_mixed`)."""
    gm = lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False)),
               buffers=dict(model.named_buffers()), reduce_dtype=mixed_precision and mixed_precision.reduce_dtype)
    return ParallelModule(gm, traced, mesh, plan, retracer(model, sample, mixed_precision) if retrace else None,
                          mixed_precision)


def check_steps(pm: ParallelModule, opt: torch.optim.Optimizer, ref: Reference, steps: Sequence[int], label: str,
                samples: Sequence[Any], before_step: Callable[[torch.nn.Module, int], None] | None = None) -> dict[str, float]:
    """Train `pm` with `opt` for the reference's `steps` (numbers: training may resume mid-way), one sample
    each; raise AssertionError naming the first mismatch with `ref`; return the max errors."""
    mesh = pm.mesh
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    missing = sorted(set(ref.params[0]) - set(pm.info.param_storage))
    assert not missing, f"{label}: the parallel module holds no {missing[:5]}, parameters of the model"
    for step, sample in zip(steps, samples, strict=True):
        if before_step:
            before_step(pm, step)
        args, kwargs = local_sample(sample, pm)
        opt.zero_grad()
        loss = loss_of(pm(*args, **kwargs))
        loss.backward()
        rel = abs(loss.item() - ref.losses[step]) / max(abs(ref.losses[step]), 1e-12)
        worst["loss"] = max(worst["loss"], rel)
        assert rel < 1e-5, f"{label}: step {step} loss {loss.item()} vs reference {ref.losses[step]}"
        # each rank checks its own block of every gradient and parameter: together the blocks cover
        # the full tensors, without a gather per check (the gathered path is tested in test_parallelize)
        storage = pm.info.param_storage
        for fqn, p in pm.named_parameters():
            if fqn not in ref.grads[step]:  # frozen in the model, or read by no op of this forward: no gradient
                assert p.grad is None, f"{label}: step {step}: {fqn} got a gradient, where one device gets none"
                assert p.requires_grad == ref.requires_grad[step][fqn], f"{label}: {fqn} requires_grad={p.requires_grad}, not as in the model"
                continue
            if p.grad is None:
                raise AssertionError(f"{label}: {fqn} got no gradient")
            want = local_block(ref.grads[step][fqn], storage[fqn], mesh.shape, mesh.coordinate)
            worst["grad"] = max(worst["grad"], _compare(p.grad, want, 1e-5, f"{label}: step {step} grad of {fqn}"))
        opt.step()
        for fqn, p in pm.named_parameters():
            want = local_block(ref.params[step][fqn], storage[fqn], mesh.shape, mesh.coordinate)
            worst["param"] = max(worst["param"], _compare(p.detach(), want, 1e-5, f"{label}: step {step} param {fqn}"))
        for fqn, b in pm.named_buffers():  # updated in forward: running statistics of the GLOBAL batch
            if fqn not in ref.buffers[step] and fqn in pm.info.unsaved:
                continue  # a constant the trace lifted (`labels[mask] = -100`'s scalar), not a buffer of the model's
            want = local_block(ref.buffers[step][fqn], pm.info.buffer_specs[fqn], mesh.shape, mesh.coordinate)
            _compare(b.float(), want.float(), 1e-5, f"{label}: step {step} buffer {fqn}")
    return worst


def _compare(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> float:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}")
    return (got - want).abs().max().item()


def load_on_one_device(model: torch.nn.Module, checkpoint: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A copy of `model` and its AdamW, loaded from a DCP checkpoint with torch alone: the checkpoint's keys
    are torch's `get_state_dict` layout, whatever plan or pipeline saved it."""
    fresh = copy.deepcopy(model)
    opt = torch.optim.AdamW(fresh.parameters(), lr=LR, eps=EPS)
    state = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, opt)}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    fresh.load_state_dict(state["model"])
    set_optimizer_state_dict(fresh, opt, state["optim"])
    return fresh, opt


def train_on_one_device(model: torch.nn.Module, opt: torch.optim.Optimizer, sample: Any, ref: Reference,
                        steps: range, atol: float) -> None:
    """Train `model` eagerly for the reference's `steps`, asserting each loss and the final parameters."""
    for step in steps:
        opt.zero_grad()
        loss = loss_of(call(model, sample))
        loss.backward()
        opt.step()
        assert abs(loss.item() - ref.losses[step]) <= 1e-5 * abs(ref.losses[step]), step
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref.params[steps[-1]][fqn], rtol=1e-4, atol=atol, msg=lambda m: f"{fqn}: {m}")


def run_plans(rank: int, world: int, mesh_shape: tuple[int, ...], cases: Sequence[tuple]) -> list[tuple[str, dict]]:
    """Rank body: `cases` = (label, model, sample, traced, plan, ref, steps) tuples, checked in order."""
    mesh = ProcessMesh(mesh_shape)
    results = []
    for label, model, sample, traced, plan, ref, steps in cases:
        torch.manual_seed(0)
        start = time.perf_counter()
        worst = check_plan(model, sample, traced, plan, ref, steps, mesh, label)
        worst["seconds"] = time.perf_counter() - start
        results.append((label, worst))
    return results


def random_plan_cases(model: torch.nn.Module, sample: Any, traced: TracedGraph, mesh_shape: tuple[int, ...], count: int,
                      seed: int) -> list[tuple]:
    """`count` random plans of `traced` on `mesh_shape` as `run_plans` cases, one AdamW step each."""
    mesh, rng = cpu_mesh(mesh_shape), random.Random(seed)
    strategies, ref = enumerate_strategies(traced, mesh), reference(model, sample, 1)
    return [(f"plan {i} on {mesh_shape}", model, sample, traced, random_plan(traced, mesh, rng, strategies), ref, 1)
            for i in range(count)]


def check_cases(mesh_shape: tuple[int, ...], cases: Sequence[tuple]) -> None:
    """Train every case on its own world of `mesh_shape`'s ranks; each must match one device (see `check_plan`)."""
    for rank_results in run_ranks(run_plans, math.prod(mesh_shape), mesh_shape, cases, timeout_s=220):
        assert [label for label, _ in rank_results] == [c[0] for c in cases]


class Classifier(torch.nn.Module):
    """Two linear layers and a cross-entropy loss: the small model of the runtime's multi-rank checks."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


def classifier_case():
    """(model, sample, traced, data_parallel, split_weight, tensor_parallel) on 2 ranks: fc1's weight stored
    split and gathered where used, or split with the batch gathered (a plan that exchanges activations)."""
    torch.manual_seed(0)
    model = Classifier()
    sample = (torch.randn(8, 8), torch.randint(0, 4, (8,)))
    traced = trace_model(model, sample)
    mesh = cpu_mesh((2,))
    batch_split = {n: "S(0)" for n in traced.input_names}
    data_parallel = greedy_plan(traced, mesh, batch_split)
    split_weight = greedy_plan(traced, mesh, {**batch_split, "p_fc1_weight": "S(0)"})
    tensor_parallel = greedy_plan(traced, mesh, {"p_fc1_weight": "S(0)"})
    return model, sample, traced, data_parallel, split_weight, tensor_parallel


def step(pm: ParallelModule, opt: torch.optim.Optimizer, sample: Any) -> None:
    """One training step of `pm` on this rank's slice of `sample` (a model returning its loss)."""
    args, kwargs = local_sample(sample, pm)
    opt.zero_grad()
    pm(*args, **kwargs).backward()
    opt.step()


class LogRecords(logging.Handler):
    """The messages logged to `logger_name` while attached (a forked rank's logs, returned to the test)."""

    def __init__(self, logger_name: str):
        super().__init__()
        self.messages: list[str] = []
        logging.getLogger(logger_name).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
