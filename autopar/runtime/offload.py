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

Under mixed precision (`autopar.MixedPrecision`) a parameter computed on a copy takes ZeRO-Offload's layout
(`lean`): the device keeps only its compute copy (bf16), which `upload` fills from the master cast on the host
(2 bytes an element over the link), and no gradient of its own beyond the sync's bucket in flight: the gradient
sync sums the copies' gradients in its buckets, moves each bucket to the host in the compute dtype as soon as
it is summed (`to_host`, 2 bytes an element), and adds it into the masters' float32 `.grad` there when backward
ends (`runtime.grad_sync`, host buckets). A ZeRO-sharded parameter (whose all-gather casts its shard, so it has
no copy) keeps a float32 device copy, from which its gradient goes to the host as above.

Parameters: before a forward, each master whose version counter moved since its last copy (`opt.step()`, a
load, an in-place write) is copied host-to-device (non_blocking from pinned memory, on the compute stream, so
the forward's kernels are ordered after it). On CPU, host and device are the same memory, and the masters are
still tensors of their own: nothing on the device tier aliases them.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Mapping, Sequence

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
    """Host masters of `params` ((fqn, parameter) pairs on the device, tied ones once); `masters` holds them by FQN.
    `lean`: {fqn: compute dtype} of those the graph computes on a compute copy of that dtype (mixed precision):
    the device keeps that copy alone, and their gradients reach the masters through the sync's host buckets."""

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]], lean: Mapping[str, torch.dtype] | None = None):
        self.names = [fqn for fqn, _ in params]
        self.lean = dict(lean or {})
        self.device_of: dict[str, torch.Tensor] = {}
        self.masters: dict[str, nn.Parameter] = {}
        for fqn, p in params:
            host = host_tensor(p)
            host.copy_(p.detach())
            self.masters[fqn] = nn.Parameter(host, requires_grad=p.requires_grad)
            if fqn in self.lean:  # its compute copy, filled by `upload`: the float32 device tensor is let go
                copy = torch.empty(p.shape, dtype=self.lean[fqn], device=p.device)
            else:  # the device tensor the graph computes on: the parameter's own storage, as a leaf of its own
                copy = p.detach()
            self.device_of[fqn] = copy.requires_grad_(p.requires_grad)
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
        sync.to_host, sync.host_ready = self.to_host, self.wait

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
                    source = master
                    if copy.dtype != master.dtype:  # a compute copy: cast on the host, the link carries its dtype
                        source = host_tensor(copy).copy_(master)
                    copy.copy_(source, non_blocking=copy.is_cuda)
                    self._versions[fqn] = master._version

    def collect(self, copies: Sequence[torch.Tensor] | None = None) -> None:
        """Move the gradient of each of `copies` (default: every device copy) onto its master's `.grad` (added to one
        there), asynchronously on CUDA."""
        wanted = None if copies is None else {id(c) for c in copies}
        moved = [(self.masters[fqn], c) for fqn, c in self.device_of.items()
                 if c.grad is not None and fqn not in self.lean and (wanted is None or id(c) in wanted)]
        if not moved:
            return
        if moved[0][1].is_cuda:
            self._collect_cuda(moved)
            return
        with torch.no_grad():
            for master, copy in moved:
                master.grad = copy.grad.clone() if master.grad is None else master.grad.add_(copy.grad)
                copy.grad = None

    def _side_stream(self) -> torch.cuda.Stream:
        """The stream of device-to-host copies, ordered after the compute stream's work so far (which wrote them)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        return self._stream

    def _collect_cuda(self, moved: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        with torch.no_grad(), torch.cuda.stream(self._side_stream()):
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

    def to_host(self, summed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host copy of a summed gradient bucket in `dtype` (the compute dtype), asynchronously on CUDA (`wait` lands
        it): what the sync's host buckets carry to the masters."""
        cast = summed.to(dtype)
        if not cast.is_cuda:
            return cast.clone() if cast is summed else cast
        with torch.no_grad(), torch.cuda.stream(self._side_stream()):
            cast.record_stream(self._stream)
            staged = host_tensor(cast)
            staged.copy_(cast, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending.append(event)
        return staged

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
