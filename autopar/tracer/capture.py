"""Capture a model's training-mode forward as a core-ATen fx graph on fake tensors.

We reuse `torch.export.export(strict=False)` (works on Hugging Face transformers
5.x, which dropped its own fx tracer) followed by `run_decompositions()` to core
ATen, keeping scaled-dot-product attention as one node so the solver can split it
by heads. With the model on the `meta` device no parameter memory is touched, so a
70B-parameter shape traces on a laptop.

Parameters, buffers and user inputs all become placeholders of the graph; the
`TracedGraph` records which placeholder is which (parameters by fully qualified
name: that is what a plan refers to).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

import sympy
import torch
from torch import fx, nn
from torch._decomp import core_aten_decompositions
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from autopar.compat import FAKE_DEVICE_MISMATCH
from autopar.errors import TraceError
from autopar.gc_pause import gc_paused
from autopar.tracer import custom_backward, data_sizes
from autopar.tracer.attention import canonicalize_attention
from autopar.tracer.bags import split_equal_bags
from autopar.tracer.batch_dims import BatchDim, batch_dims
from autopar.tracer.call_arguments import split_sample_input
from autopar.tracer.checks import localize_checks
from autopar.tracer.copies import copy_decomposition
from autopar.tracer.exported import Exported
from autopar.tracer.known_noise import known_noise_filtered
from autopar.tracer.cse import eliminate_common_subexpressions
from autopar.tracer.masked_writes import masks_as_where
from autopar.tracer.no_grad import detach_no_grad_inputs, stops_visible_to_export
from autopar.tracer.python_random import python_draws_reported
from autopar.tracer.repeated_blocks import export_stamped, find_stack
from autopar.tracer.restride import drop_identity_as_strided
from autopar.tracer.source_lines import in_library, node_line
from autopar.tracer.sparse_grads import densify_sparse_gradients

log = logging.getLogger(__name__)

# Ops we keep whole instead of decomposing. Attention: the solver has rules for it (split by
# heads/batch). SiLU: decomposed it becomes x * sigmoid(x), whose autograd saves the sigmoid as
# well as x; whole, it saves x only, as eager does (one activation less per MLP).
_KEEP_WHOLE = (
    torch.ops.aten.detach.default,  # a gradient stop: decomposed, it is an `alias` gradients flow through (no_grad.py)
    torch.ops.aten.silu.default,
    torch.ops.aten.scaled_dot_product_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
)


@dataclass(frozen=True)
class TracedGraph:
    """The captured model: a core-ATen GraphModule plus what each placeholder and output means."""

    gm: fx.GraphModule
    param_fqns: Mapping[str, str]  # placeholder name -> parameter FQN
    buffer_fqns: Mapping[str, str]  # placeholder name -> buffer FQN
    input_names: tuple[str, ...]  # user-input placeholders, in pytree-flattened order of (args, kwargs)
    in_spec: pytree.TreeSpec  # structure of (args, kwargs) of the sample input
    out_spec: pytree.TreeSpec  # structure of the user outputs
    output_names: tuple[str | None, ...]  # per flattened user output: producing node name (None for constants)
    loss_index: int | None  # which flattened user output is the training loss (first float scalar)
    buffer_mutations: Mapping[str, str] = field(default_factory=dict)  # output node name -> buffer FQN it updates
    # output node name -> the user input placeholder it updates (`labels[labels == pad] = -100` in the forward)
    input_mutations: Mapping[str, str] = field(default_factory=dict)
    # output node name -> the frozen parameter's FQN it updates (a momentum encoder's `k.data = ...`)
    param_mutations: Mapping[str, str] = field(default_factory=dict)
    tied_params: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # canonical FQN -> other names of it
    symbols: Mapping[str, sympy.Symbol] = field(default_factory=dict)  # "batch"/"seq" -> the graph's symbol
    # tensors the forward makes from Python values (DeBERTa's `torch.tensor(head_dim)`): FQN (among
    # `buffer_fqns`' values, not the model's) -> the value, as export lifted it
    constants: Mapping[str, torch.Tensor] = field(default_factory=dict)
    nonpersistent_buffers: frozenset[str] = frozenset()  # buffers the model's state_dict leaves out (RoPE's inv_freq)
    # which dim of each input holds the batch, as the caller gave it (`tracer.batch_dims`: 0, another int, or one
    # per input), and as it reads on the sample: per user input (`input_names`), its dim or None (fed whole)
    batch_dim: BatchDim = 0
    input_batch_dims: tuple[int | None, ...] = ()
    model_name: str = ""  # the traced model's class name, for messages about it

    def batch_dim_of(self) -> dict[str, int | None]:
        """User input placeholder name -> its batch dim (None: fed whole)."""
        return dict(zip(self.input_names, self.input_batch_dims, strict=True))

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def node(self, name: str) -> fx.Node:
        for n in self.gm.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} in the traced graph")

    def num_ops(self) -> int:
        return sum(1 for n in self.gm.graph.nodes if n.op == "call_function")

    def frozen_params(self) -> frozenset[str]:
        """Placeholders of parameters that take no gradient (`requires_grad=False`: a frozen base model)."""
        return frozenset(ph for ph in self.param_fqns if not self.node(ph).meta["val"].requires_grad)


@gc_paused
def trace(
    model: nn.Module,
    sample_input: Any,
    dynamic_dims: Mapping[str, int] | None = None,
    training: bool = True,
    batch_dim: BatchDim = 0,
) -> TracedGraph:
    """Capture `model`'s training forward on `sample_input` as a core-ATen graph.

    training=False captures the eval-mode forward instead: a `ParallelModule` in eval mode checks
    with it that the model computes what its training graph does but for dropout (`codegen.eval_mode`).
    training=True captures a model in training mode with its submodules' own modes (batch norm a
    fine-tuning loop keeps in eval mode stays so); a model in eval mode as `model.train()` leaves it.
    Either way every module's mode is as it was afterwards.

    batch_dim: which dim of each input holds the batch (`tracer.batch_dims`): dim 0 by default, 1 for a
    sequence-first model's `(seq, batch)` inputs, or one per input (`(1, 0)` for `(x, labels)`). The graph
    does not depend on it; how ranks feed their parts of the batch does (`runtime.batch`).

    dynamic_dims: e.g. {"batch": 0, "seq": 1}: every input tensor dimension with
    that index whose size equals the first input's size there becomes the named
    symbol (sizes must be >= 2; export specialises 0 and 1).
    """
    args, kwargs = split_sample_input(sample_input)
    dims = batch_dims(args, kwargs, batch_dim)  # before the capture: a batch_dim that does not fit fails at once
    modes = {m: m.training for m in model.modules()}
    if not (training and model.training):
        model.train(training)
    start = time.perf_counter()
    try:
        with without_kv_cache(model), custom_backward.recorded(type(model).__name__) as functions, known_noise_filtered():
            ep = _export(model, args, kwargs, dynamic_dims)
    except TraceError:  # refused by a check of ours while export ran: it names the line already
        raise
    except Exception as err:  # re-raised with the user's line: any capture failure lands here
        raise _trace_error(model, err) from err
    finally:
        for module, mode in modes.items():
            module.training = mode
    custom_backward.check(functions, type(model).__name__)
    _refuse_parameter_mutations(ep, type(model).__name__)
    _drop_runtime_asserts(ep.gm)
    canonicalize_attention(ep.gm)
    drop_identity_as_strided(ep.gm)
    densify_sparse_gradients(ep.gm)  # before the bags: a dense bag can be split
    split_equal_bags(ep.gm)
    localize_checks(ep.gm)
    eliminate_common_subexpressions(ep.gm)  # first: `x[m] = f(x[m])` computes its mask twice
    masks_as_where(ep.gm)
    data_sizes.refuse_data_dependent_sizes(ep.gm, type(model).__name__)
    traced = _from_exported(ep, args, kwargs, dynamic_dims or {}, _canonical_param_names(model))
    traced = replace(traced, batch_dim=batch_dim, input_batch_dims=dims, model_name=type(model).__name__)
    log.info("tracer: %d ops in %.2f s", traced.num_ops(), time.perf_counter() - start)
    return traced


def _export(model: nn.Module, args: tuple, kwargs: dict, dynamic_dims: Mapping[str, int] | None) -> Exported:
    """torch.export's capture, decomposed to core ATen but for `_KEEP_WHOLE`: a deep stack of identical
    blocks captured two blocks deep and copied (`repeated_blocks`), any other model whole."""
    dynamic_shapes = _dynamic_shapes(args, kwargs, dynamic_dims) if dynamic_dims else None
    with warnings.catch_warnings():
        # torch 2.13's own deep copies of pytree specs warn about its own deprecated LeafSpec:
        # nothing a user can act on, printed once per trace.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        # nn.LSTM / nn.GRU / nn.RNN set `_flat_weights` (views of their own parameters) in their forward, and
        # export asks for them to be buffers: the module is torch's, so the user cannot, and the graph reads the
        # parameters themselves (the RNN models train like one device: `benchmarks/torch_models.py`)
        warnings.filterwarnings("ignore", message=r"The tensor attributes self\.\S*_flat_weights\[", category=UserWarning)
        name = type(model).__name__

        def export() -> torch.export.ExportedProgram:
            with stops_visible_to_export(name), _distributions_unchecked(), _sync_batch_norm_as_batch_norm(), python_draws_reported(name):
                ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
            detach_no_grad_inputs(ep.graph_module)  # before the decompositions inline the blocks
            decomps = {op: fn for op, fn in core_aten_decompositions().items() if op not in _KEEP_WHOLE}
            decomps[torch.ops.aten.copy.default] = copy_decomposition  # torch has neither a derivative nor a decomposition
            return ep.run_decompositions(decomps)

        stack = find_stack(model)
        stamped = export_stamped(model, stack, export) if stack is not None else None
        return stamped if stamped is not None else Exported.of(export())


@contextlib.contextmanager
def _distributions_unchecked() -> Iterator[None]:
    """torch.distributions' argument checks off while export runs (restored after).

    `Normal(mu, sigma)` checks by default that sigma is positive, a Python `if` on tensor values
    that export cannot trace (a VAE's reparameterised sample stopped with "data-dependent control
    flow" at the constructor). The checks only raise for arguments a trained model does not give;
    the values and the graph are the same without them. A distribution built with an explicit
    `validate_args=True` still checks, and still stops."""
    validating = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(validating)


@contextlib.contextmanager
def _sync_batch_norm_as_batch_norm() -> Iterator[None]:
    """`nn.SyncBatchNorm` traced as batch norm (its forward restored after).

    DDP loops convert batch norm to SyncBatchNorm (`convert_sync_batchnorm`) for statistics of the
    global batch. With a process group up its forward all-gathers the statistics, which export
    cannot trace (and on CPU or meta tensors it refuses to run: "expected input tensor to be on
    GPU"). Its math is what the plan gives batch norm anyway: statistics of the global batch when
    the batch is split (`solver.strategies.rules_batch_norm`). So it is traced as the batch norm it
    is on one device, which is also its own forward when no process group is up."""
    forward = nn.SyncBatchNorm.forward
    nn.SyncBatchNorm.forward = nn.modules.batchnorm._BatchNorm.forward
    try:
        yield
    finally:
        nn.SyncBatchNorm.forward = forward


@contextlib.contextmanager
def without_kv_cache(model: nn.Module) -> Iterator[None]:
    """A Hugging Face model with its KV cache off (`config.use_cache`, on by default) while it is captured.

    The cache is for generation: a training step never reads it, and returned as an output it is
    an object torch.export cannot capture (`DynamicCache`). The parallel module's outputs therefore
    carry `past_key_values=None`. Every submodule's config is switched (T5's decoder stack holds a
    copy of its own) and restored afterwards, whatever happens. The profiler's reference measurement
    (`benchmarks/profiler_accuracy.py --hf`) runs the eager model under it too, as traced."""
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


# Export's runtime checks of input metadata: they produce nothing and the shapes are in node.meta
# already; left in, every later stage would have to plan, price and lower an op that does no work.
_RUNTIME_ASSERTS = (torch.ops.aten._assert_tensor_metadata.default,)


def _drop_runtime_asserts(gm: fx.GraphModule) -> None:
    asserts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _RUNTIME_ASSERTS and not n.users]
    for node in asserts:
        gm.graph.erase_node(node)
    if asserts:  # the code of a graph of thousands of nodes takes a tenth of a second to write again
        gm.recompile()


def _refuse_parameter_mutations(ep: Exported, model_name: str) -> None:
    """A forward that changes a trained parameter in place (`nn.Embedding(max_norm=...)` renormalises the
    rows it looks up) cannot be parallelized: the optimizer owns its shards, and their gradients are of the
    values before the change. A frozen one (`requires_grad=False`: MoCo's momentum encoder, moved toward the
    query encoder in the forward) is written back like a buffer (`TracedGraph.param_mutations`)."""
    outs = next(n for n in reversed(ep.gm.graph.nodes) if n.op == "output").args[0]
    for spec, out in zip(ep.output_specs, outs):
        if spec.kind == OutputKind.PARAMETER_MUTATION and ep.state_dict[spec.target].requires_grad:
            raise TraceError(
                f"cannot trace {model_name}: the forward changes parameter `{spec.target}` in place at "
                f"{node_line(out)}\n"
                f"  fix: change it outside the forward (after optimizer.step(), under torch.no_grad()); for "
                f"nn.Embedding(max_norm=...), renormalise the rows there instead of passing max_norm. A frozen "
                f"parameter (requires_grad=False) may be changed in the forward")


def _dynamic_shapes(args: tuple, kwargs: dict, dynamic_dims: Mapping[str, int]):
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    if not tensors:
        raise TraceError("dynamic_dims needs at least one tensor input")
    ref = tensors[0]
    dims = {name: Dim(name, min=2) for name in dynamic_dims}
    per_leaf = []
    for leaf in flat:
        if not isinstance(leaf, torch.Tensor):
            per_leaf.append(None)
            continue
        mapping = {}
        for name, d in dynamic_dims.items():
            if d < leaf.dim() and d < ref.dim() and leaf.shape[d] == ref.shape[d]:
                mapping[d] = dims[name]
        per_leaf.append(mapping or None)
    dyn_args, dyn_kwargs = pytree.tree_unflatten(per_leaf, spec)
    # export wants dynamic_shapes shaped like the signature: positional args as a tuple, then kwargs by name.
    return tuple(dyn_args) + tuple(dyn_kwargs.values()) if dyn_kwargs else tuple(dyn_args)


def _canonical_param_names(model: nn.Module) -> dict[str, str]:
    """Every name of every parameter -> its canonical name (the one `named_parameters()` reports)."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    return {name: canonical[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def _from_exported(
    ep: Exported,
    args: tuple,
    kwargs: dict,
    dynamic_dims: Mapping[str, int],
    canonical: Mapping[str, str],
) -> TracedGraph:
    gm = ep.gm
    param_fqns, buffer_fqns, input_names, constants, nonpersistent = {}, {}, [], {}, set()
    kept: dict[str, fx.Node] = {}  # canonical FQN -> the one placeholder that stands for it
    tied: dict[str, list[str]] = {}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for spec in ep.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            # Export gives a tied weight one placeholder per name; a plan must see one parameter.
            fqn = canonical.get(spec.target, spec.target)
            node = placeholders[name]
            if fqn in kept:
                node.replace_all_uses_with(kept[fqn])
                gm.graph.erase_node(node)
                tied.setdefault(fqn, []).append(spec.target)
                continue
            kept[fqn] = node
            param_fqns[name] = fqn
            if spec.target != fqn:
                tied.setdefault(fqn, []).append(spec.target)
        elif spec.kind == InputKind.BUFFER:
            buffer_fqns[name] = spec.target
            if not spec.persistent:
                nonpersistent.add(spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            buffer_fqns[name] = spec.target
            constants[spec.target] = ep.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            input_names.append(name)
    gm.recompile()
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = output_node.args[0]
    output_names, buffer_mutations, input_mutations, param_mutations = [], {}, {}, {}
    for spec, out in zip(ep.output_specs, outs):
        if spec.kind == OutputKind.USER_OUTPUT:
            output_names.append(out.name if isinstance(out, fx.Node) else None)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            buffer_mutations[out.name] = spec.target
        elif spec.kind == OutputKind.PARAMETER_MUTATION:  # a frozen one (`_refuse_parameter_mutations`)
            param_mutations[out.name] = canonical.get(spec.target, spec.target)
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            input_mutations[out.name] = spec.target
    loss_index = None
    for i, name in enumerate(output_names):
        val = _val_of(gm, name)
        if isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point():
            loss_index = i
            break
    _, in_spec = pytree.tree_flatten((args, kwargs))
    return TracedGraph(
        gm=gm,
        param_fqns=param_fqns,
        buffer_fqns=buffer_fqns,
        input_names=tuple(input_names),
        in_spec=in_spec,
        out_spec=ep.out_spec,
        output_names=tuple(output_names),
        loss_index=loss_index,
        buffer_mutations=buffer_mutations,
        input_mutations=input_mutations,
        param_mutations=param_mutations,
        tied_params={k: tuple(v) for k, v in tied.items()},
        symbols=_symbols(gm, dynamic_dims),
        constants=constants,
        nonpersistent_buffers=frozenset(nonpersistent),
    )


def _val_of(gm: fx.GraphModule, name: str | None):
    nodes = {n.name: n for n in gm.graph.nodes}
    return nodes[name].meta.get("val") if name in nodes else None


def _symbols(gm: fx.GraphModule, dynamic_dims: Mapping[str, int]) -> dict[str, sympy.Symbol]:
    """Map 'batch'/'seq' to the sympy symbol export gave that dim (read off the first user input)."""
    if not dynamic_dims:
        return {}
    out: dict[str, sympy.Symbol] = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for name, d in dynamic_dims.items():
            if name not in out and d < val.dim() and isinstance(val.shape[d], torch.SymInt):
                out[name] = val.shape[d].node.expr
    return out


# ---------------------------------------------------------------- errors


def _chain(err: BaseException) -> Iterator[BaseException]:
    """`err` and the errors it was raised from or during (torch wraps errors), each once."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _user_frame(err: BaseException) -> traceback.FrameSummary | None:
    """Deepest frame of the failure that lies in the user's code (not torch, autopar or the stdlib)."""
    best = None
    for e in _chain(err):
        for fs in traceback.extract_tb(e.__traceback__):
            if in_library(fs.filename):
                continue
            best = fs
    return best


# nn.Transformer, nn.TransformerEncoder/Decoder and their layers compare a given mask with a causal one
# (`bool((mask == causal).all())`) unless told whether it is causal: a test on values export cannot make
_CAUSAL_MASK_CHECK = (
    "torch's transformer modules testing whether an attention mask is causal (a test on its values)",
    "say it: pass is_causal=True (nn.Transformer and nn.TransformerDecoder: tgt_is_causal=True) with a causal mask, "
    "or is_causal=False with any other, and torch does not read the mask to find out")


# nn.RNN/LSTM/GRU on a PackedSequence size their state by its batch sizes, tensor values
_PACKED_SEQUENCE = (
    "a recurrent layer run on a packed sequence (`pack_padded_sequence`: its batch sizes are tensor values)",
    "run it on the padded batch, whose outputs up to each length are the packed ones in a unidirectional layer, and "
    "read each sequence's last state as `out[torch.arange(batch), lengths - 1]`; mask padded steps out of the loss")


def _in_packed_rnn(err: BaseException) -> bool:
    """Whether the failure happened in torch's recurrent layers with a PackedSequence input."""
    for e in _chain(err):
        for frame, _ in traceback.walk_tb(e.__traceback__):
            if frame.f_code.co_filename.endswith(os.path.join("nn", "modules", "rnn.py")) and any(
                    isinstance(v, torch.nn.utils.rnn.PackedSequence) for v in frame.f_locals.values()):
                return True
    return False


def _in_torch_function(err: BaseException, name: str) -> bool:
    """Whether the failure passed through a function called `name`."""
    return any(fs.name == name for e in _chain(err) for fs in traceback.extract_tb(e.__traceback__))


# (words of torch's error, one string or several, any of which names it; the construct; its fix)
_KNOWN_FIXES = (
    ("you need to register a pytree", "an output of a type torch cannot take apart",
     "return tensors, or tuples, lists, dicts and dataclasses of them; turn off what returns the object "
     "(a Hugging Face model's KV cache is turned off for you: `config.use_cache`), or register its type "
     "with torch.utils._pytree.register_pytree_node"),
    # `int(t)` / `t.item()` made a Python number for an index or a size (MoCo's queue pointer): export
    # cannot pick one value for every step
    ("Could not extract specialized integer", "a tensor's value read as a Python number (`int(t)`, `t.item()`) "
     "for an index or a size",
     "keep it a tensor and index with it, e.g. `queue.index_copy_(1, (ptr + torch.arange(n)) % size, keys.T)` "
     "and `ptr.add_(n).remainder_(size)`, so the graph computes it at every step"),
    # the copy the tracer runs is on meta or fake tensors; a real tensor it reaches past the copy is on another device
    (FAKE_DEVICE_MISMATCH, "a tensor the forward reaches outside the model's own parameters and buffers (a "
     "module or tensor kept in a global or a class attribute) or makes on a fixed device",
     "reach parameters and buffers through the model's attributes (`self.mlp(x)`), and make new tensors on an "
     "input's device (`torch.zeros(n, device=x.device)`)"),
    ("data-dependent", "data-dependent control flow",
     "replace the Python `if`/`while` on a tensor value with torch.where / torch.cond, or make the branch depend on shapes only"),
    ("is not supported", "an unsupported operation", "rewrite the construct with standard torch ops"),
    ("Unsupported", "an unsupported operation", "rewrite the construct with standard torch ops"),
)


def _trace_error(model: nn.Module, err: BaseException) -> TraceError:
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    construct, fix = "a construct torch.export cannot capture", "see the torch message above; simplify that line"
    for needles, what, how in _KNOWN_FIXES:
        if any(needle in str(err) for needle in ((needles,) if isinstance(needles, str) else needles)):
            construct, fix = what, how
            break
    if any(isinstance(e, DynamicOutputShapeException) for e in _chain(err)):  # export cannot size its output (ctc_loss)
        construct, fix = f"{data_sizes.WHAT} (`{message}`)", data_sizes.UNSIZED_FIX
    if _in_torch_function(err, "_detect_is_causal_mask"):
        construct, fix = _CAUSAL_MASK_CHECK
    if _in_packed_rnn(err):
        construct, fix = _PACKED_SEQUENCE
    frame = _user_frame(err)
    where = f"{frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)" if frame else "an unknown line"
    return TraceError(
        f"cannot trace {type(model).__name__}: {construct} at {where}\n"
        f"  torch says: {message}\n"
        f"  fix: {fix}"
    )
