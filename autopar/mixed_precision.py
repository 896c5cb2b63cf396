"""The mixed-precision policy: compute in bf16 (or fp16) on float32 master parameters.

    pm = autopar.parallelize(model, batch, (8,), mixed_precision=autopar.MixedPrecision(torch.bfloat16))

The recipe is FSDP2's `MixedPrecisionPolicy` together with `torch.autocast`'s op lists:

- the parameters, their gradients and the optimizer's state stay in float32 (the master weights, what
  `pm.parameters()` holds); forward and backward compute on `param_dtype` copies of them, made once per step
  (`runtime.compute_copies`), and a ZeRO-sharded parameter is all-gathered in `param_dtype`;
- the model is traced with its parameters in `param_dtype` and under `torch.autocast(dtype=param_dtype)`,
  so the graph casts where autocast does: matmuls and convolutions take `param_dtype` operands (a float32
  input meeting a bf16 weight is cast), and the ops of autocast's float32 list (the losses: cross-entropy
  with its log-softmax, nll, mse, ...) run in float32;
- gradients are summed over ranks in `reduce_dtype` and land in the float32 `.grad` of the masters.

The graph is traced on fake CPU tensors under CPU autocast whatever the devices the plan runs on, so a plan
made ahead (`autopar plan --precision bf16`) matches the graph `parallelize` traces on any machine. Left in
their dtype: batch norm's parameters (cuDNN and the CPU kernel take bf16 activations with float32 affine
parameters and statistics, as FSDP1's policy keeps them), frozen parameters and parameters of other dtypes
than floating point.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

_COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecision:
    """Which dtype forward and backward compute in, and which dtype gradients are summed over ranks in.

    param_dtype: torch.bfloat16 (or torch.float16, with `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`
      scaling the loss, as fp16's range needs).
    reduce_dtype: torch.float32 (exact sums of the ranks' bf16 gradients) or the compute dtype (half the traffic)."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.param_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"MixedPrecision(param_dtype={self.param_dtype}): the compute dtype must be torch.bfloat16 "
                             "or torch.float16; for float32 training leave mixed_precision out")
        if self.reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(f"MixedPrecision(reduce_dtype={self.reduce_dtype}): gradients are summed in torch.float32, "
                             "torch.bfloat16 or torch.float16")

    def compute_dtypes(self, model: nn.Module) -> dict[str, torch.dtype]:
        """{FQN: param_dtype} of the parameters computed on copies (every name of a tied one); the others keep theirs."""
        norms = {id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()}
        return {name: self.param_dtype for name, p in model.named_parameters(remove_duplicate=False)
                if p.is_floating_point() and p.requires_grad and id(p) not in norms and p.dtype != self.param_dtype}

    def masters(self, model: nn.Module) -> dict[str, torch.dtype]:
        """{FQN: dtype} of the masters of the parameters computed on copies (what the profiler prices them at)."""
        return {name: model.get_parameter(name).dtype for name in self.compute_dtypes(model)}

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The autocast a model is traced under (on fake CPU tensors: see the module docstring)."""
        with torch.autocast("cpu", dtype=self.param_dtype):
            yield

    def describe(self) -> str:
        return f"{_name(self.param_dtype)} compute on float32 masters, gradients summed in {_name(self.reduce_dtype)}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# `autopar plan --precision`: what each name trains as (None: no policy, float32 parameters), and the
# math mode its float32 matmuls are priced at (`solver.mesh.Precision`)
POLICIES: dict[str, MixedPrecision | None] = {"fp32": None, "tf32": None, "bf16": MixedPrecision(torch.bfloat16)}
