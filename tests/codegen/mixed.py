"""Mixed-precision equivalence: a parallelized bf16 step against one device running the same recipe.

The reference is one device training as `autopar.MixedPrecision` does: float32 master parameters and AdamW
state; each step a bf16 copy of the masters (the policy's parameters: batch norm's stay float32) runs forward
and backward under `torch.autocast` (CPU, bf16: the casts the traced graph holds), and its gradients, cast to
float32, are the masters'. It never goes through autopar's tracer or codegen.

Distributed bf16 cannot match it bit for bit: ranks sum their rows' terms in another order, in other bf16
roundings. The tolerance is measured: the spread between two reference runs that differ only in the order
of their bf16 sums (`spread`: the batch's rows in another order, and every linear layer and convolution
summing its reduction dim as two bf16 partial sums, as a tensor-parallel split does). `SPREAD` holds the
zoo's, as `python -m tests.codegen.mixed` measures them; a parallel run's errors must be within
`TOLERANCE_FACTOR` times its model's (the loss, one number and so the noisiest, within that factor of the
zoo's largest loss spread).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import random
from typing import Any, Sequence

import torch

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autopar.api import traced_model
from autopar.mixed_precision import MixedPrecision
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.state_dict import gather_full
from autopar.tracer import TracedGraph
from tests.codegen.harness import EPS, LR, Reference, call, local_sample, loss_of, parallel_module, zoo_case

BF16 = MixedPrecision(torch.bfloat16, torch.float32)

# One training step's spread per zoo model (tiny, batch 4, seq 8; torch 2.13 on CPU): (loss, gradients), as
# `errors` measures them between `reference_mixed` and `spread`'s run. ResNet's BatchNorm over 16 elements a
# channel amplifies a bf16 rounding of its input: its gradients are the least reproducible.
SPREAD = {
    "mlp": (2.9e-4, 6.2e-3), "gpt2": (2.5e-5, 8.4e-3), "llama": (4.1e-5, 9.5e-3), "bert": (8.2e-5, 1.0e-2),
    "vit": (1.4e-4, 3.9e-2), "resnet": (5.5e-4, 2.4e-1), "hf_gpt2": (6.9e-6, 6.8e-3), "hf_llama": (5.5e-5, 1.0e-2),
}
# Measured over 24 data-parallel and 72 random plans (each model on (2,), (4,), (2, 2)), one step each: gradients
# within 1.4x their model's spread, the loss within 0.8x the largest loss spread.
TOLERANCE_FACTOR = 2.0
# AdamW's first step moves every element by LR times sign(gradient) (its gradient being far above eps): two runs
# differ by 2 LR where a gradient of rounding noise has the other sign, and by more only if a master was stepped
# wrongly. In units of LR (`param_error`).
PARAM_TOLERANCE = 2.0 + 1e-3


def tolerance(model: str) -> dict[str, float]:
    """The largest errors a one-step run of zoo `model` under the policy may have (`errors`' measures)."""
    return {"loss": TOLERANCE_FACTOR * max(loss for loss, _ in SPREAD.values()),
            "grad": TOLERANCE_FACTOR * SPREAD[model][1], "param": PARAM_TOLERANCE}


@functools.lru_cache(maxsize=None)
def mixed_zoo_case(name: str) -> tuple[torch.nn.Module, Any, TracedGraph, Reference]:
    """`harness.zoo_case`'s model and sample, traced under the bf16 policy, and its one-step reference."""
    model, sample, _, _ = zoo_case(name)
    return model, sample, trace_mixed(model, sample), reference_mixed(model, [sample])


def run_mixed_plans(rank: int, world: int, mesh_shape: tuple[int, ...], cases: Sequence[tuple]) -> list[tuple[str, dict]]:
    """Rank body: `cases` = (label, model, sample, traced, plan, ref) tuples trained one step under the bf16 policy."""
    mesh = ProcessMesh(mesh_shape)
    out = []
    for label, model, sample, traced, plan, ref in cases:
        torch.manual_seed(0)
        out.append((label, check_mixed(model, sample, traced, plan, ref, 1, mesh)))
    return out


def trace_mixed(model: torch.nn.Module, sample: Any, policy: MixedPrecision = BF16) -> TracedGraph:
    """`model` traced as `parallelize(..., mixed_precision=policy)` traces it."""
    return traced_model(model, sample, "cpu", mixed_precision=policy)


def reference_mixed(model: torch.nn.Module, samples: Sequence[Any], policy: MixedPrecision = BF16,
                    split_sums: bool = False) -> Reference:
    """One device's AdamW steps under `policy`'s recipe (module docstring), one per sample; `split_sums`: every
    linear layer and convolution summing its reduction dim as two bf16 partial sums (`SplitSums`)."""
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, eps=EPS)
    cast = policy.compute_dtypes(master)
    out = Reference([], [], [], [])
    for sample in samples:
        opt.zero_grad()
        compute = copy.deepcopy(master)
        for name in cast:
            p = compute.get_parameter(name)
            p.data = p.data.to(policy.param_dtype)  # (a tied parameter's second name finds it cast already)
        with policy.autocast(), (SplitSums() if split_sums else contextlib.nullcontext()):
            loss = loss_of(call(compute, copy.deepcopy(sample)))
        loss.backward()
        grads = {}
        for name, p in master.named_parameters():
            grad = compute.get_parameter(name).grad
            if grad is not None:
                p.grad = grads[name] = grad.float()
        with torch.no_grad():  # what forward wrote into the buffers (batch norm's running statistics)
            for name, b in master.named_buffers():
                b.copy_(compute.get_buffer(name))
        out.losses.append(loss.item())
        out.grads.append(grads)
        opt.step()
        out.params.append({n: p.detach().clone() for n, p in master.named_parameters()})
        out.buffers.append({n: b.clone() for n, b in master.named_buffers()})
    return out


