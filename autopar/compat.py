"""The differences between the torch releases autopar supports (2.11 through 2.13), each handled here once.

    from autopar.compat import all_gather_single
    check_torch()   # AutoparError on a torch outside SUPPORTED_TORCH, naming the release and the range
    check_triton(triton.__version__)   # the same for Triton and SUPPORTED_TRITON

Every name below says which release it concerns. Code elsewhere imports the name from here and never
asks for torch's version itself, so that dropping a release is deleting its lines in this file.
`benchmarks/compat.sh` runs a subset of the suite on the oldest supported release.
"""
from __future__ import annotations

import functools
import re

import torch
import torch.distributed as dist

from autopar.errors import AutoparError

# (major, minor) of the oldest and newest torch and Triton releases the suite is run on (the newest in CI, the oldest
# by benchmarks/compat.sh); pyproject.toml declares the same
SUPPORTED_TORCH = ((2, 11), (2, 13))
SUPPORTED_TRITON = ((3, 6), (3, 9))


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.11.0+cu130" -> (2, 11)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise AutoparError(f"cannot read a release from the version string {version!r}")
    return int(match.group(1)), int(match.group(2))


TORCH_RELEASE = release(torch.__version__)

# torch 2.11: torch.distributed.pipelining's ScheduleInterleavedZeroBubble gives a weight tied across stages (GPT-2's
# embedding and LM head) a wrong gradient on 2 pp x 2 dp gloo ranks (tests/pipeline/test_train.py under
# benchmarks/compat.sh); 2.13 gives one device's. The pipeline search leaves that schedule out before 2.13.
ZERO_BUBBLE_EXACT = TORCH_RELEASE >= (2, 13)


def check_torch(version: str = torch.__version__) -> None:
    """Raise, naming the release and the supported range, when `version` is outside `SUPPORTED_TORCH`."""
    _check_release("torch", version, SUPPORTED_TORCH)


def check_triton(version: str) -> None:
    """Raise, naming the release and the supported range, when Triton's `version` is outside `SUPPORTED_TRITON`."""
    _check_release("triton", version, SUPPORTED_TRITON)


def _check_release(package: str, version: str, supported: tuple[tuple[int, int], tuple[int, int]]) -> None:
    low, high = supported
    if not low <= release(version) <= high:
        raise AutoparError(f"{package} {version} is outside the releases autopar supports, {low[0]}.{low[1]} through "
                           f"{high[0]}.{high[1]}: install one of those (pip install '{package}>={low[0]}.{low[1]},"
                           f"<{high[0]}.{high[1] + 1}')")


# The words of fake tensor's refusal of an op on tensors of two devices (a real tensor the traced forward reaches past
# the model's copy), which the tracer turns into its own error: torch 2.11 raises a RuntimeError "Unhandled
# FakeTensor Device Propagation for aten.mm.default, found two different devices meta, cpu"; torch 2.13 a
# FakeTensorDeviceMismatchError "Expected all tensors to be on the same device, but found at least two devices,
# meta and cpu!".
FAKE_DEVICE_MISMATCH = ("found two different devices",  # torch 2.11
                        "found at least two devices")  # torch 2.13


# torch 2.13 renamed the single-tensor collectives (`all_gather_into_tensor` -> `all_gather_single`,
# `reduce_scatter_tensor` -> `reduce_scatter_single`) and deprecated the old names; 2.11 has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@functools.cache
def settle_autograd_engine() -> None:
    """Start autograd's engine with a backward on a plain CPU tensor, before any on fake tensors (`import
    autopar` does, first).

    torch 2.11 and 2.12: the engine sets up its device threads at a process's first backward, and a first one on
    fake tensors (the profiler's probes) counts a device; the engine then marks every process forked later
    as unable to run any backward ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"), so `run_ranks` after planning in the same process failed. Set up by a CPU backward, on a
    host with no GPU, it counts none, and later backwards on fake tensors leave it so. (2.13 counts none either
    way.) Where GPUs are visible the engine counts them whatever runs first: ranks forked after a backward fail
    there on every release, which is why `run_ranks` spawns on a parent that has used CUDA."""
    if TORCH_RELEASE < (2, 13) and torch.cuda.device_count() == 0:
        x = torch.zeros((), requires_grad=True)
        torch.autograd.grad(x * 1.0, x)
