"""Which aten kernels on CPU need contiguous inputs: the list `autopar/codegen/kernel_layouts.py` covers.

    pip install expecttest          # torch's OpInfo database (torch.testing._internal) imports it
    python benchmarks/contiguous_kernels.py

Every sample of torch's OpInfo database (forward, and backward where it takes gradients) runs
under a dispatch mode that records the aten calls it makes; each recorded call runs again with each
of its contiguous tensor inputs laid out otherwise, same values: with gaps between elements (every
other element of a buffer twice as long) and with its dims stored in reverse order. A call that
then raises, or returns other values, is listed. Listed calls a traced forward cannot hold are
marked and left to eager's own handling: in-place and `out=` variants, random ops (a rerun draws
other numbers), backward kernels (autograd feeds them as eager does), and the `as_strided` family
and views, whose results depend on strides by definition (a traced `view` is lowered as `reshape`).
The others must be in `KERNEL_LAYOUTS`; the script exits 1 naming any that is not. Takes about a
minute on one core.
"""
from __future__ import annotations

import collections
import sys
import time
import warnings
from typing import Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.codegen.kernel_layouts import KERNEL_LAYOUTS
from _common import provenance_line

SAMPLES_PER_OP, CALLS_PER_ATEN_OP = 3, 4  # enough to meet each kernel's layouts; the whole run stays near a minute


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _with_gaps(t: torch.Tensor) -> torch.Tensor:
    shape = list(t.shape)
    shape[-1] *= 2
    out = torch.zeros(shape, dtype=t.dtype)[..., ::2]
    return out.copy_(t)


def _dims_reversed(t: torch.Tensor) -> torch.Tensor:
    order = list(range(t.dim()))[::-1]
    return t.permute(order).contiguous().permute(order)


LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gaps": _with_gaps, "reversed dims": _dims_reversed}


# ops a traced training forward does not hold, with the reason (beside the kinds `_eager_handles` tells by name)
_NEVER_TRACED = {
    "_ctc_loss": "refused by the tracer (`tracer.data_sizes`)",
    "_scaled_mm": "float8 matmul", "_scaled_mm_v2": "float8 matmul",
    "_to_sparse": "sparse layout",
}


def _eager_handles(op: torch._ops.OpOverload) -> str | None:
    """Why a traced forward never holds `op` as it was recorded (None: it may)."""
    name = op._schema.name.split("::")[-1]
    if name.endswith("_") or op._overloadname == "out" or op._schema.is_mutable:
        return "in place / out="
    if torch.Tag.nondeterministic_seeded in op.tags:
        return "random"
    if "empty" in name:
        return "uninitialised output"
    if "backward" in name:
        return "backward kernel"
    if "as_strided" in name or "view" in name or torch.Tag.view_copy in op.tags or op.is_view:
        return "strides are its meaning"
    return _NEVER_TRACED.get(name)


def _differs(got, want) -> bool:
    """Whether the first floating-point output differs (the later ones of `_linalg_det` and its kin are work
    buffers whose contents follow the layout)."""
    first = next(((g, w) for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want))
                  if isinstance(g, torch.Tensor) and g.is_floating_point()), None)
    return first is not None and first[0].shape == first[1].shape and not torch.allclose(*first, rtol=1e-4, atol=1e-5, equal_nan=True)


def _probe_call(func, args, kwargs, found: dict) -> None:
    flat, spec = pytree.tree_flatten((args, kwargs))
    flat = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat]
    args, kwargs = pytree.tree_unflatten(flat, spec)
    try:
        want = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 -- a call that needs its autograd context: nothing to compare
        return
    for i, leaf in enumerate(flat):
        if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided or leaf.numel() <= 1 or not leaf.is_contiguous():
            continue
        for layout, lay_out in LAYOUTS.items():
            strided = lay_out(leaf)
            if strided.is_contiguous():
                continue
            trial = [*flat[:i], strided, *flat[i + 1:]]
            args, kwargs = pytree.tree_unflatten(trial, spec)
            try:
                if _differs(func(*args, **kwargs), want):
                    found[func].add((i, layout, "other values"))
            except Exception as err:  # noqa: BLE001 -- the kernel refusing the layout is what we look for
                found[func].add((i, layout, "raises: " + str(err).strip().splitlines()[0][:70]))


def main() -> int:
    from torch.testing._internal.common_methods_invocations import op_db  # needs expecttest

    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    calls: collections.Counter = collections.Counter()
    found: dict = collections.defaultdict(set)
    for info in op_db:
        for grad in (False, True):
            try:
                samples = list(info.sample_inputs("cpu", torch.float32, requires_grad=grad))[:SAMPLES_PER_OP]
            except Exception:  # noqa: BLE001 -- an OpInfo without float32 samples on CPU
                continue
            for sample in samples:
                recorder = _Recorder()
                try:
                    with recorder:
                        out = info.op(sample.input, *sample.args, **sample.kwargs)
                        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
                        if grad and outs:
                            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                except Exception:  # noqa: BLE001 -- a sample the op refuses (error-input samples)
                    continue
                for func, args, kwargs in recorder.calls:
                    if calls[func] < CALLS_PER_ATEN_OP:
                        calls[func] += 1
                        _probe_call(func, args, kwargs, found)
    print(f"{'aten op':46} {'traced forward?':24} {'covered':8} first finding (input, layout, what)")
    uncovered = []
    for func in sorted(found, key=str):
        covered = func in KERNEL_LAYOUTS
        why_not = None if covered else _eager_handles(func)
        if why_not is None and not covered:
            uncovered.append(str(func))
        i, layout, what = sorted(found[func])[0]
        print(f"{str(func):46} {why_not or 'yes':24} {'yes' if covered else '-':8} #{i}, {layout}: {what}")
    print(f"{len(calls)} aten ops probed in {time.perf_counter() - start:.0f} s; uncovered: {uncovered or 'none'}")
    print(provenance_line("contiguous_kernels", probed=len(calls), listed=len(found), uncovered=uncovered))
    return 1 if uncovered else 0


if __name__ == "__main__":
    sys.exit(main())
