"""`ParallelModule`: the lowered graph as an ordinary `nn.Module` for training loops.

    pm = ParallelModule(gm, traced, mesh, plan)
    loss = pm(**my_slice_of_the_batch)     # same call signature as the original model
    loss.backward()                         # grads of local shards, data-parallel sync included
    pm.clip_grad_norm_(1.0)                 # optional: clipping by the norm of the FULL gradients
    opt.step()                              # any torch.optim optimizer over pm.parameters()

Parameters are this rank's shards under their original FQNs (the lowered
graph's own submodules, shared, so `named_parameters()` reads
`transformer.h.0.attn.c_attn.weight`). `state_dict()` gathers full tensors;
`load_state_dict()` takes full tensors and keeps this rank's block; `optimizer_state_dict(opt)`
and `load_optimizer_state_dict(opt, osd)` do the same for an optimizer's state.
`save_checkpoint(path, opt)` writes both with torch.distributed.checkpoint, each rank its
shards, and `load_checkpoint(path, opt)` resumes from it under any plan or mesh.

A graph is lowered for the inputs (which arguments, their shapes, non-tensor values) it was
traced with, in training mode, without autocast, for the parameters' dtypes and
requires_grad then. Other inputs (an epoch's last, smaller batch; another sequence length;
no labels, for logits), eval mode (`pm.eval()`: dropout off), `torch.autocast`, parameters
frozen, unfrozen or converted since get a graph of their own, traced once over the same
parameters and kept: under the same plan when it has the planned graph's ops, else under a
plan of its own that keeps the parameters and buffers where they are.

Under a mixed-precision policy (`autopar.MixedPrecision`) the parameters are float32 masters and
the graph reads compute copies of them (`runtime.compute_copies`), refreshed before a forward when
the masters changed; the gradient sync moves the copies' gradients into the masters' `.grad`.
"""
from __future__ import annotations

import copy
import functools
import logging
import math
import operator
import os
import time
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch
from torch import fx, nn
from torch.distributed.algorithms.join import JoinHook, Joinable
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils import _pytree as pytree

from autopar.codegen.eval_mode import eval_difference, without_dropout
from autopar.codegen.exchanges import exchanges_activations
from autopar.codegen.lower import LoweringInfo, lower, share_tree
from autopar.codegen.shapes import LoweringError
from autopar.errors import AlreadyParallelError, TraceError, UsageError
from autopar.mixed_precision import MixedPrecision
from autopar.runtime import arrival
from autopar.runtime.arrival import all_ranks_make
from autopar.runtime.batch import batch_slice, global_like, slice_leaves
from autopar.runtime.deferred_loss import grads_scaled_by, other_output
from autopar.runtime.drift import check_replicas
from autopar.runtime.grad_norm import track
from autopar.runtime.optimizers import watch_optimizers
from autopar.runtime import join, rng
from autopar.runtime.compute_copies import ComputeCopies
from autopar.runtime.offload import HostOffload
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.same_inputs import agree
from autopar.runtime.state_dict import (
    checkpoint_to_load,
    full_state_dict,
    gather_full,
    gather_optimizer_state,
    load_full_state_dict,
    load_sharded,
    local_shard,
    save_sharded,
    saved_extra,
    shard_optimizer_state,
)
from autopar.solver.plan import Plan
from autopar.solver.plan_io import op_name
from autopar.solver.spec import Spec
from autopar.tracer import CallArguments, TracedGraph
from autopar.tracer.batch_dims import batch_dims

log = logging.getLogger(__name__)

# Distinct input signatures past which each new one is logged as a warning: every one costs a trace.
_MANY_GRAPHS = 8


@dataclass(frozen=True)
class Retracer:
    """How a `ParallelModule` gets graphs for inputs it was not lowered for (`autopar.parallelize` makes one)."""

    # (the global batch, as a sample input, training, autocast dtype or None, {fqn: dtype} of the parameters and
    # buffers) -> the model traced on it, as it was traced first, with its tensors in those dtypes, under autocast
    # to that dtype if one is given (the graph then holds autocast's casts)
    trace: Callable[[Any, bool, torch.dtype | None, Mapping[str, torch.dtype]], TracedGraph]
    # (a graph of the model, the module's plan, {fqn: spec} of the buffers the module holds split) -> a plan for
    # that graph storing the parameters as the module's plan does and the buffers as the module holds them, for
    # a graph with other ops than the planned one (None: such graphs raise)
    replan: Callable[[TracedGraph, Plan, Mapping[str, Spec]], Plan] | None = None


class _Signature(NamedTuple):
    """What a graph is lowered for: a forward whose signature differs gets another graph."""

    training: bool
    trainable: tuple[bool, ...] | None  # each parameter's requires_grad (None: a trace and plan do not depend on them)
    autocast: torch.dtype | None  # None: off
    state_dtypes: tuple[torch.dtype, ...]  # the parameters' and buffers' dtypes
    structure: pytree.TreeSpec  # which arguments are given
    inputs: tuple  # each tensor input's (shape, dtype), each other input's value


class _Graph(NamedTuple):
    """One lowered graph of the module, for one input signature (shapes, dtypes, non-tensor values, mode)."""

    gm: fx.GraphModule
    out_spec: Any
    loss_index: int | None  # None: no output is the loss
    state_slots: list[tuple[dict[str, torch.Tensor], str]]  # where each parameter or buffer argument is read
    param_positions: list[int]  # which arguments are parameters (the same FQNs, in order, in every graph)
    sync_key: tuple  # what the gradient sync it needs is built from: the axes each gradient is summed over, which train
    casts: bool  # traced under autocast: it holds autocast's casts, and runs with autocast off
    copied: tuple[tuple[int, str], ...] = ()  # (argument, FQN) of the parameters it reads as compute copies