class SplitSums(TorchFunctionMode):
    """`F.linear` and `F.conv2d` as the sum of two partial results over the halves of their reduction dim (input
    features, input channels), each rounded to bf16 before they are added: the same sums in another order, with the
    roundings a tensor-parallel split of that dim makes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.linear and args[0].shape[-1] >= 2:
            x, w, bias = args[0], args[1], args[2] if len(args) > 2 else kwargs.pop("bias", None)
            h = x.shape[-1] // 2
            y = F.linear(x[..., :h], w[:, :h]) + F.linear(x[..., h:], w[:, h:])
            return y if bias is None else y + bias
        if func is F.conv2d and args[1].shape[1] >= 2 and (args[6] if len(args) > 6 else kwargs.get("groups", 1)) == 1:
            x, w, bias, *rest = (*args, *([None] if len(args) < 3 else []))
            bias = kwargs.pop("bias", bias)
            h = w.shape[1] // 2
            y = F.conv2d(x[:, :h], w[:, :h], None, *rest, **kwargs) + F.conv2d(x[:, h:], w[:, h:], None, *rest, **kwargs)
            return y if bias is None else y + bias.view(1, -1, *[1] * (y.dim() - 2))
        return func(*args, **kwargs)


def reordered(sample: Any, seed: int) -> Any:
    """`sample` with the rows of its batch (dim 0 of every tensor of the batch's size) in another order: the same
    mean loss, its sums taken in another order."""
    tensors = [t for t in _leaves(sample) if isinstance(t, torch.Tensor) and t.dim()]
    batch = tensors[0].shape[0]
    order = list(range(batch))
    random.Random(seed).shuffle(order)
    index = torch.tensor(order)
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.index_select(0, index) if t.dim() and t.shape[0] == batch else t, sample)


def _leaves(sample: Any) -> list:
    return torch.utils._pytree.tree_leaves(sample)


def errors(got: Reference, want: Reference, steps: int) -> dict[str, float]:
    """The largest errors of `got` against `want` over `steps` steps: the loss relative to the reference's, each
    gradient relative to its size (`grad_error`), each parameter in units of AdamW's update (`param_error`)."""
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(steps):
        worst["loss"] = max(worst["loss"], abs(got.losses[step] - want.losses[step]) / abs(want.losses[step]))
        floor = grad_floor(want.grads[step])
        for name, w in want.grads[step].items():
            worst["grad"] = max(worst["grad"], grad_error(got.grads[step][name], w, floor))
        for name, w in want.params[step].items():
            worst["param"] = max(worst["param"], param_error(got.params[step][name], w, step + 1))
    return worst


def grad_floor(grads: dict[str, torch.Tensor]) -> float:
    """1% of the step's largest gradient norm: the size below which a gradient is rounding noise (ViT's and BERT's
    key biases, which softmax makes zero in exact arithmetic, get gradients of rounding errors alone)."""
    return 1e-2 * max(g.norm().item() for g in grads.values())


def grad_error(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    """|got - want| / |want| (L2 norms; `floor` where |want| is smaller): an average over the tensor's entries, which
    a few entries that are sums of cancelling terms do not dominate as they do the largest entry's error."""
    return (got.float() - want.float()).norm().item() / max(want.norm().item(), floor)


def param_error(got: torch.Tensor, want: torch.Tensor, steps: int) -> float:
    """max |got - want| in units of `steps` AdamW updates of LR each. AdamW moves an element about LR a step whatever
    its gradient's size: where the gradient is rounding noise (a zero-initialised bias) two runs may move it LR in
    opposite directions, so about 2 is the most bf16 noise gives; a master stepped wrongly is off by far more."""
    return (got.float() - want.float()).abs().max().item() / (LR * steps)


def spread(model: torch.nn.Module, sample: Any, ref: Reference, steps: int, policy: MixedPrecision = BF16) -> dict[str, float]:
    """How far a one-device run of the recipe lands from `ref` (the run on `sample`) when only the order of its bf16
    sums differs: the batch's rows in another order, and each linear layer's and convolution's sum in two halves."""
    return errors(reference_mixed(model, [reordered(sample, 1)] * steps, policy, split_sums=True), ref, steps)


def check_mixed(model: torch.nn.Module, sample: Any, traced: TracedGraph, plan, ref: Reference, steps: int,
                mesh: ProcessMesh, policy: MixedPrecision = BF16) -> dict[str, float]:
    """Train `steps` AdamW steps under `plan` and `policy`: the largest errors against `ref` (`errors`), of the full
    gradients and parameters (gathered on every rank), which must be float32."""
    pm = parallel_module(model, sample, traced, plan, mesh, mixed_precision=policy)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    args, kwargs = local_sample(sample, pm)
    got = Reference([], [], [], [])
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(pm(*args, **kwargs))
        loss.backward()
        for fqn, p in pm.named_parameters():
            assert p.dtype == p.grad.dtype == torch.float32, f"{fqn}: {p.dtype} parameter with a {p.grad.dtype} gradient"
        got.losses.append(loss.item())
        got.grads.append({fqn: gather_full(p.grad, pm.info.param_storage[fqn], mesh) for fqn, p in pm.named_parameters()})
        opt.step()
        got.params.append({fqn: gather_full(p, pm.info.param_storage[fqn], mesh) for fqn, p in pm.named_parameters()})
    return errors(got, ref, steps)


if __name__ == "__main__":  # the measurement behind SPREAD
    from tests.zoo import ZOO, load_zoo

    for name in ZOO:
        model, sample = load_zoo(name).build(batch_size=4, seq_len=8, size="tiny", device="cpu")
        measured = spread(model, sample, reference_mixed(model, [sample]), 1)
        print(f"{name}: loss {measured['loss']:.2g}, grad {measured['grad']:.2g}")
