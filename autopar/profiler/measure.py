"""Independent measurement of a real training step on CPU: the reference the profiler is checked against.

- FLOPs: `torch.utils.flop_counter.FlopCounterMode` over forward + backward,
  after `register_flop_formulas()` (FlopCounterMode alone counts 0 for CPU flash attention).
- Memory: `LiveStorageTracker`, a TorchDispatchMode that sees every tensor an op
  returns and keeps the sum of the sizes of all live storages (each storage once,
  however many views point at it); a storage leaves the sum when its StorageImpl
  dies (weakref.finalize on the storage, which torch keeps as one Python object per
  StorageImpl). The step measured is forward, backward, `optimizer.step()` and
  `zero_grad(set_to_none=True)`, after one warm-up step so the optimizer state
  exists; parameters, optimizer state and the batch are live throughout and count.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from autopar.profiler.flops import register_flop_formulas
from autopar.tracer import split_sample_input


def _loss(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def _call(model: nn.Module, sample_input: Any) -> torch.Tensor:
    args, kwargs = split_sample_input(sample_input)
    return _loss(model(*args, **kwargs))


def measure_flops(model: nn.Module, sample_input: Any) -> int:
    """Forward + backward FLOPs of one real step, by FlopCounterMode."""
    register_flop_formulas()
    with FlopCounterMode(display=False) as counter:
        _call(model, sample_input).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


class LiveStorageTracker(TorchDispatchMode):
    """Peak of the bytes of live tensor storages while the mode is active."""

    def __init__(self, already_live: Iterable[torch.Tensor] = (), may_free: Iterable[torch.Tensor] = ()) -> None:
        """`already_live`: kept alive by the caller for the whole measurement. `may_free`: alive now, but the
        measured code may drop the last reference (grads a backward replaces); the caller holds none."""
        super().__init__()
        self._live: dict[int, int] = {}  # StorageImpl address -> nbytes
        self.current_bytes = 0
        for t in already_live:
            self._track(t, finalize=False)
        for t in may_free:
            self._track(t)
        self.peak_bytes = self.current_bytes

    @staticmethod
    def _key(st: torch.UntypedStorage) -> int:
        return st.data_ptr() if st.device.type == "meta" else st._cdata

    def _track(self, t: torch.Tensor, finalize: bool = True) -> None:
        st = t.untyped_storage()
        key = self._key(st)
        if key in self._live:
            return
        self._live[key] = st.nbytes()
        self.current_bytes += st.nbytes()
        if finalize:
            weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out


class FakeStorageTracker(LiveStorageTracker):
    """`LiveStorageTracker` for fake (`FakeTensorMode`) or meta tensors, keyed by their StorageImpl: such a
    storage has no data pointer of its own. Runs a step or a collective for one rank without memory."""

    @staticmethod
    def _key(st: torch.UntypedStorage) -> int:
        return st._cdata


def make_optimizer(model: nn.Module, optimizer: str, foreach: bool = False) -> torch.optim.Optimizer:
    """The torch.optim optimizer the profiler's `optimizer` names (default: CPU's single-tensor path; `foreach`:
    CUDA's, every parameter at once, as `Mesh.optimizer_foreach` plans it)."""
    key = optimizer.lower()
    params = model.parameters()
    if key == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
    if key == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=foreach)
    if key in ("sgd_momentum", "sgd+momentum", "sgd-momentum", "momentum"):
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=foreach)
    if key == "sgd":
        return torch.optim.SGD(params, lr=1e-4, foreach=foreach)
    if key == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-4, foreach=foreach)
    if key == "muon":  # torch's Muon takes matrices only
        return torch.optim.Muon(params, lr=1e-4)
    raise ValueError(f"unknown optimizer {optimizer!r}")


def checkpoint_modules(model: nn.Module, paths: Iterable[str]) -> None:
    """Wrap each named submodule's forward in torch.utils.checkpoint (use_reentrant=False), in place."""
    for path in paths:
        mod = model.get_submodule(path)
        inner = mod.forward

        def forward(*args, _inner=inner, **kwargs):
            return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        mod.forward = forward


def block_paths(model: nn.Module) -> list[str]:
    """Module paths of the model's repeated blocks, what a user would checkpoint one by one.

    The children of its containers (`nn.ModuleList`, `nn.Sequential`) grouped by class, and
    the class holding the most parameters wins: a transformer's layers (one ModuleList) or a
    ResNet's residual blocks (spread over one Sequential per stage)."""
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, container in model.named_modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            for child_name, child in container.named_children():
                by_class.setdefault(type(child), []).append((f"{name}.{child_name}" if name else child_name, child))
    if not by_class:
        return []
    blocks = max(by_class.values(), key=lambda members: sum(p.numel() for _, m in members for p in m.parameters()))
    return [path for path, _ in blocks]


@dataclass(frozen=True)
class StepMeasurement:
    peak_bytes: int  # max live storage bytes over forward, backward, optimizer step
    step_s: float  # wall time of the measured step (tracker overhead included)


def measure_step(model: nn.Module, sample_input: Any, optimizer: str = "adamw") -> StepMeasurement:
    """Peak live-storage bytes of one training step with the optimizer state already initialised."""
    opt = make_optimizer(model, optimizer)

    def step() -> None:
        _call(model, sample_input).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: creates the optimizer state
    state = [t for s in opt.state.values() for t in pytree.tree_leaves(s) if isinstance(t, torch.Tensor)]
    batch = [t for t in pytree.tree_leaves(sample_input) if isinstance(t, torch.Tensor)]
    live = [*model.parameters(), *model.buffers(), *state, *batch]
    start = time.perf_counter()
    with LiveStorageTracker(live) as tracker:
        step()
    return StepMeasurement(peak_bytes=tracker.peak_bytes, step_s=time.perf_counter() - start)


def time_step(model: nn.Module, sample_input: Any, optimizer: str = "adamw", repeat: int = 3) -> float:
    """Seconds of one plain training step (best of `repeat`, after a warm-up)."""
    opt = make_optimizer(model, optimizer)
    best = float("inf")
    for i in range(repeat + 1):
        start = time.perf_counter()
        _call(model, sample_input).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            best = min(best, time.perf_counter() - start)
    return best