class ParallelModule(nn.Module, Joinable):
    def __init__(self, gm: fx.GraphModule, traced: TracedGraph, mesh: ProcessMesh, plan: Plan, retracer: Retracer | None = None,
                 mixed_precision: MixedPrecision | None = None):
        """retracer: traces the model again for inputs the first graph was not lowered for: other shapes, eval
        mode, autocast, parameters frozen or unfrozen since (None: such inputs raise, naming them).
        mixed_precision: the policy `gm` was traced under (its reduce dtype is the gradient sync's)."""
        super().__init__()
        self._precision = mixed_precision
        self._copies: ComputeCopies | None = None
        Joinable.__init__(self)  # torch's `Join` for ranks with different numbers of batches (`runtime.join`)
        info: LoweringInfo = gm.meta["autopar"]
        share_tree(self, gm)  # the graph's parameter tree, so FQNs are the original ones (no "graph." prefix)
        self.mesh, self.plan, self.info = mesh, plan, info
        self._offload = self._offload_for(plan)  # the host tier's masters in the parameters' place (`runtime.offload`)
        # outputs come back as each rank's rows: a loss computed from them outside is one term of a sum.
        # Watched in the first training forward only: a loop that computes its loss outside does so from
        # its first step, and the watch costs an alias and a hook per output.
        self._watch_outputs = info.input_layout == "shard" and math.prod(mesh.shape) > 1
        self._outside_loss_logged = False
        self._traced, self._retracer = traced, retracer
        self._first = first = self._graph_of(gm, traced, casts=False)
        # a plan that moves activations between ranks needs every rank's inputs of one shape: checked each
        # forward, an error rather than mismatched collectives (a data-parallel plan takes any shapes per rank)
        self._inputs_must_agree = math.prod(mesh.shape) > 1 and exchanges_activations(gm, len(info.state_inputs))
        # Under any other plan the forward's only collectives are the loss's all-reduces: a forward only some
        # ranks run (`if rank == 0: evaluate(pm)`) would meet the others' training collectives. The first forward
        # and each change of mode (training, gradients) wait for every rank to make the same one (`runtime.arrival`).
        self._modes_must_agree = math.prod(mesh.shape) > 1 and not self._inputs_must_agree and traced.loss_index is not None
        self._mode: tuple[bool, bool] | None = None  # (training, gradients on) of the last forward checked
        # how long a checked call (`runtime.arrival`: state dicts, checkpoints, each change of mode) waits for the
        # other ranks before raising, naming those that did not come
        self.call_timeout_s = arrival.TIMEOUT_S
        # how many training forwards apart the copies of replicated parameters are compared across ranks
        # (`runtime.drift`; 0: only before each save). A check costs one all-gather of a few integers per rank and
        # one pass over the parameters: 7% of a step on gpt2-tiny, 2 gloo ranks (`benchmarks/drift_check.py`),
        # so 0.07% of training every 100 steps
        self.drift_check_every = 100
        self._forwards_since_check = 0
        # each parameter's requires_grad is part of a graph's signature: freezing or unfreezing one after
        # `parallelize` lowers a graph whose backward follows the new flags (and rebuilds the sync)
        self._param_slots = [first.state_slots[i] for i in first.param_positions]
        self._device_type = mesh.device_mesh.device_type  # whose autocast state a graph's signature holds
        self._state_dtypes = self._dtypes_read()  # as traced; `_apply` (pm.to(torch.bfloat16), pm.half()) updates it
        self._on_meta = self._meta_read()  # a model built on meta: no values until `to_empty` and a load
        self._key = _signature(_local_inputs(traced, info.input_layout, math.prod(mesh.shape)), traced.in_spec, True,
                               self._trainable(), None, self._state_dtypes)
        self._graphs = {self._key: first}
        # per signature but for the requires_grad flags: the graph traced for it, its plan, and what it is (a
        # parameter frozen or unfrozen lowers these again, without another trace or solve)
        self._planned: dict[_Signature, tuple[TracedGraph, Plan, str]] = {_without_flags(self._key): (traced, plan, "the plan's graph")}
        self._use(first)
        self._copies = self._copies_for(first)
        self._sync = _make_grad_sync(self, info, mesh, self._copies, self._reduce_dtype())
        if self._offload is not None:
            self._offload.follow(self._sync)  # the host tier's gradients leave the device as the sync writes them
        self._syncing = True  # False inside `no_sync()`
        self._sync_key = first.sync_key
        self._synced_params = self._params_read()  # the sync's
        track(self)  # torch's clip_grad_norm_ on these shards: the full gradients' norm
        self.equal_blocks: set[str] = set()  # split parameters whose blocks are alike by design (`expect_equal_blocks`)
        rng.agree_on_mask_seed(mesh.cpu_group)  # dropout masks alike on replicas, however each rank seeded torch
        watch_optimizers(self)  # and no optimizer reading whole parameters steps them

    def _graph_of(self, gm: fx.GraphModule, traced: TracedGraph, casts: bool) -> _Graph:
        # the graph takes its parameters and buffers as arguments (`lower`'s docstring says why): each is
        # read from its owner's dict at every call, so the graph gets the module's current tensors (a buffer
        # `module.to` replaced, as get_attr read them)
        info: LoweringInfo = gm.meta["autopar"]
        slots = [_slot(self, fqn) for fqn in info.state_inputs]
        params = [i for i, (owner, name) in enumerate(slots) if isinstance(owner[name], nn.Parameter)]
        trainable = tuple(slots[i][0][slots[i][1]].requires_grad for i in params)
        sync_key = (tuple(sorted(info.grad_sync_axes.items())), trainable)
        copied = tuple((i, fqn) for i, fqn in enumerate(info.state_inputs) if fqn in info.compute_copies)
        return _Graph(gm, traced.out_spec, traced.loss_index, slots, params, sync_key, casts, copied)

    def _offload_for(self, plan: Plan) -> HostOffload | None:
        """Host masters of the plan's "host" tier parameters, registered in the parameters' place (each name of a
        tied one): `pm.parameters()` yields them, and the optimizer made over it steps them on the host."""
        names = [fqn for fqn in plan.offloaded() if fqn not in self.info.aliases]
        if not names:
            return None
        params = [(fqn, _tensor(self, fqn)) for fqn in names]
        if any(p.is_meta for _, p in params):
            raise LoweringError("offload: the model was built on meta, and the host tier copies each parameter's values "
                                "to the host when the module is made: build the model with its values (on the CPU), or "
                                "leave offload out")
        # a parameter the graph computes on a compute copy keeps only that copy on the device (ZeRO-Offload's layout)
        lean = {fqn: self.info.compute_copies[fqn] for fqn in names if fqn in self.info.compute_copies}
        offload = HostOffload(params, lean)
        master_of = {id(p): offload.masters[fqn] for fqn, p in params}
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if id(p) in master_of:
                    module._parameters[name] = master_of[id(p)]
        return offload

    def _copies_for(self, graph: _Graph, rebuild: bool = False) -> ComputeCopies | None:
        """The compute copies `graph` reads: the module's, made anew when they lack one of its parameters or
        `rebuild` says the masters changed (a conversion, a parameter set anew)."""
        lean = {} if self._offload is None else self._offload.lean  # their copies are the host tier's own
        names = [fqn for _, fqn in graph.copied if fqn not in lean]
        copies = self._copies
        if not names or (copies is not None and not rebuild and set(names) <= set(copies.names)):
            return copies
        held = [] if copies is None else copies.names
        union = held + [n for n in names if n not in held]
        dtype = graph.gm.meta["autopar"].compute_copies[names[0]]  # one policy: one compute dtype
        # a parameter on the host tier is copied from its device copy, which the host master refreshes
        on_device = {} if self._offload is None else self._offload.device_of
        return ComputeCopies([(fqn, on_device.get(fqn, _tensor(self, fqn))) for fqn in union], dtype)

    def _reduce_dtype(self) -> torch.dtype | None:
        return None if self._precision is None else self._precision.reduce_dtype

    def _trainable(self) -> tuple[bool, ...]:
        return tuple(owner[name].requires_grad for owner, name in self._param_slots)

    def _dtypes_read(self) -> tuple[torch.dtype, ...]:
        return tuple(owner[name].dtype for owner, name in self._first.state_slots)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle (`torch.save(pm, path)`) stopped in the process groups with "cannot pickle ProcessGroup"
        raise TypeError(
            "torch.save(pm) / pickle: a parallel module holds this rank's shards and the process groups, which do "
            "not outlive the process. Save pm.state_dict() (full tensors, every rank calls it) or "
            "pm.save_checkpoint(path), and parallelize the model again to load it; for a whole module object, "
            "load pm.state_dict() into the model and save the model")

    def __deepcopy__(self, memo: dict[int, Any]) -> "ParallelModule":
        """A copy with its own parameters and buffers (an EMA of the weights, a frozen eval copy), on the same
        mesh and plan. Process groups cannot be copied and the traces and plans are never changed, so the copy
        shares them; its gradient sync is its own, over its parameters."""
        if self._offload is not None:
            raise LoweringError("copy.deepcopy(pm) with parameters on the host tier (offload): copy pm.state_dict() into "
                                "a model of its own instead (an EMA of the weights, a frozen eval copy)")
        immutable = (*self._graphs, *self._planned, *(g.out_spec for g in self._graphs.values()),
                     *(t for t, _, _ in self._planned.values()))  # signatures, output structures, traces
        for shared in (self.mesh, self.plan, self._retracer, self._sync, *immutable):
            memo[id(shared)] = shared
        memo[id(self._copies)] = None  # made again below, of the copy's own masters
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        new._copies = new._copies_for(new._graph)
        new._own_sync(new._graph)  # not `_sync_to`: that would take the original's hooks off
        track(new)
        watch_optimizers(new)
        return new

    def _meta_read(self) -> bool:
        return any(owner[name].is_meta for owner, name in self._first.state_slots)

    def _apply(self, fn: Callable, recurse: bool = True) -> "ParallelModule":
        """`nn.Module`'s conversions (`to`, `half`, `bfloat16`, `to_empty`, ...), which change the tensors: a graph
        casts to the dtypes it was traced with (HF Llama's RMSNorm casts back to its weight's), so other dtypes
        get a graph of their own, traced with them, and the gradient sync is built again."""
        if self._offload is not None:  # it would move or convert the host masters, not the device copies
            raise LoweringError("pm.to / pm.half / pm.cuda / ...: some parameters are on the host tier (offload), whose "
                                "host masters must stay float32 host tensors; convert the model before parallelize")
        out = super()._apply(fn, recurse)
        for alias, owner in self.info.aliases.items():
            # a conversion across device types (meta -> cpu by `to_empty`, cpu -> cuda) makes a new tensor
            # per name it meets: a tied name the graph module registers is tied to its owner again
            holder, _, name = alias.rpartition(".")
            try:
                alias_params = self.get_submodule(holder)._parameters
            except AttributeError:  # the graph module does not register that name
                continue
            if name in alias_params:
                owner_dict, owner_name = _slot(self, owner)
                alias_params[name] = owner_dict[owner_name]
        self._state_dtypes = self._dtypes_read()
        was_meta, self._on_meta = self._on_meta, self._meta_read()
        if was_meta and not self._on_meta and self.info.unsaved and torch.distributed.get_rank() == 0:
            log.warning("parallel module: off the meta device, uninitialised. A checkpoint (pm.load_checkpoint) fills the "
                        "parameters and persistent buffers, not %s (non-persistent buffers, constants the trace lifted): "
                        "load their values with pm.load_state_dict({name: value, ...}, strict=False)", sorted(self.info.unsaved))
        # a parameter given data of another dtype or device gets a new gradient accumulator (autograd's
        # `set_data`), which the sync's watch does not know: backward would skip the sync (the gradients
        # stayed each rank's own). A conversion is rare; the sync is rebuilt whatever it changed.
        self._sync_to(self._graph)
        return out

    def _use(self, graph: _Graph) -> None:
        self._graph = graph
        object.__setattr__(self, "graph_module", graph.gm)  # not a child: its tensors are already ours

    def _params_read(self) -> list[torch.Tensor]:
        return [owner[name] for owner, name in (self._graph.state_slots[i] for i in self._graph.param_positions)]

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of this rank's inputs (`local_batch`): the loss, detached. The loop a pipeline
        module needs (`PipelineModule.step`, which runs its micro-batches inside), so that one loop trains
        whichever module `parallelize(..., pp="auto")` returns; `loss = pm(...); loss.backward()` is the same."""
        out = self(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UsageError(f"pm.step() trains a model that returns its loss (a one-element tensor, or an output "
                             f"with .loss / ['loss']); this one returned {type(out).__name__}: call pm(...) and "
                             f"backward your own loss instead")
        loss.backward()
        return loss.detach()

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of a GLOBAL batch, as the module's input layout wants it fed.

        'shard': its contiguous slice along each input's batch dim (dim 0 unless `parallelize`'s
        `batch_dim` says otherwise; `autopar.runtime.batch.batch_slice`), ranks in row-major mesh
        order; 'replicate': the whole batch.
        """
        if self.info.input_layout == "replicate":
            return batch
        index = 0
        for c, n in zip(self.mesh.coordinate, self.mesh.shape):
            index = index * n + c
        return batch_slice(batch, index, math.prod(self.mesh.shape), self._traced.batch_dim)

    @property
    def code(self) -> str:
        return self.graph_module.code

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's `no_sync`: backward calls inside leave the data-parallel gradient sync out, so gradients
        accumulate as each rank's own terms over micro-batches; the first synced backward after it reduces all
        of them. Gradients the plan reduces inside the graph (ZeRO's reduce-scatter, tensor-parallel sums) are
        still reduced in each backward."""
        self._syncing = self._sync.enabled = False
        try:
            yield
        finally:
            self._syncing = self._sync.enabled = True

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> frozenset[str]:
        # DistributedDataParallel's constructor reads this (`hasattr`, which lets any other error through).
        # DDP would broadcast rank 0's blocks over the other ranks' and average different blocks' gradients:
        # measured, rank 1's block of a split weight became rank 0's, silently.
        raise AlreadyParallelError(
            "DistributedDataParallel(pm): the parallel module syncs its own gradients, and its parameters are this "
            "rank's blocks of the full ones; DDP would overwrite the other ranks' blocks with rank 0's and average "
            "different blocks' gradients. Train pm itself (pm.no_sync() is DDP's accumulation idiom). A trainer "
            "that wraps every model in DDP (Hugging Face's Trainer, Accelerate's prepare(model), Lightning's DDP "
            "strategy) must leave this module out of that")

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """torch's `Join([pm], optimizer=opt)`: a rank out of batches shadows the others' training steps
        (`runtime.join`); `optimizer` (optional) is brought to the last rank's state when all have joined."""
        return join.ShadowSteps(self, kwargs.get("optimizer"))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> torch.distributed.ProcessGroup:
        """The group of every rank of the mesh (the one `Join` counts the ranks still training over)."""
        return _resolve_process_group(self.mesh.flat_group_name(self.mesh.axis_names))

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live (what `batch.to(model.device)` in a Hugging Face loop wants)."""
        if self._offload is not None:  # its masters are on the host; the graph computes on the device
            return self._offload.device
        return next(iter(self.parameters())).device

    # Under torch.compile (`torch.compile(pm)`, or a compiled loop calling it) the forward runs eagerly, a
    # graph break: dynamo fails inside the gradient sync's `register_hook` (an internal error), and the graph
    # compiled alone breaks at each c10d collective and recompiles per grad mode (gpt2-tiny, 2 ranks: 55 s to
    # compile, steps 20x slower than eager). Gradients and losses are the same either way.
    @torch.compiler.disable(reason="autopar's ParallelModule runs its generated graph eagerly")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._on_meta:
            raise LoweringError("the parameters are on the meta device (the model was built on meta): call "
                                "pm.to_empty(device=...) and load them, e.g. pm.load_checkpoint(path)")
        in_join = self._join_config.enable  # inside torch's `Join`: ranks that ran out of batches shadow this step
        if in_join:
            join.step_begins(self, self._syncing)
        flat, spec = pytree.tree_flatten((args, kwargs))
        autocast = torch.get_autocast_dtype(self._device_type) if torch.is_autocast_enabled(self._device_type) else None
        key = _signature(flat, spec, self.training, self._trainable(), autocast, self._state_dtypes)
        mode = (self.training, torch.is_grad_enabled())
        if self._inputs_must_agree:
            agree(_described(key), self.mesh.cpu_group, _mode_text(mode))
        elif self._modes_must_agree and mode != self._mode and not in_join:  # a training step, checked above
            all_ranks_make(f"pm(...) in {_mode_text(mode)}", self.call_timeout_s)
            self._mode = mode
        if mode == (True, True) and not in_join and self.drift_check_every:  # (a joined rank takes no forwards)
            if self._forwards_since_check >= self.drift_check_every:
                self._check_replicas(f"after {self._forwards_since_check} training steps")
            self._forwards_since_check += 1
        if key != self._key:
            self._use_graph_for(key, flat, spec)
        graph = self._graph
        state = [owner[name] for owner, name in graph.state_slots]
        if any(map(operator.is_not, [state[i] for i in graph.param_positions], self._synced_params)):
            self._sync_to(graph)  # a parameter was set anew since the sync was built
        elif graph.sync_key != self._sync_key and torch.is_grad_enabled():
            self._sync_to(graph)  # another graph's gradients are summed over other axes
        if self._offload is not None:  # the host tier: the graph computes on device copies of the host masters
            self._offload.upload()
            for i, fqn in enumerate(graph.gm.meta["autopar"].state_inputs):
                copy = self._offload.device_of.get(self.info.aliases.get(fqn, fqn))
                if copy is not None:
                    state[i] = copy
        if self._copies is not None and graph.copied:  # mixed precision: the graph computes on the copies, made when
            self._copies.refresh()                         # the masters changed (the host tier's lean ones: above)
            for i, fqn in graph.copied:
                if fqn in self._copies.by_name:
                    state[i] = self._copies.by_name[fqn]
        # a mean loss may leave its division by the count to the sync; autocast's casts, if any, are in the graph
        with grads_scaled_by(self._sync), (torch.autocast(self._device_type, enabled=False) if graph.casts else nullcontext()):
            outs = list(graph.gm(*state, *flat))
        if torch.is_grad_enabled():
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
                self._sync.forbid_deferral()  # their grads would be those of the loss's sum: it keeps its division
            watch, self._watch_outputs = self._watch_outputs, False
            for i, out in enumerate(outs):
                if not (isinstance(out, torch.Tensor) and out.requires_grad):
                    continue
                if i != graph.loss_index:
                    # on an alias: the loss reads the output itself (a model's logits), whose gradient
                    # is computed in every backward; the alias gets one only from the caller's use
                    outs[i] = other_output(out, self._sync)  # gradient entering there stays exact
                    if watch:
                        outs[i].register_hook(self._outside_loss_hook)
                self._sync.watch(outs[i])  # where a backward enters the module: the sync starts there
        return pytree.tree_unflatten(outs, graph.out_spec)

    def _use_graph_for(self, key: _Signature, flat: list[Any], spec: Any) -> None:
        """Switch to the graph of inputs with signature `key`, lowering it first if there is none yet."""
        if key not in self._graphs:
            self._graphs[key] = self._lower_for(key, flat, spec)
        self._key = key
        self._use(self._graphs[key])
        copies = self._copies_for(self._graph)
        if copies is not self._copies:  # it reads a copy the others did not: the sync is made for the new ones
            self._copies = copies
            self._sync_to(self._graph)

    def _lower_for(self, key: _Signature, flat: list[Any], spec: Any) -> _Graph:
        """A graph for inputs of other shapes or values, for eval mode, for autocast, or for parameters frozen or
        unfrozen since: the graph `_plan_for` traced and planned for these inputs, lowered over this module's own
        parameters and buffers (the new graph trains the same tensors) with the parameters frozen that are."""
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in flat]
        mode = ("training" if key.training else "eval") + (f" mode, autocast to {key.autocast}" if key.autocast else " mode")
        mode += ", parameters and buffers in " + ", ".join(sorted({str(d).removeprefix("torch.") for d in key.state_dtypes}))
        start = time.perf_counter()
        inputs = _without_flags(key)
        if inputs not in self._planned:
            self._planned[inputs] = self._plan_for(inputs, flat, spec, shapes, mode)
        traced, plan, how = self._planned[inputs]
        frozen = frozenset(_param_fqns(self._first)[i] for i, t in enumerate(key.trainable) if not t)
        held = {*dict(self.named_parameters(remove_duplicate=False)), *dict(self.named_buffers(remove_duplicate=False))}
        unheld = sorted({*traced.param_fqns.values(), *traced.buffer_fqns.values()} - held - set(traced.constants))
        if unheld:
            raise LoweringError(f"at inputs {shapes} ({mode}) the model reads {unheld[:5]}, which the parallel module "
                                "does not hold: they were no parameters or buffers of the model when it was parallelized "
                                "(made in a forward since?). Create them in the model's constructor and parallelize again")
        try:
            gm = lower(traced, plan, self.mesh, params=dict(self.named_parameters(remove_duplicate=False)),
                       buffers=dict(self.named_buffers(remove_duplicate=False)), input_layout=self.info.input_layout,
                       local=True, frozen=frozen, reduce_dtype=self._reduce_dtype())
        except (ValueError, LoweringError) as err:
            raise LoweringError(f"inputs {shapes} cannot run under this module's plan: {err}; feed sizes its sharded dims "
                                "divide into, or parallelize again with a sample of these sizes") from err
        info: LoweringInfo = gm.meta["autopar"]
        graph = self._graph_of(gm, traced, casts=key.autocast is not None)
        if _param_fqns(graph) != _param_fqns(self._first) or info.param_storage != self.info.param_storage:
            raise LoweringError(f"at inputs {shapes} ({mode}) the model reads its parameters otherwise than the planned "
                                "graph does; parallelize again with a sample of these sizes")
        if torch.distributed.get_rank() == 0:
            level = logging.WARNING if len(self._graphs) >= _MANY_GRAPHS else logging.INFO
            log.log(level, "parallel module: new inputs %s (%s): %s, lowered in %.2f s, graph %d of this "
                    "module; each new shape costs a trace (pad inputs to a few fixed sizes to avoid it)", shapes, mode, how,
                    time.perf_counter() - start, len(self._graphs) + 1)
        return graph

    def _plan_for(self, inputs: _Signature, flat: list[Any], spec: Any, shapes: list[Any], mode: str) -> tuple[TracedGraph, Plan, str]:
        """The model traced on the global batch these local inputs are a slice of (`_graph_to_run`), the plan it
        runs under and what it is: the module's plan when it has the planned graph's ops, else a plan of its own
        that keeps every parameter where the module's plan stores it."""
        if self._retracer is None:
            raise LoweringError(f"inputs {shapes} ({mode}) are not those this module was lowered for, and it "
                                "cannot trace the model again: build it with autopar.parallelize")
        try:
            traced, how = self._graph_to_run(inputs, self._global_batch(flat, spec, shapes))
        except TraceError as err:
            if spec == self._traced.in_spec:
                raise
            raise LoweringError(f"called with arguments {_arguments(spec)}, where the model was first called with "
                                f"{_arguments(self._traced.in_spec)}, and the model does not trace with them: {err}") from err
        difference = _ops_difference(self._traced, traced)
        if difference is None:
            return traced, self.plan, how
        if self._retracer.replan is None:  # code that depends on the sizes, autocast's casts, eval-mode branches
            raise LoweringError(f"at inputs {shapes} ({mode}) the model traces to other ops than the graph its plan "
                                f"was solved for ({difference}), and this module cannot plan another graph: build it with autopar.parallelize")
        plan = self._retracer.replan(traced, self.plan, self.info.buffer_specs)
        return traced, plan, how + f" (it differs at {difference}) under a plan of its own keeping the parameters"

    def _global_batch(self, flat: list[Any], spec: Any, shapes: list[Any]) -> Any:
        """The global batch whose slices these local inputs are (meta tensors), as a sample input is given
        (`tracer.split_sample_input`); logged when it holds more than the sample the plan was solved for."""
        world = math.prod(self.mesh.shape)
        planned_vals = [self._traced.node(n).meta["val"] for n in self._traced.input_names]
        batch_flat = flat
        if self.info.input_layout == "shard":
            _refuse_split_along_other_dim(planned_vals, self._traced.input_batch_dims, flat, world)
            batch_flat = global_like(flat, batch_dims(*pytree.tree_unflatten(flat, spec), self._traced.batch_dim), world)
        planned = _numel(planned_vals)
        if _numel(batch_flat) > planned and torch.distributed.get_rank() == 0:
            whole = self.info.input_layout == "shard" and _numel(flat) == planned  # a global batch fed on every rank?
            log.warning("parallel module: inputs %s hold more elements than the sample the plan was solved for (%d "
                        "against %d): its memory prediction (%.3g GB per device) does not cover them%s", shapes,
                        _numel(batch_flat), planned, self.plan.memory.total_bytes / 1e9,
                        "; if every rank fed the whole batch, each should feed its own slice (pm.local_batch(batch))" if whole else "")
        args, kwargs = pytree.tree_unflatten(batch_flat, spec)
        return CallArguments(args, kwargs) if args and kwargs else kwargs or args

    def _graph_to_run(self, inputs: _Signature, batch: Any) -> tuple[TracedGraph, str]:
        """The model traced on `batch` for `inputs` (`_without_flags` of a signature; under autocast, whose casts
        the graph then holds, if it names a dtype), and what it is. In eval mode, the training graph with dropout
        off when that is all eval mode changes (the training trace of these inputs is reused when there is one)."""
        dtypes = dict(zip(self.info.state_inputs, inputs.state_dtypes))
        known = self._planned.get(inputs._replace(training=True))
        traced = known[0] if known else self._retracer.trace(batch, True, inputs.autocast, dtypes)
        if inputs.training:
            return traced, "the model's graph"
        evaluated = self._retracer.trace(batch, False, inputs.autocast, dtypes)
        if eval_difference(traced, evaluated) is None:
            return without_dropout(traced), "the training graph with dropout off"
        return evaluated, "the eval graph"

    def _sync_to(self, graph: _Graph) -> None:
        """The gradient sync rebuilt for `graph` over the current parameters: when a parameter was set anew on its
        module since the sync was built (`mod.w = nn.Parameter(...)`: the graph reads the new one, whose grad is
        synced, as eager autograd would give it its gradient; an optimizer made before keeps the old one, as in
        eager PyTorch), or when `graph` leaves other gradients to sum (parameters frozen or unfrozen, an eval graph
        under a plan of its own). Sums a sync wrote to parameters that stayed keep their marks (gradient
        accumulation)."""
        old = self._sync
        old.remove()
        self._copies = self._copies_for(graph, rebuild=True)
        self._own_sync(graph)
        self._sync.keep_marks(old)

    def _own_sync(self, graph: _Graph) -> None:
        """A gradient sync of this module's parameters for `graph`, off inside `no_sync()`."""
        if self._copies is not None:
            self._copies.refresh()  # the copies' requires_grad follows the masters' before the sync registers them
        self._sync = _make_grad_sync(self, graph.gm.meta["autopar"], self.mesh, self._copies, self._reduce_dtype())
        self._sync.enabled = self._syncing
        if self._offload is not None:
            self._offload.follow(self._sync)  # the host tier's gradients leave the device as the sync writes them
        self._sync_key = graph.sync_key
        self._synced_params = self._params_read()

    def _outside_loss_hook(self, grad: torch.Tensor) -> None:
        """Gradient enters through an output other than the loss: say once what that trains on."""
        if self._outside_loss_logged:
            return
        self._outside_loss_logged = True
        ranks = math.prod(self.mesh.shape)
        if torch.distributed.get_rank() != 0:
            return
        log.warning(
            "gradient enters the parallel module through an output other than its loss: each rank's rows of "
            "that output are its part of the global batch, and backward follows the SUM over ranks of what each "
            "rank backpropagates. A mean over a rank's own rows (DDP's convention) gives %d times the "
            "single-device gradient: divide it by %d, or compute the loss inside the model. (Logged once.)", ranks, ranks)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`: by the norm of the full gradients across all
        ranks' shards (`runtime.grad_norm.track`; a collective: call it on every rank, after backward), the
        same on every rank."""
        if self._offload is not None:
            self._offload.ready()  # the host masters' gradients, every copy landed
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def expect_equal_blocks(self, *names: str) -> None:
        """Say that these split parameters' blocks are alike on every rank by design (a tensor whose rows are copies
        of one another, set after `parallelize`): the first optimizer step's check for blocks drawn alike by an init
        loop over `pm.parameters()` (`runtime.optimizers`) leaves them out. `parallelize` leaves out those whose full
        tensor had them alike already (Mamba's `A_log`). Call it on every rank alike, before the first step."""
        unknown = sorted(set(names) - set(self.info.param_storage))
        if unknown:
            raise LoweringError(f"expect_equal_blocks: {unknown} are not parameters of this module; its parameters "
                                f"are named as the model's: {sorted(self.info.param_storage)[:5]} ...")
        self.equal_blocks.update(names)

    def param_storage(self) -> Mapping[str, Spec]:
        """How each parameter (by FQN) is stored across the mesh: what this rank's tensor is a block of."""
        return self.info.param_storage

    def apply(self, fn: Callable[[nn.Module], Any]) -> "ParallelModule":  # type: ignore[override]
        """`nn.Module.apply`, each module whole: `fn(module)` runs on every submodule, children first, with that
        module's own parameters and buffers gathered whole, and what it leaves in them is stored back as the plan
        splits them, rank 0's values on every rank (DDP's rule at wrapping: ranks seeded apart agree). So
        `pm.apply(model._init_weights)` initialises as one device does (a model built on meta, after
        `pm.to_empty`). On the blocks alone every rank would draw its block from the same random numbers: a split
        weight's blocks would be copies of one another, silently. A collective: call it on every rank."""
        if self._on_meta:  # (every rank alike: raised before meeting the others)
            raise LoweringError("pm.apply(fn) gathers each module's tensors whole, and the parameters are on the meta "
                                "device (the model was built on meta): call pm.to_empty(device=...) first, then pm.apply(fn)")
        all_ranks_make("pm.apply(fn)", self.call_timeout_s)
        self._apply_whole(self, "", fn, self._specs())
        return self

    def _apply_whole(self, module: nn.Module, prefix: str, fn: Callable[[nn.Module], Any], specs: Mapping[str, Spec]) -> None:
        for name, child in module.named_children():
            if not isinstance(child, fx.GraphModule):  # codegen's outlined regions, no module of the model's
                self._apply_whole(child, f"{prefix}{name}.", fn, specs)
        held = []  # (slots, name, this rank's tensor, its spec, what fn is given there, its version)
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is None:
                    continue
                spec = specs.get(self.info.aliases.get(prefix + name, prefix + name))
                if spec is not None and not spec.is_replicate():
                    full = gather_full(t, spec, self.mesh)
                    slots[name] = nn.Parameter(full, t.requires_grad) if isinstance(t, nn.Parameter) else full
                held.append((slots, name, t, spec, slots[name], slots[name]._version))
        try:
            fn(module)
        finally:
            with torch.no_grad():
                for slots, name, t, spec, given, version in held:
                    left = slots[name]
                    slots[name] = t
                    if left is given and given._version == version:
                        continue  # untouched
                    whole = left.detach().contiguous()
                    torch.distributed.broadcast(whole, src=0)
                    t.copy_(whole if spec is None or spec.is_replicate() else local_shard(whole, spec, self.mesh))

    # ------------------------------------------------------------ full state dicts
    def _specs(self) -> dict[str, Spec]:
        specs = dict(self.info.param_storage)
        specs.update(self.info.buffer_specs)
        return specs

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """Full (gathered) tensors by FQN, on every rank (a collective): the keys of the model's own
        `state_dict()`, tied names included, non-persistent buffers left out."""
        local, specs = self._shard_specs()
        self._gathers("pm.state_dict()", specs)
        return full_state_dict(local, specs, self.mesh)

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's local shards by FQN (what `torch.distributed.checkpoint` saves with the plan's specs).

        The graph module holds a tied tensor under the names the graph reads and registers its
        buffers as persistent, so the keys are made the model's here: each tied name, and no
        non-persistent buffer or constant the trace lifted."""
        own = {k: t for k, t in nn.Module.state_dict(self, keep_vars=True).items() if k not in self.info.unsaved}
        for alias, owner in self.info.aliases.items():
            own.setdefault(alias, own[owner])
        return own

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Load FULL tensors: each rank keeps its block per the plan's storage specs. A tied tensor is
        loaded from whichever of its names `state_dict` has (the first, if several). Buffers outside the
        model's state dict (non-persistent ones, lifted constants) are loaded when given, never missing:
        a model built on meta gets their values so."""
        specs = self._specs()
        own = self.sharded_state_dict()
        loadable = {**own, **{k: t for k, t in nn.Module.state_dict(self, keep_vars=True).items() if k in self.info.unsaved}}
        full: dict[str, torch.Tensor] = {}
        for k, v in state_dict.items():
            if k in loadable:
                full.setdefault(self.info.aliases.get(k, k), v.to(loadable[k].device))
        missing = sorted(k for k in own if self.info.aliases.get(k, k) not in full)
        unexpected = sorted(set(state_dict) - set(loadable))
        if strict and (missing or unexpected):
            raise LoweringError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}; pass strict=False to load the intersection")
        owners = {k: t for k, t in loadable.items() if k not in self.info.aliases}
        load_full_state_dict(owners, full, {fqn: specs[fqn] for fqn in owners}, self.mesh, strict=False)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # ------------------------------------------------------------ optimizer state and checkpoints
    # The optimizer is the user's, over this module's shards. torch's FQN-keyed optimizer state dict
    # (`get_optimizer_state_dict`: state by parameter name, a lazily made state created first) is the format;
    # `runtime.state_dict` splits and joins its per-element tensors as the parameters are split.
    def _shard_specs(self) -> tuple[dict[str, torch.Tensor], dict[str, Spec]]:
        """This rank's shards by FQN (tied names included) and each one's storage spec."""
        specs = self._specs()
        local = self.sharded_state_dict()
        return local, {fqn: specs[self.info.aliases.get(fqn, fqn)] for fqn in local}

    def _gathers(self, what: str, specs: Mapping[str, Spec]) -> None:
        """Before `what` gathers split tensors, every rank must be making it (a plan that splits none gathers
        nothing: rank 0 alone may call it, as under DDP)."""
        if any(not spec.is_replicate() for spec in specs.values()):
            all_ranks_make(what, self.call_timeout_s)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer`'s state as one device's, full tensors by parameter name, on every rank (a collective):
        what torch's `get_optimizer_state_dict(model, optimizer)` gives for the unsplit model."""
        local, specs = self._shard_specs()
        self._gathers("pm.optimizer_state_dict(optimizer)", specs)
        return gather_optimizer_state(get_optimizer_state_dict(self, optimizer), local, specs, self.mesh)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
        """Load one device's optimizer state (`optimizer_state_dict`'s, or torch's `get_optimizer_state_dict`
        of the unsplit model) into `optimizer`: each rank keeps its blocks."""
        local, specs = self._shard_specs()
        set_optimizer_state_dict(self, optimizer, shard_optimizer_state(state_dict, local, specs, self.mesh))

    def save_checkpoint(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                        extra: dict[str, Any] | None = None, background: bool = False,
                        keep_last: int = 2) -> Future | None:
        """Write this module's parameters and buffers and `optimizer`'s state as the next checkpoint under the
        directory `path`, each rank its shards with torch.distributed.checkpoint (a collective). The checkpoint
        is published whole or not at all (`runtime.checkpoints`: a crash at any moment leaves the checkpoints
        before it as they were), and the newest `keep_last` are kept. It loads under any plan or mesh
        (`load_checkpoint(path)`: the newest) and into one device's model and optimizer with torch alone
        (`dcp.load` of `runtime.checkpoints.latest_checkpoint(path)`, keys "model" and "optim", as torch's
        `get_state_dict`).
        extra: other state every rank holds alike, saved under "extra" (the loop's step, a scheduler's
        `state_dict()`, a data generator's state): tensors, numbers, strings, and lists and dicts of them.
        background: return once the state is copied aside and write it while training goes on; the returned
        future completes when the checkpoint is published (the next save or load waits for it first)."""
        local, specs = self._shard_specs()
        all_ranks_make(f"pm.save_checkpoint({os.fspath(path)!r})", self.call_timeout_s)
        self._check_replicas("before saving a checkpoint")  # a drifted copy would be saved as the only one
        osd = None if optimizer is None else get_optimizer_state_dict(self, optimizer)
        extra = {**(extra or {}), _MASKS_RNG: rng.masks_state()}  # so a resumed run draws the masks it would have
        return save_sharded(local, specs, self.mesh, path, osd, extra, background, keep_last)

    def _check_replicas(self, when: str) -> None:
        """Raise `DriftError` on every rank if the copies of a replicated parameter differ (a collective)."""
        check_replicas(self.named_parameters(), self.info.param_storage, self.mesh, when, self.drift_check_every)
        self._forwards_since_check = 0

    def load_checkpoint(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                        extra: dict[str, Any] | None = None) -> str:
        """Fill the parameters, buffers and `optimizer`'s state from the newest checkpoint `save_checkpoint` wrote
        under `path` under any plan or mesh, or from `path` itself when it is one checkpoint (torch's `dcp.save` of
        one device's `get_state_dict`, a Hugging Face model directory) (a collective). Every file is checked against
        the checksums saved with it first: a corrupt checkpoint raises, naming the file and tensor, and loads nothing.
        extra: a dict with the keys of the saved `extra` to read; each value is replaced in place.
        Returns the directory read."""
        local, specs = self._shard_specs()
        all_ranks_make(f"pm.load_checkpoint({os.fspath(path)!r})", self.call_timeout_s)
        directory = checkpoint_to_load(path)
        osd = None if optimizer is None else get_optimizer_state_dict(self, optimizer)
        wanted = dict(extra or {})
        if _MASKS_RNG in saved_extra(directory):  # (a checkpoint of torch's `dcp.save` or an older one has none)
            wanted[_MASKS_RNG] = rng.masks_state()
        loaded = load_sharded(local, specs, self.mesh, directory, osd, wanted or extra)
        if _MASKS_RNG in wanted:
            rng.set_masks_state(wanted.pop(_MASKS_RNG))
        if extra:
            extra.update(wanted)
        if optimizer is not None:
            set_optimizer_state_dict(self, optimizer, loaded)
        return directory


def _signature(flat: list[Any], spec: pytree.TreeSpec, training: bool, trainable: tuple[bool, ...],
               autocast: torch.dtype | None, state_dtypes: tuple[torch.dtype, ...]) -> _Signature:
    """The signature of a forward on the flattened inputs `flat`, structured as `spec`."""
    return _Signature(training, trainable, autocast, state_dtypes, spec,
                      tuple((x.shape, x.dtype) if isinstance(x, torch.Tensor) else _leaf_key(x) for x in flat))


_MASKS_RNG = "autopar_masks_rng"  # the random ops' generator in a checkpoint's extra state (`runtime.rng`)


@functools.lru_cache(maxsize=4)  # asked every forward of a plan whose ranks agree on each forward
def _mode_text(mode: tuple[bool, bool]) -> str:
    training, grad = mode
    return f"{'training' if training else 'eval'} mode with gradients {'on' if grad else 'off'}"


@functools.lru_cache(maxsize=_MANY_GRAPHS)  # asked every forward, with the few signatures a loop feeds
def _described(key: _Signature) -> str:
    """What ranks must agree on, in words: 'training, (0 positional; input_ids, labels): (8, 16) int64, ...'."""
    inputs = ", ".join(_input_text(x) for x in key.inputs)
    autocast = f", autocast to {key.autocast}" if key.autocast else ""
    return f"{'training' if key.training else 'eval'}{autocast}, {_arguments(key.structure)}: {inputs}"


def _input_text(x: Any) -> str:
    """One input of a signature: a tensor's '(8, 16) int64', another input's value."""
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], torch.Size):
        shape, dtype = x
        return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
    return repr(x)


