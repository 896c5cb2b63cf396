"""Optimizer state on the host: the parameters a plan puts on the "host" tier are stepped there.

    off = HostOffload([(fqn, device_parameter), ...])   # pm's parameters become the host masters
    opt = torch.optim.AdamW(pm.parameters())             # steps the host masters (its state: host tensors)
    off.follow(sync)                                     # gradients device-to-host as `sync` finishes them
    off.upload()                                         # before a forward: changed masters host-to-device
    graph(*[off.device_of[fqn] ...])                     # forward and backward run on the device copies
    opt.step()                                           # a step pre-hook waits for the copies first

What the user's optimizer holds (`pm.parameters()`) is the host master of each offloaded parameter: a
separate tensor in pinned host memory (pinned where CUDA is available, so copies run asynchronously), so the
optimizer's state, made like its parameters, is on the host too, and its step runs there with torch.optim's
own CPU code. The graph computes on a device copy of each master, a leaf that requires grad as the master
does: autograd and the gradient sync (`runtime.grad_sync`) accumulate and sum its gradient on the device.

Gradients go to the host as they are final, and are added to the masters' `.grad` there (so backward
calls before a step add up as they do on the device) and dropped on the device:
- a gradient the sync sums over ranks, when its bucket's sum is written (`GradSync.on_written`): a
  `no_sync()` backward leaves it on the device, where the next synced backward sums it;
- any other (one rank, a ZeRO block reduce-scattered inside the graph), when autograd has accumulated it
  (a post-accumulate-grad hook), while backward goes on.
On CUDA the copies run on a side stream after the compute stream's work so far, non_blocking into pinned
buffers; an optimizer step pre-hook waits for their events before any optimizer steps.

Under mixed precision (`autopar.MixedPrecision`) the device copy is float32 and the compute copies are made
from it (`runtime.compute_copies`): the gradient sync unpacks each bucket's float32 sum into the device
copies' `.grad`, and from there it goes to the host as above. The masters and their optimizer state are on
the host; the device keeps a float32 copy of the values beside the compute copies.

Parameters: before a forward, each master whose version counter moved since its last copy (`opt.step()`, a
load, an in-place write) is copied host-to-device (non_blocking from pinned memory, on the compute stream, so
the forward's kernels are ordered after it). On CPU, host and device are the same memory, and the masters are
still tensors of their own: nothing on the device tier aliases them.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import InvalidValueError

_LIVE: weakref.WeakSet[HostOffload] = weakref.WeakSet()  # every offload whose copies a step must wait for
_handle = None


def host_tensor(like: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like `like`, pinned where CUDA can copy to and from it asynchronously."""
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=torch.cuda.is_available())


class HostOffload:
    """Host masters of `params` ((fqn, parameter) pairs on the device, tied ones once); `masters` holds them by FQN."""

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]]):
        self.names = [fqn for fqn, _ in params]
        self.device_of: dict[str, torch.Tensor] = {}
        self.masters: dict[str, nn.Parameter] = {}
        for fqn, p in params:
            host = host_tensor(p)
            host.copy_(p.detach())
            self.masters[fqn] = nn.Parameter(host, requires_grad=p.requires_grad)
            # the device tensor the graph computes on: the parameter's own storage, as a leaf of its own
            self.device_of[fqn] = p.detach().requires_grad_(p.requires_grad)
        self._versions: dict[str, int] = {}  # each master's version when it was last copied to the device
        self._pending: list[torch.cuda.Event] = []  # device-to-host copies not yet waited for
        self._staged: list[tuple[nn.Parameter, torch.Tensor]] = []  # (master, its gradient copied there once done)
        self._stream = None  # the side stream of device-to-host copies (CUDA)
        self._sync = None  # the gradient sync whose buckets carry some of the copies' gradients
        for copy in self.device_of.values():
            copy.register_post_accumulate_grad_hook(self._accumulated)
        _watch_steps(self)

    def follow(self, sync) -> None:
        """Move the gradients `sync` (a `GradSync` over the device copies) sums as it writes each bucket, and the
        others once autograd accumulated them."""
        self._sync = sync
        sync.on_written = self.collect

    def _accumulated(self, copy: torch.Tensor) -> None:
        if self._sync is None or not self._sync.synced(copy):  # final now: no sum over ranks follows
            self.collect([copy])

    @property
    def device(self) -> torch.device:
        """Where the copies the graph computes on live."""
        return next(iter(self.device_of.values())).device

    def upload(self) -> None:
        """Copy to the device each master changed since its last copy; each copy requires grad as its master."""
        with torch.no_grad():
            for fqn, master in self.masters.items():
                copy = self.device_of[fqn]
                if copy.requires_grad != master.requires_grad:
                    copy.requires_grad_(master.requires_grad)
                if self._versions.get(fqn) != master._version:
                    copy.copy_(master, non_blocking=copy.is_cuda)
                    self._versions[fqn] = master._version

    def collect(self, copies: Sequence[torch.Tensor] | None = None) -> None:
        """Move the gradient of each of `copies` (default: every device copy) onto its master's `.grad` (added to one
        there), asynchronously on CUDA."""
        wanted = None if copies is None else {id(c) for c in copies}
        moved = [(self.masters[fqn], c) for fqn, c in self.device_of.items()
                 if c.grad is not None and (wanted is None or id(c) in wanted)]
        if not moved:
            return
        if moved[0][1].is_cuda:
            self._collect_cuda(moved)
            return
        with torch.no_grad():
            for master, copy in moved:
                master.grad = copy.grad.clone() if master.grad is None else master.grad.add_(copy.grad)
                copy.grad = None

    def _collect_cuda(self, moved: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        compute = torch.cuda.current_stream()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(compute)  # the gradients are written by the compute stream's backward
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for master, copy in moved:
                grad = copy.grad
                grad.record_stream(self._stream)  # freed by the caching allocator only after this copy
                staged = host_tensor(grad)
                staged.copy_(grad, non_blocking=True)
                self._staged.append((master, staged))
                copy.grad = None
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending.append(event)

    def wait(self) -> None:
        """Wait for the device-to-host copies in flight and land them on the masters' gradients."""
        for event in self._pending:
            event.synchronize()
        self._pending.clear()
        with torch.no_grad():
            for master, staged in self._staged:
                master.grad = staged if master.grad is None else master.grad.add_(staged)
        self._staged.clear()

    def ready(self) -> None:
        """Every gradient on its master, every copy done: what an optimizer step (or a read of `.grad`) needs."""
        self.collect()
        self.wait()


def _watch_steps(offload: HostOffload) -> None:
    """Every optimizer step waits for the live offloads' gradient copies first (installs the hook once)."""
    global _handle
    _LIVE.add(offload)
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(lambda *_: _ready_all())


def _ready_all() -> None:
    for offload in list(_LIVE):
        offload.ready()


def offloaded_names(names: Iterable[str] | str | None, params: Iterable[str]) -> frozenset[str]:
    """The FQNs `parallelize(offload=...)` names: "optimizer" (or "all") for every parameter, else a set of FQNs,
    each checked against `params`."""
    known = list(params)
    if names is None or names == "none":
        return frozenset()
    if isinstance(names, str):
        if names in ("optimizer", "all"):
            return frozenset(known)
        names = [names]
    chosen = frozenset(names)
    unknown = sorted(chosen - set(known))
    if unknown:
        raise InvalidValueError(f"offload={sorted(chosen)[:5]}: {unknown[:5]} are not parameters of the model; name them as "
                         f"model.named_parameters() does ({known[:3]} ...), or pass offload='optimizer' for all")
    return chosen
