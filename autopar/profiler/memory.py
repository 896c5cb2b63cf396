"""Training-step memory model: peak live bytes of forward + backward + optimizer step.

A simulation over the graph at concrete sizes, modelling what eager autograd on
the same graph does (the measurement in `measure.py` is its reference):

forward   each op allocates its non-view outputs (and any extra saved tensors);
          a tensor is freed after its last forward use unless kept for backward.
backward  ops run in reverse; an op's step allocates the gradients of its inputs
          (a first gradient of a tensor becomes its buffer, later ones are
          accumulated and dropped) and its scratch; then the gradient of its own
          outputs and the saved tensors whose last saver it is are freed.
          Parameter gradients stay (grads are set to None between steps).
optimizer parameters + grads + state + the step's own scratch.

Recomputation follows `torch.utils.checkpoint(use_reentrant=False)` per region:
tensors saved by recomputed ops are not kept; the region's inputs are; when
backward reaches a region its saved tensors are rebuilt at once. Recomputed
nodes are grouped into regions by `region_of` (default: the transformer block,
i.e. the module path up to its first numeric component, `transformer.h.3`, as codegen's regions
are cut; `block_call_of` makes each call of a block its own region, as checkpointing a block's
forward in eager does).
"""
from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Collection

import torch
from torch import fx

from autopar.profiler.graph import GraphFacts, Ref, analyze
from autopar.profiler.profile import optimizer_key
from autopar.profiler.types import ConcreteProfile
from autopar.tracer import TracedGraph, module_path, tensor_args
from autopar.tracer.nodes import fqn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryEstimate:
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float  # live at the end of forward: saved activations (not recomputed) + region inputs
    temp_bytes: float  # largest single scratch allocation (an op's or the optimizer step's)
    peak_bytes: float  # the one number: max live bytes over the whole step
    inputs_bytes: float = 0.0  # user inputs and buffers, live for the whole step
    peak_phase: str = ""  # "forward", "backward" or "optimizer"


def block_of(node: fx.Node) -> str:
    """The enclosing repeated block of a node: its module path up to the first numeric component."""
    m = re.match(r"^(.*?\.\d+)(\.|$)", module_path(node))
    return m.group(1) if m else ""


def block_call_of(node: fx.Node) -> str:
    """`block_of`, told apart per call: a block run twice (ALBERT runs its one shared layer at every depth) is two
    regions, as `torch.utils.checkpoint` around the block's forward makes it. torch.export numbers a module's
    later calls in the keys of `nn_module_stack` ("...albert_layer_groups.0@1")."""
    block = block_of(node)
    for key, (path, _cls) in (node.meta.get("nn_module_stack") or {}).items():
        if block and fqn(path) == block:
            return block + key[key.index("@"):] if "@" in key else block
    return block


def optimizer_step_temp_bytes(optimizer: str, param_bytes: list[float], foreach: bool = False) -> float:
    """Scratch of one `optimizer.step()` (torch.optim defaults, grads already computed).

    Adam/AdamW single-tensor path (CPU default): `denom = (exp_avg_sq.sqrt() / c).add_(eps)`
    holds two temporaries of one parameter's size. The foreach path (CUDA default)
    takes `_foreach_sqrt` of every state at once: about one copy of all parameters.
    SGD (with or without momentum, no weight decay) updates in place.
    """
    if optimizer_key(optimizer) not in ("adam", "adamw") or not param_bytes:
        return 0.0
    return sum(param_bytes) if foreach else 2 * max(param_bytes)


def storage_facts(traced: TracedGraph, profile: ConcreteProfile) -> GraphFacts:
    """`analyze` with the copies the profiler priced as views (see profile.elided_copies) taken as aliases."""
    elided = frozenset(n.name for n in traced.graph.nodes if n.op == "call_function"
                       and n.target is torch.ops.aten.clone.default and not any(profile.nodes[n.name].output_bytes))
    return analyze(traced, elided)