def _arguments(spec: pytree.TreeSpec) -> str:
    """The arguments a call's input structure gives: '(2 positional; input_ids, labels)'."""
    args, kwargs = spec.children()
    return f"({args.num_children} positional; {', '.join(kwargs.context) or 'no keywords'})"


def _without_flags(key: _Signature) -> _Signature:
    """A graph's signature without the parameters' requires_grad flags: what its trace and plan depend on."""
    return key._replace(trainable=None)


def _leaf_key(x: Any) -> Any:
    """A non-tensor input as traced: export specialises the graph on its value (its type, if unhashable)."""
    return x if isinstance(x, (int, float, bool, str, type(None))) else type(x)


def _local_inputs(traced: TracedGraph, input_layout: str, world: int) -> list[Any]:
    """The inputs (flattened, as `forward` gets them) each rank feeds for the batch `traced` was traced on."""
    vals = [traced.node(name).meta["val"] for name in traced.input_names]
    vals = [torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v for v in vals]
    return vals if input_layout == "replicate" else slice_leaves(vals, traced.input_batch_dims, 0, world)


def _ops_difference(planned: TracedGraph, traced: TracedGraph) -> str | None:
    """None when `traced` has the planned graph's ops (node names and targets, in order); else the first that differs."""
    ours = [f"{n.name}: {op_name(n)}" for n in planned.graph.nodes]
    theirs = [f"{n.name}: {op_name(n)}" for n in traced.graph.nodes]
    if ours == theirs:
        return None
    return next((f"'{y}' where the plan has '{x}'" for x, y in zip(ours, theirs) if x != y), "a different number of ops")



