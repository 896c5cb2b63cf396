"""Bucketed gradient all-reduce for parameters replicated over data-parallel axes, overlapped with backward.

    sync = GradSync([(name, param, (mesh.group_name("dp"),)) for name, param in ...])
    loss = loss_fn(model(x)); sync.watch(loss)  # required: backward's entry there starts the sync (below)
    loss.backward()            # buckets are all-reduced as their grads appear; waited at the end of backward

Each parameter is registered with the group names of the mesh axes its gradient
must be SUMMED over (or with `ProcessMesh.flat_group_name(axes)`, one group
spanning them all: one all-reduce instead of one per axis) (never averaged: the loss the generated graph produces is
already the global loss, so each rank's grad is one term of the global grad).
ZeRO-sharded parameters are not registered: `all_gather_rs` reduce-scatters their
grads inside the graph.

Like DDP: parameters are bucketed in reverse registration order (backward produces
grads roughly last layer first), a bucket is launched when the last of its grads has
been accumulated (`register_post_accumulate_grad_hook`), and buckets are launched in
bucket order, whatever order the hooks fire in, so that every rank issues the same
collectives in the same order. A callback queued on the autograd engine waits for all
of them when backward ends (or call `finish()`); a bucket some of whose grads were
never produced is launched there with zeros for them, since the peers may have them.
The last bucket (the first-registered parameters, whose grads backward produces
last) has no hooks: it is launched when backward ends, about when its last grad
would have launched it. A backward syncs when it reaches the module (`watch`, a hook
on each tensor the module returns) and the engine will accumulate into some synced
parameter's grad. Each Python hook autograd calls costs about 1.8 us: a model whose
grads fit one bucket (BERT-tiny's 41 parameters) pays one hook a backward, not 41.
Packing into the flat bucket is one concatenation (torch's C++ flatten), or
`kernels.pack` when the bucket is cast for the wire (cast and copy in one pass).
Once summed, the bucket becomes the grads: each `.grad` is set to a view of it and
the local grads are freed (like DDP's `gradient_as_bucket_view`, but for the synced
result only); a bucket cast for the wire is unpacked instead (`kernels.unpack`).

Mixed precision (`autopar.MixedPrecision`): the registered tensors are the compute copies
(`runtime.compute_copies`) and each has a float32 master, where its gradient lands
(`runtime.master_grads` says how, accumulation included). Every copy is registered, those with
no group too (their buckets make no collective). A master on the host tier (`hosted`,
`runtime.offload`'s lean layout) is in a host bucket: at its launch the bucket is summed at once and
moved to the host in its copies' dtype (`to_host`), so the device holds no gradient of it past its
launch; `finish` waits for the copies (`host_ready`) and unpacks it into the masters there.
A bucket's flat buffer is allocated at its launch and, as the grads' storage, lives
exactly as long as they do: `zero_grad(set_to_none=True)` frees it. Kept between steps
it would hold the synced grads' bytes through forward too (the solver counts gradients
for the whole step either way; the measured peak of forward would not drop).

Gradient accumulation: a grad is SUMMED over ranks, and the grads a sync wrote
are the same on every rank of its group, so a backward that adds to them must
put them into its reduction once, not once per rank (DDP averages, for which
re-reducing an already-synced grad is harmless). When a backward that
accumulates reaches the module (a hook on each tensor it returns: `watch`),
before any of its parameters' grads is accumulated, each grad that is still the
tensor the last sync wrote (zeroed, clipped or scaled in place or not) is kept
by one rank of the bucket's group, its "keeper" (rank 0 of each group it is
summed over), and dropped by the others: the keeper accumulates its local term
onto it, the others into a fresh `.grad`, and the sum over ranks is the old sum
plus every rank's new term. The same holds under `no_sync()` (the next synced
backward reduces the lot), for a parameter that gets no grad in this backward
(the keeper sends its sum, the others zeros), and costs no memory: nothing is
set aside. A grad the sync did not write (a `no_sync()` one, or one set by the
caller) is reduced whole. So several backward calls before `optimizer.step()`
give the grads of the summed losses, with or without `no_sync()`. An in-place
change between them (`zero_grad(set_to_none=False)`, clipping) must be made alike
on every rank, as an optimizer's is.

A mean loss's division by its global token count (`runtime.deferred_loss`) can be
taken over (`defer_scale`): backward then carries the gradient of the sum, and
`finish` divides this backward's gradients by the count: each synced bucket
before its unpack, the other parameters' grads in place. Backward then never
waits for the count; `finish` does, long after it arrived. It is exact only when
every gradient the module's parameters get in this backward came through that
one loss, so it is accepted only when: one such loss was computed since the last
backward ended (two losses summed into one backward keep their own divisions),
nothing forbade it (`forbid_deferral`: inputs that require grad, whose gradients
would be those of the sum), no parameter holds a gradient (accumulation, onto
synced sums or others, keeps the division in backward), backward accumulates into `.grad` at all
(`torch.autograd.grad` returns the gradients: they must come out divided), and
does not build a graph of them (`create_graph=True`: an in-place division at the
end would not be differentiated), and no parameter carries a gradient hook of
someone else's (it would see the gradient of the sum). Gradient entering through another output of the
module (`gradient_enters`) is multiplied by the count if the division was taken
over, and otherwise keeps the division in backward. A parameter of this module
also used outside it in the same backward would have that outside gradient
divided too: the module's parameters are its own local shards, so that takes
reaching into the module on purpose. Without a bucket (one rank) there is no
wait to move and the division stays in backward, where it is one scalar op.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.runtime.comm import Started, start_all_reduce, wait_for
from autopar.solver.cost import GRAD_BUCKET_BYTES
from autopar.runtime.master_grads import MasterGrads
from kernels import pack, unpack

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = GRAD_BUCKET_BYTES  # the size the solver prices (autopar.solver.cost)


@dataclass
class _Bucket:
    index: int
    groups: tuple[str, ...]  # reduced over each in turn (a sum over all of those axes); () for none (no collective)
    first_group: dist.ProcessGroup | None  # groups[0], resolved once (the launch is on every backward's path)
    names: list[str]
    params: list[torch.nn.Parameter]  # whose grads autograd accumulates
    masters: list[torch.nn.Parameter]  # where the summed grads land: `params` itself, or the copies' float32 masters
    numel: int
    dtype: torch.dtype  # the wire dtype
    device: torch.device
    keeper: bool  # this rank puts the grads the last sync wrote into the next reduction (gradient accumulation)
    host: bool = False  # its masters are on the host tier: summed and moved there at launch
    buffer: torch.Tensor | None = None  # flat; allocated at launch, dropped once written back (it may live on as the grads)
    ready: set[int] = field(default_factory=set)  # positions in `params` whose grad is accumulated
    work: dist.Work | None = None  # the in-flight all-reduce over groups[0]

    @property
    def copies(self) -> bool:
        """Its tensors are compute copies whose grads land in their masters (mixed precision)."""
        return self.masters is not self.params

    @functools.cached_property  # read twice per backward; the params' dtype and layout do not change
    def as_grads(self) -> bool:
        """The summed buffer can be the grads themselves: same dtype, and views of it are laid out like the params."""
        return not self.copies and all(p.dtype == self.dtype and p.is_contiguous() for p in self.params)


class GradSync:
    """All-reduces registered parameters' grads in buckets during backward.

    `params`: (name, parameter, group names to sum the grad over). A parameter with
    no groups is skipped (nothing to reduce) unless it is a compute copy. `reduce_dtype` casts
    the bucket for the wire (e.g. torch.bfloat16 halves the traffic), default: the grads' dtype.
    `scaled`: every parameter of the module (synced or not), for `defer_scale`.
    `masters`: name -> the float32 master of a parameter that is a compute copy (mixed precision).
    `hosted`: names of those whose master is on the host tier (their buckets are host buckets: `to_host` must be set).
    """

    def __init__(
        self,
        params: Iterable[tuple[str, torch.nn.Parameter, Sequence[str]]],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reduce_dtype: torch.dtype | None = None,
        scaled: Iterable[torch.nn.Parameter] = (),
        masters: Mapping[str, torch.nn.Parameter] | None = None,
        hosted: Iterable[str] = (),
    ):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.enabled = True
        self.launched = 0  # buckets launched in the current backward (tests read it to check overlap)
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}  # id(param) -> (bucket, position)
        self._hooked: set[int] = set()  # id(param) of those with the sync's post-accumulate hook
        self._next = 0  # next bucket index to launch
        self._callback_queued = False  # `finish` is queued for the end of the current backward
        self._syncing = False  # a grad to sync arrived in the current backward (buckets to launch and wait)
        self._scaled = [p for p in scaled if p.requires_grad]
        self._losses = 0  # mean losses that may defer their division, computed since the last backward ended
        self._forbidden = False  # something since then sends gradient into the module besides those losses
        self._count: Started | None = None  # the global count this backward's grads are divided by in `finish`
        self._handles = []
        self._synced: list[tuple[torch.nn.Parameter, weakref.ref, bool]] = []  # (param, the grad the last sync wrote, keeper)
        self._kept_sums = False  # this backward accumulates onto sums a sync wrote (every rank alike)
        self._master_grads = MasterGrads()  # the masters' grads the sync wrote (mixed precision)
        # called with each bucket's masters once their summed grads are written (the host tier moves them there)
        self.on_written: Callable[[Sequence[torch.nn.Parameter]], None] | None = None
        # a summed host bucket -> its host copy in the given dtype, and the wait for those copies (`runtime.offload`)
        self.to_host: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None
        self.host_ready: Callable[[], None] | None = None
        self._build(list(params), reduce_dtype, masters or {}, frozenset(hosted))
        landed = {id(m) for b in self._buckets for m in b.masters}
        self._unsynced = [p for p in self._scaled if id(p) not in landed]  # scaled, never in a bucket
        self._copies = any(b.copies for b in self._buckets)
        # the AccumulateGrad nodes of the synced parameters and of every one, held (as DDP does) so that each
        # backward can ask the engine whether it accumulates into their `.grad`
        self._sync_accumulators = [get_gradient_edge(q).node for b in self._buckets for q in b.params]
        self._accumulators = [*self._sync_accumulators, *(get_gradient_edge(p).node for p in self._unsynced)]
        if dist.is_initialized() and dist.get_rank() == 0:
            logger.info("runtime: grad sync of %d params in %d buckets (%.1f MB max)", len(self._where), len(self._buckets), bucket_bytes / 2**20)

    def _build(self, params: list[tuple[str, torch.nn.Parameter, Sequence[str]]], reduce_dtype: torch.dtype | None,
               masters: Mapping[str, torch.nn.Parameter], hosted: frozenset[str]) -> None:
        open_buckets: dict[tuple, _Bucket] = {}  # (groups, dtype, device, copies) -> the bucket being filled
        for name, p, groups in reversed(params):
            groups = tuple(groups)
            master = masters.get(name)
            if (not groups and master is None) or not p.requires_grad:
                continue
            if id(p) in self._where:
                raise ValueError(f"parameter {name!r} is registered twice with GradSync")
            for g in groups:
                _resolve_process_group(g)  # fail here, naming the group, rather than mid-backward
            dtype = reduce_dtype or p.dtype
            key = (groups, dtype, p.device, master is not None, name in hosted)
            b = open_buckets.get(key)
            if b is not None and (b.numel + p.numel()) * dtype.itemsize > self.bucket_bytes:
                b = None  # full: start a new one (a parameter larger than a bucket gets one of its own)
            if b is None:
                keeper = all(dist.get_rank(_resolve_process_group(g)) == 0 for g in groups)
                first = _resolve_process_group(groups[0]) if groups else None
                tensors: list[torch.nn.Parameter] = []
                b = _Bucket(len(self._buckets), groups, first, [], tensors, [] if master is not None else tensors, 0,
                            dtype, p.device, keeper, name in hosted)
                self._buckets.append(b)
                open_buckets[key] = b
            self._where[id(p)] = (b, len(b.params))
            b.names.append(name)
            b.params.append(p)
            if b.copies:
                b.masters.append(master)
            b.numel += p.numel()
        for b in self._buckets[:-1]:  # the last one is launched when backward ends (module docstring)
            for p in b.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
                self._hooked.add(id(p))

    def synced(self, p: torch.Tensor) -> bool:
        """Whether `p`'s gradient goes through a bucket of this sync."""
        return id(p) in self._where

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [list(b.names) for b in self._buckets]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication: grads accumulate locally (micro-steps); the next synced backward reduces all of it.

        It may start from the grads a synced backward wrote: only their keepers hold them on (gradient
        accumulation, above), so the next synced backward adds them once.
        """
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def watch(self, *outputs: torch.Tensor) -> None:
        """Backward may start from `outputs` (what the module returns, or a loss computed from it): when
        it reaches one, each grad the last sync wrote is kept by its keeper only (gradient accumulation, above)."""
        if self._buckets:
            for out in outputs:
                if out.requires_grad:
                    out.register_hook(self._on_enter)

    def _on_enter(self, grad: torch.Tensor) -> None:
        """A backward reaches the module, before any of its parameters' grads is accumulated."""
        if self._syncing or self._kept_sums:  # entered already, through another output
            return
        if not self._accumulates(self._sync_accumulators):
            return  # nothing to sync, and the sums stay as they are (`torch.autograd.grad`)
        for p, ref, keeper in self._synced:
            if p.grad is not None and p.grad is ref():
                self._kept_sums = True
                if not keeper:
                    p.grad = None  # the keeper's copy of this sum goes into the reduction; this one would add it again
        self._synced.clear()  # a grad that is not the sync's now never will be; the next sync writes new ones
        if self.enabled:
            self._start_sync()
        elif self._kept_sums or self._copies:
            self._queue_finish()  # resets `_kept_sums`, and moves the copies' grads to their masters, when this backward ends

    def _start_sync(self) -> None:
        self._queue_finish()
        self._syncing = True
        self.launched = 0

    def _queue_finish(self) -> None:
        if not self._callback_queued:
            # Runs when this backward's graph task finishes: the waits happen before loss.backward() returns.
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._callback_queued = True

    # ------------------------------------------------------------ a mean loss's division (`deferred_loss`)
    def loss_forward(self) -> None:
        self._losses += 1

    def forbid_deferral(self) -> None:
        """Gradient may enter the module other than through its loss until the next backward ends."""
        self._forbidden = True

    def gradient_enters(self) -> torch.Tensor | None:
        """Gradient enters through another output of the module in this backward (`deferred_loss.other_output`).
        If the division by a mean loss's count was taken over, returns that count: the caller multiplies
        what enters by it, so that `finish`'s division leaves it as it was. Otherwise the division stays
        in backward for the rest of this backward."""
        self._queue_finish()
        if self._count is not None:
            return self._count.wait()
        self._forbidden = True
        return None

    def defer_scale(self, count: Started) -> bool:
        """Take over the division by the global `count` (`deferred_loss.start_count`'s) when it is exact."""
        self._queue_finish()  # the end of this backward resets the bookkeeping, whatever is decided
        if not self._buckets or self._forbidden or self._kept_sums or self._losses != 1 or self._count is not None:
            return False
        if any(b.host for b in self._buckets):  # they are summed at launch, before the count is known
            return False
        if torch.is_grad_enabled():  # create_graph=True: the gradients are themselves differentiated
            return False
        if not self._params_untouched() or not self._accumulates(self._accumulators):
            return False
        self._count = count
        return True

    def _params_untouched(self) -> bool:
        """No parameter holds a gradient (accumulation) or carries a gradient hook besides the sync's own
        (it would see the gradient of the sum, N times the loss's: a clamp there clamps the wrong values)."""
        for p in self._scaled:
            ours = 1 if id(p) in self._hooked else 0
            if p.grad is not None or p._backward_hooks or len(p._post_accumulate_grad_hooks or ()) > ours:
                return False
        return True

    @staticmethod
    def _accumulates(accumulators: list) -> bool:
        """This backward accumulates into the `.grad` of some parameter of `accumulators`' (their
        AccumulateGrad nodes). Not so under `torch.autograd.grad`, which returns the gradients to its
        caller (they must leave backward divided)."""
        try:
            return any(torch._C._will_engine_execute_node(a) for a in accumulators)
        except RuntimeError:  # torch declines the question under autograd.grad(): nothing is accumulated
            return False

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.enabled:
            return
        if not self._syncing:  # a backward that did not enter through a watched output
            self._start_sync()
        bucket, pos = self._where[id(p)]
        bucket.ready.add(pos)
        # Launch in bucket order so all ranks issue identical collective sequences.
        while self._next < len(self._buckets) and len(self._buckets[self._next].ready) == len(self._buckets[self._next].params):
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        if b.as_grads:
            # A plain concatenation: torch's C++ flatten (one cat; on CUDA one launch, as `pack`'s). Through
            # `pack`, the Python around the same cat cost about 100 us a backward of a one-rank GPT-2 step.
            b.buffer = torch._utils._flatten_dense_tensors(grads)
        else:
            b.buffer = pack(grads, dtype=b.dtype)  # cast for the wire in the same pass
        if b.copies:
            for p in b.params:
                p.grad = None  # the bucket holds them now
            if b.groups:
                self._master_grads.add_unsummed(b.buffer, b.masters)
        if b.groups:
            b.work = start_all_reduce(b.buffer, b.first_group)
        if b.host:  # summed now, and off the device in the copies' dtype: no device gradient of it outlives its launch
            self._wait_bucket(b)
            b.work, b.buffer = None, self.to_host(b.buffer, b.params[0].dtype)
        self.launched += 1

    def finish(self) -> None:
        """Wait for every bucket and write the summed grads back (launching buckets whose grads never
        came), and divide this backward's grads by a mean loss's count if `defer_scale` took it.

        Called by autograd at the end of each backward that synced or took a division; a no-op outside one.
        """
        if not self._callback_queued:
            return
        # a 0-d tensor, never read on the host (no sync point; fake tensors have no value): no labels kept gives inf, as eager
        scale = None if self._count is None else 1.0 / self._count.wait()
        if self._syncing:
            self._finish_sync(scale)
        elif self._copies:  # a `no_sync()` backward
            for b in self._buckets:
                if b.copies:
                    self._master_grads.move_from_copies(b.params, b.masters, bool(b.groups), b.keeper)
        if scale is not None:
            with torch.no_grad():  # the grads no bucket carried (all of them under `no_sync`)
                for p in self._unsynced if self._syncing else self._scaled:
                    if p.grad is not None:
                        p.grad.mul_(scale)
        self._callback_queued = self._syncing = self._forbidden = self._kept_sums = False
        self._losses, self._count = 0, None

    def _finish_sync(self, scale: torch.Tensor | None) -> None:
        """Launch what is left, wait for every bucket and write the summed grads (times `scale`) back."""
        for b in self._buckets[self._next:]:
            self._launch(b)
        self._synced.clear()  # this sync writes every synced grad anew
        if self.host_ready is not None and any(b.host for b in self._buckets):
            self.host_ready()  # the host buckets' copies landed
        for b in self._buckets:
            if not b.host:  # (a host bucket was summed at its launch)
                self._wait_bucket(b)
            if b.copies:  # the scale, the cast and the add into the masters' gradients in one pass
                self._master_grads.unpack_into(b.buffer, b.masters, 1.0 if scale is None else scale)
                b.work, b.buffer = None, None
                b.ready.clear()
                if self.on_written is not None:
                    self.on_written(b.masters)
                continue
            if b.as_grads:
                if scale is not None:
                    b.buffer.mul_(scale)
                # The summed bucket becomes the grads' storage (no copy back; the local grads are freed).
                # torch's C++ unflatten makes the views: a Python split + view per parameter took
                # 80 us of a 7.5 ms one-rank GPT-2 step, every step.
                grads = torch._utils._unflatten_dense_tensors(b.buffer, b.params)
            else:
                grads = [p.grad if p.grad is not None else torch.empty_like(p) for p in b.params]
                unpack(b.buffer, grads, scale=1.0 if scale is None else scale)
            for p, grad in zip(b.params, grads):
                p.grad = grad
                self._synced.append((p, weakref.ref(grad), b.keeper))
            b.work, b.buffer = None, None
            b.ready.clear()
            if self.on_written is not None:
                self.on_written(b.params)
        self._next = 0

    def shadow(self) -> None:
        """Issue one synced backward's collectives with zeros for every gradient, in the same order: what a
        rank with nothing to add sends while the others still train (torch's `Join`, `runtime.join`)."""
        synced = [b for b in self._buckets if b.groups]
        for b in synced:
            b.buffer = torch.zeros(b.numel, dtype=b.dtype, device=b.device)
            b.work = start_all_reduce(b.buffer, b.first_group)
        for b in synced:
            self._wait_bucket(b)
            b.work, b.buffer = None, None

    @staticmethod
    def _wait_bucket(b: _Bucket) -> None:
        """Wait for bucket `b`'s sum over its first group (if it has one), then sum it over the others."""
        if b.work is not None:
            wait_for(b.work, "the gradient sync's all-reduce", b.first_group)
        # Further axes one after another: collectives on different groups may run on different
        # threads, so the next sum can only start once the previous one is complete.
        for g in b.groups[1:]:
            pg = _resolve_process_group(g)
            wait_for(start_all_reduce(b.buffer, pg), "the gradient sync's all-reduce", pg)

    def keep_marks(self, old: GradSync) -> None:
        """Take over `old`'s marks of the grads its last sync wrote, for the parameters both sync (a rebuilt
        sync: the next backward still adds each sum once)."""
        self._synced = [m for m in old._synced if id(m[0]) in self._where]
        self._master_grads.kept_for(old._master_grads, [m for b in self._buckets if b.copies for m in b.masters])

    def remove(self) -> None:
        """Detach the hooks (the parameters stop being synced)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
