"""The Plan: every decision the solver made, as plain data.

A plan names nodes by their fx name and op (never by list index), so it can
be checked against a freshly traced model. `autopar.solver.plan_io` turns it
into JSON and back (never pickle) and computes/compares the fingerprint.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from autopar.solver.mesh import Mesh
from autopar.solver.spec import Spec, Strategy
from autopar.tracer.param_layouts import Layout

SCHEMA_VERSION = 1
Tier = Literal["device", "host"]
TIERS: tuple[Tier, ...] = ("device", "host")


@dataclass(frozen=True)
class NodeDecision:
    node: str  # fx node name in the traced graph
    op: str  # str(node.target), e.g. "aten.mm.default"; "placeholder"/"output" for those
    strategy: Strategy
    recompute: bool = False  # saved activations freed after forward, recomputed in backward
    module: str = ""  # module path that produced the node (for reports)


@dataclass(frozen=True)
class ParamDecision:
    fqn: str
    node: str  # placeholder name
    use: Spec  # how the graph consumes the parameter (= the placeholder's output spec)
    storage: Spec  # how it is kept between steps; differs from `use` under ZeRO (sharded over dp axes)
    # its layout relative to its module's math (`tracer.param_layouts`): which dim a split of it is Megatron's
    # column- or row-parallel; "" in plan files written without it (reports then name the dim split)
    layout: Layout = ""
    # where its optimizer state lives and its step runs (`runtime.offload`): "device", or "host" (pinned host
    # memory, stepped there by the user's optimizer; the device holds the parameter and its gradient)
    tier: Tier = "device"

    @property
    def zero(self) -> bool:
        return self.storage != self.use


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted per-device bytes at the training step's peak."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float  # saved for backward, not recomputed
    temp_bytes: float  # largest transient (temporaries, gathered ZeRO params, recompute regions)
    budget_bytes: float | None
    # per rank in host memory (the "host" tier, `solver.offload`): the masters, their gradients, their optimizer state
    host_params_bytes: float = 0.0
    host_grads_bytes: float = 0.0
    host_optimizer_bytes: float = 0.0

    @property
    def host_bytes(self) -> float:
        return self.host_params_bytes + self.host_grads_bytes + self.host_optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes + self.temp_bytes


@dataclass(frozen=True)
class TimeBreakdown:
    """Predicted seconds of one training step (forward + backward + optimizer)."""

    compute_s: float  # forward, backward and the optimizer's step
    comm_s: float  # collectives inside strategies + resharding + gradient sync
    recompute_s: float
    update_s: float = 0.0  # of compute_s: the optimizer's step on this device's parameter blocks
    # the host tier (`solver.offload`): gradients device-to-host, the host's optimizer step, parameters back
    offload_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.recompute_s + self.offload_s


@dataclass(frozen=True)
class SolverReport:
    backend: str  # "highs" or "cbc"
    # "optimal", "time_limit", "fixed" (plan given by the caller), "leanest" (the time-optimising search found
    # no plan within the budget in time: the leanest plan, which fits)
    status: str
    solve_s: float
    num_variables: int
    num_constraints: int
    gap: float | None = None  # relative optimality gap when the time limit was hit


@dataclass(frozen=True)
class Fingerprint:
    """What a plan was made for; each part is compared separately so a mismatch can say what differs."""

    ops_sha: str  # node names + ops in order
    shapes_sha: str  # node shapes + dtypes
    params_sha: str  # parameter FQNs + shapes
    mesh_shape: tuple[int, ...]
    hardware: str
    budget_bytes: float | None
    # parameter FQN -> shape, in graph order: lets a mismatch name the parameter that changed, not just a hash
    param_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    model: str = ""  # the planned model's class name, so a plan loaded for another model can say which it was made for


@dataclass(frozen=True)
class PlanSource:
    """How the planned model was built, so `autopar explain` can trace it again (unset when planned from Python)."""

    model_file: str = ""  # MODEL.py path as given, or "" for an --hf-config preset
    hf_config: str = ""  # "gpt2" / "llama" preset name, when used instead of a file
    batch_size: int | None = None  # passed to build() only when given
    seq_len: int | None = None
    size: str | None = None  # build(size=...) passthrough (zoo files: "tiny", "small", ...)
    optimizer: str = "adamw"
    precision: str = ""  # `autopar plan --precision`: "fp32", "tf32", "bf16" (mixed precision); "" as fp32


@dataclass(frozen=True)
class BaselineResult:
    """A textbook plan (pure DP, ZeRO-3/FSDP, Megatron TP+DP) priced by the same cost model, for comparison."""

    name: str
    time: TimeBreakdown | None  # None when the baseline cannot be built on this mesh
    memory: MemoryBreakdown | None
    fits: bool  # total memory within the budget


@dataclass(frozen=True)
class Plan:
    fingerprint: Fingerprint
    mesh: Mesh
    nodes: tuple[NodeDecision, ...]
    params: tuple[ParamDecision, ...]
    memory: MemoryBreakdown
    time: TimeBreakdown
    solver: SolverReport
    schema_version: int = SCHEMA_VERSION
    notes: tuple[str, ...] = field(default=())  # warnings the user should read (ops planned replicate-only, ...)
    source: PlanSource | None = None  # how to rebuild the model (set by the CLI)
    comm_bytes_by_kind: tuple[tuple[str, float], ...] = ()  # per-device bytes per step per collective kind
    baselines: tuple[BaselineResult, ...] = ()  # the same cost model's price for textbook plans
    # per-device bytes through the step as the memory model counts them (`solver.timeline`): (where, bytes) from
    # the step's start through forward to the peak and back through backward; its largest value is memory's
    # total_bytes. Empty in plan files written without it.
    memory_timeline: tuple[tuple[str, float], ...] = ()

    def node(self, name: str) -> NodeDecision:
        for d in self.nodes:
            if d.node == name:
                return d
        raise KeyError(f"plan has no decision for node {name!r}")

    def made_for(self) -> str:
        """The planned model as the plan records it: "GPT2LMHeadModel (examples/hf_gpt2.py)" (its file when the CLI
        planned it), "" when it records none."""
        src = self.source
        where = "" if src is None else src.model_file or (f"--hf-config {src.hf_config}" if src.hf_config else "")
        name = self.fingerprint.model
        return f"{name} ({where})" if name and where else name or where

    def offloaded(self) -> tuple[str, ...]:
        """FQNs of the parameters whose optimizer state lives on the host (`ParamDecision.tier`)."""
        return tuple(p.fqn for p in self.params if p.tier == "host")

    def recomputed(self) -> tuple[str, ...]:
        return tuple(d.node for d in self.nodes if d.recompute)

    def on_mesh(self) -> Plan:
        """This plan with Replicate on every mesh axis of one device (`Spec.on_mesh`): what codegen lowers.
        The solver prices a Shard or Partial there as a Replicate (no collective, the whole tensor), so a
        tie may pick either: a one-device plan could otherwise run vocabulary-parallel cross-entropy."""
        shape = tuple(self.mesh.shape)
        if all(n > 1 for n in shape):
            return self
        return replace(self,
                       nodes=tuple(replace(d, strategy=d.strategy.on_mesh(shape)) for d in self.nodes),
                       params=tuple(replace(p, use=p.use.on_mesh(shape), storage=p.storage.on_mesh(shape))
                                    for p in self.params))