def _refuse_split_along_other_dim(planned: list[Any], dims: tuple[int | None, ...], fed: list[Any], world: int) -> None:
    """Raise when every batched tensor this rank fed is the planned global batch with one dim other than its batch
    dim cut by the number of ranks: the ranks split the batch along that dim (a sequence-first model, `(T, B)`,
    fed as DDP feeds it, its batch columns, where the module takes rows), and the module, reading each rank's
    inputs as its slices along the batch dims, would take the slices for another batch (`(ranks * T, B / ranks)`:
    sequences joined end to end) and train on it without an error."""
    tensors = [(tuple(p.shape), tuple(f.shape), d) for p, f, d in zip(planned, fed, dims)
               if d is not None and isinstance(p, torch.Tensor) and isinstance(f, torch.Tensor) and p.dim() == f.dim() > 1]
    if world == 1 or not tensors:
        return
    cuts = [next((k for k, (a, b) in enumerate(zip(p, f)) if a != b), None) for p, f, _ in tensors]
    cut = cuts[0]
    if cut is None or any(c != cut for c in cuts) or any(d == cut for _, _, d in tensors):
        return
    if all(f[cut] * world == p[cut] and p[:cut] + p[cut + 1:] == f[:cut] + f[cut + 1:] for p, f, _ in tensors):
        takes = sorted({d for _, _, d in tensors})
        raise LoweringError(
            f"each rank fed inputs {[f for _, f, _ in tensors]}: the batch the plan was solved for, "
            f"{[p for p, _, _ in tensors]}, cut along dim {cut} over the {world} ranks. This module takes each rank's "
            f"slice along the batch dim ({'dims' if len(takes) > 1 else 'dim'} {', '.join(map(str, takes))}, in rank "
            f"order) and would read these as slices of another batch. Feed pm.local_batch(global_batch) on every rank, "
            f"or build the module with autopar.parallelize(..., batch_dim={cut}) to feed each rank its slice along dim "
            f"{cut}, as this loop does")


