"""The buffers a reshard holds, as the memory model counts them (`reshard_buffer_bytes`), against what the
runtime's collectives really allocate: every path between even specs on a 2x2 mesh, run forward and backward
for one rank under torch's fake process group on meta tensors, with a live-storage tracker."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.profiler.measure import FakeStorageTracker
from autopar.runtime import collectives as C
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.mesh import make_mesh
from autopar.solver.reshard import reshard_buffer_bytes, reshard_steps
from autopar.solver.reshard_types import CollectiveStep
from autopar.solver.spec import Spec

MESH = (2, 2)


def _run_step(x: torch.Tensor, step: CollectiveStep, pm: ProcessMesh, gather_rs: bool) -> torch.Tensor:
    """The runtime collective codegen emits for one step (`codegen.lower`), with its autograd backward."""
    g = pm.group_name(step.mesh_axis)
    if step.kind == "all_gather":
        return (C.all_gather_rs if gather_rs else C.all_gather)(x, step.src_dim, g)
    if step.kind == "reduce_scatter":
        return C.reduce_scatter(x, step.dst_dim, g)
    if step.kind == "all_reduce":
        return C.all_reduce(x, g)
    if step.kind == "all_to_all":
        return C.all_to_all(x, step.src_dim, step.dst_dim, g)
    if step.kind == "slice":
        return C.local_slice(x, step.dst_dim, g)
    assert step.kind == "partial", step
    return C.replicate_to_partial(x, g)


def _measured(steps, src: Spec, shape: tuple[int, ...], pm: ProcessMesh, gather_rs: bool) -> tuple[int, int]:
    """(forward, backward) peak bytes of running `steps` on a tensor of spec `src`, beyond what the step starts from: the input, and in backward the
    output and its gradient (held by the caller)."""
    x = torch.empty(src.local_shape(shape, MESH), device="meta", requires_grad=True)
    forward = FakeStorageTracker(already_live=[x])
    with forward:
        y = x
        for step in steps:
            y = _run_step(y, step, pm, gather_rs)
    grad = torch.empty_like(y)
    backward = FakeStorageTracker(already_live=[x, y, grad])
    with backward:
        y.backward(grad)
    nbytes = lambda *ts: sum(t.untyped_storage().nbytes() for t in ts)  # noqa: E731
    return forward.peak_bytes - nbytes(x), backward.peak_bytes - nbytes(x, y, grad)


def test_buffers_match_what_the_runtime_allocates():
    shape = (2, 4, 12)  # dim 0 is 1 on a rank when split: the layout copies become views there
    mesh = make_mesh(4, MESH, "h100")
    placements = ["R", "P", "S(0)", "S(1)", "S(2)"]
    specs = []
    for a, b in itertools.product(placements, placements):
        spec = Spec.parse(a + b)
        try:
            spec.local_shape(shape, MESH)
        except ValueError:
            continue  # not even
        specs.append(spec)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    checked = gathered_twice = 0
    try:
        pm = ProcessMesh(MESH)
        for src, dst in itertools.product(specs, specs):
            steps = reshard_steps(src, dst, shape, mesh)
            gathers = any(s.kind == "all_gather" for s in steps)
            runs = [_measured(steps, src, shape, pm, rs) for rs in ((False, True) if gathers else (False,))]
            want = max(max(f, b) for f, b in runs)
            got = reshard_buffer_bytes(src, dst, shape, 4, mesh)
            assert got == want, f"{src} -> {dst} {shape}: model {got:.0f} B, runtime {runs} (all_gather, all_gather_rs)"
            gathered_twice += gathers and sum(
                s.kind in ("all_gather", "all_to_all") for s in steps) > 1
            checked += 1
    finally:
        dist.destroy_process_group()
    assert checked > 200 and gathered_twice > 10  # chains of several steps are among them


def test_a_gather_then_exchange_holds_three_copies():
    """A hand count: gather S(0) over axis 0, then exchange axis 1 from dim 1 to dim 0 (bert's attention matrix
    in its tightest plan): the gathered copy, the received buffer and the output laid out along dim 1, each
    half of the tensor, alive together."""
    shape = (4, 8, 12)
    half = math.prod(shape) * 4 / 2
    mesh = make_mesh(4, MESH, "h100")
    steps = [str(s) for s in reshard_steps(Spec.parse("S(0)S(1)"), Spec.parse("RS(0)"), shape, mesh)]
    assert steps == ["all_gather[axis 0 from=0]", "all_to_all[axis 1 from=1 to=0]"]
    assert reshard_buffer_bytes(Spec.parse("S(0)S(1)"), Spec.parse("RS(0)"), shape, 4, mesh) == 3 * half