def peak_memory(
    traced: TracedGraph,
    profile: ConcreteProfile,
    recompute: Collection[str] = frozenset(),
    *,
    region_of: Callable[[fx.Node], str] = block_of,
    foreach: bool = False,
) -> MemoryEstimate:
    """Simulated peak bytes of one training step; `recompute` holds node names to rebuild in backward."""
    cost = profile.nodes
    nodes = [n for n in traced.graph.nodes if n.op == "call_function"]
    facts = storage_facts(traced, profile)
    pos = {n.name: i for i, n in enumerate(nodes)}
    recompute = set(recompute)

    params = sum(p.param_bytes for p in profile.params.values())
    grads = sum(p.grad_bytes for p in profile.params.values())
    opt_state = sum(p.optimizer_bytes for p in profile.params.values())
    inputs = sum(
        sum(cost[n.name].output_bytes)
        for n in traced.graph.nodes
        if n.op == "placeholder" and n.name not in traced.param_fqns and n.name in cost
    )
    static = params + opt_state + inputs

    size: dict[Ref, float] = {}  # storage-owning tensors made by ops
    for n in nodes:
        for i, b in enumerate(cost[n.name].output_bytes):
            if b > 0:
                size[(n.name, i)] = b
    last_use: dict[Ref, int] = {r: pos[r[0]] for r in size}
    for n in nodes:
        for r in facts.arg_refs[n.name]:
            b = facts.base[r]
            if b in size:
                last_use[b] = max(last_use[b], pos[n.name])
    # A training step keeps only the loss of what forward returns (the caller drops the rest, e.g. logits).
    loss = traced.output_names[traced.loss_index] if traced.loss_index is not None else None
    outputs = {a.name for n in traced.graph.nodes if n.op == "output" for a in n.all_input_nodes}
    for name in outputs if loss is None else (loss,):
        b = facts.base.get((name, 0))
        if b in size:
            last_use[b] = len(nodes)  # lives until backward

    # Regions of recomputed nodes, and where each kept tensor is released in backward.
    region: dict[str, str] = {n.name: region_of(n) for n in nodes if n.name in recompute}
    members: dict[str, list[str]] = defaultdict(list)
    for name, key in region.items():
        members[key].append(name)
    release: dict[Ref, int] = {}  # kept tensor -> backward position after which it is freed

    def keep(b: Ref, at: int) -> None:
        if b in size:
            release[b] = min(release.get(b, at), at)

    rebuilt: dict[str, list[Ref]] = defaultdict(list)  # region -> saved tensors rebuilt when backward enters it
    rebuilt_release: dict[Ref, int] = {}
    if loss is not None and facts.base.get((loss, 0)) in size:
        keep(facts.base[(loss, 0)], pos[loss])  # freed once backward has started from it
    for n in nodes:
        c = cost[n.name]
        if n.name not in recompute:
            for b in c.saved_refs:
                keep(b, pos[n.name])
            continue
        key = region[n.name]
        for b in c.saved_refs:
            if b in size and region.get(b[0]) == key:
                rebuilt[key].append(b)
                rebuilt_release[b] = min(rebuilt_release.get(b, pos[n.name]), pos[n.name])
        first = min(pos[m] for m in members[key])
        for r in facts.arg_refs[n.name]:  # region inputs: checkpoint keeps them
            b = facts.base[r]
            if b in size and region.get(b[0]) != key:
                keep(b, first)
    entry = {key: max(pos[m] for m in names) for key, names in members.items()}

    live = static
    peak, phase = live, "forward"
    largest_temp = 0.0
    freed_at: dict[int, list[Ref]] = defaultdict(list)
    for b, p in last_use.items():
        if b not in release:  # rebuilt tensors too: they are dropped now and rebuilt in backward
            freed_at[p].append(b)
    for n in nodes:
        c = cost[n.name]
        live += sum(c.output_bytes)
        if n.name not in recompute:
            live += c.extra_saved_bytes
        largest_temp = max(largest_temp, c.temp_bytes)
        if live + c.temp_bytes > peak:
            peak, phase = live + c.temp_bytes, "forward"
        for b in freed_at[pos[n.name]]:
            live -= size[b]
        log.debug("memory: forward %s live %.0f", n.name, live)
    activations = live - static

    grad_buf: dict[Ref, float] = {}
    param_refs = {(name, 0) for name in traced.param_fqns}
    value_bytes = {n.name: cost[n.name].value_bytes for n in traced.graph.nodes if n.name in cost}
    release_at: dict[int, list[Ref]] = defaultdict(list)
    for b, p in release.items():
        release_at[p].append(b)
    rebuilt_at: dict[int, list[Ref]] = defaultdict(list)
    for b, p in rebuilt_release.items():
        if b not in release:
            rebuilt_at[p].append(b)
    entered: set[str] = set()
    for n in reversed(nodes):
        c = cost[n.name]
        i = pos[n.name]
        key = region.get(n.name)
        if key is not None and key not in entered and i == entry[key]:
            entered.add(key)
            live += sum(size[b] for b in dict.fromkeys(rebuilt[key]) if b not in release)
            live += sum(cost[m].extra_saved_bytes for m in members[key])
        # Views pass gradients through.
        if c.requires_grad and not all(facts.aliases.get(n.name, (False,))):
            transient = c.temp_bytes
            for a, r in zip(tensor_args(n), facts.arg_refs[n.name]):
                if a.op == "placeholder" and a.name not in traced.param_fqns:
                    continue
                if not cost.get(a.name) or not cost[a.name].requires_grad:
                    continue
                nbytes = value_bytes[a.name][0] if value_bytes.get(a.name) else 0.0
                b = facts.base[r]
                if b in param_refs:
                    full = sum(p.grad_bytes for p in profile.params.values() if p.node == b[0])
                else:
                    full = size.get(b, nbytes)
                have = grad_buf.get(b, 0.0)
                if have >= full:
                    transient += nbytes  # accumulated into the existing buffer, then dropped
                else:
                    grad_buf[b] = have + nbytes
                    live += nbytes
            largest_temp = max(largest_temp, c.temp_bytes)
            if live + transient > peak:
                peak, phase = live + transient, "backward"
            for j in range(len(c.output_bytes)):
                if (n.name, j) in grad_buf and (n.name, j) not in param_refs:
                    live -= grad_buf.pop((n.name, j))
        for b in release_at[i] + rebuilt_at[i]:
            live -= size[b]
        live -= c.extra_saved_bytes
        log.debug("memory: backward %s live %.0f", n.name, live)
    log.debug("memory: %.0f bytes left after backward (expected %.0f)", live, static + grads)

    step_temp = optimizer_step_temp_bytes(
        profile.optimizer, [p.param_bytes - p.copy_bytes for p in profile.params.values()], foreach=foreach
    )
    largest_temp = max(largest_temp, step_temp)
    if static + grads + step_temp > peak:
        peak, phase = static + grads + step_temp, "optimizer"
    return MemoryEstimate(
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=opt_state,
        activations_bytes=activations,
        temp_bytes=largest_temp,
        peak_bytes=peak,
        inputs_bytes=inputs,
        peak_phase=phase,
    )