def _numel(values: list[Any]) -> int:
    return sum(v.numel() for v in values if isinstance(v, torch.Tensor))


def _param_fqns(graph: _Graph) -> list[str]:
    return [graph.gm.meta["autopar"].state_inputs[i] for i in graph.param_positions]


def _tensor(module: nn.Module, fqn: str) -> torch.Tensor:
    owner, name = _slot(module, fqn)
    return owner[name]


def _slot(module: nn.Module, fqn: str) -> tuple[dict[str, torch.Tensor], str]:
    """The dict holding parameter or buffer `fqn` of `module`, and its key there."""
    owner_path, _, name = fqn.rpartition(".")
    owner = module.get_submodule(owner_path)
    return (owner._parameters if name in owner._parameters else owner._buffers), name


def _make_grad_sync(module: nn.Module, info: LoweringInfo, mesh: ProcessMesh, copies: ComputeCopies | None = None,
                    reduce_dtype: torch.dtype | None = None) -> GradSync:
    """Bucketed sync of the grads the graph leaves partial: one group spanning all of a parameter's axes. A parameter
    read as its compute copy is synced as the copy, into its master (with no group if nothing is summed), in
    `reduce_dtype` as every gradient is."""
    params = dict(module.named_parameters())
    offload = getattr(module, "_offload", None)
    if offload is not None:  # the host tier's gradients are the device copies' (moved to the masters after)
        params.update(offload.device_of)
    # every rank builds the flattened groups in the same (graph) order: group creation is collective
    entries, masters = [], {}
    lean = {} if offload is None else offload.lean
    for fqn, axes in info.grad_sync_axes.items():
        axes = tuple(k for k in axes if mesh.shape[k] > 1)  # a one-rank axis has nothing to sum
        groups = (mesh.flat_group_name(axes),) if axes else ()
        if fqn in lean:  # the host tier's compute copy: summed in a host bucket into its host master
            entries.append((fqn, offload.device_of[fqn], groups))
            masters[fqn] = offload.masters[fqn]
        elif copies is not None and fqn in info.compute_copies:
            entries.append((fqn, copies.by_name[fqn], groups))
            masters[fqn] = params[fqn]
        elif axes:
            entries.append((fqn, params[fqn], groups))
    return GradSync(entries, scaled=params.values(), reduce_dtype=reduce_dtype, masters=masters, hosted=lean)
