"""The host tier priced: what keeping a parameter's optimizer state on the host saves and costs.

A parameter on the "host" tier (`ParamDecision.tier`, `runtime.offload`) keeps its master, its gradient's
host copy and its optimizer state in host memory, and is stepped there by the user's optimizer; the device
keeps the tensor forward and backward compute on and its gradient. Per step it pays:

- its gradient device-to-host and its updated value host-to-device, over the host link
  (`Mesh.host_link_bytes_per_s`: PCIe 4/5 in the GPU presets);
- the optimizer's step on the host (`HOST_ADAMW_PARAMS_PER_S`), in place of the device's.

The runtime copies gradients when backward ends and parameters before the next forward, and steps when the
user calls `opt.step()`, so none of it overlaps compute: the price is the sum (`TierCost.step_s`).

Under mixed precision a parameter computed on a compute copy and not ZeRO-sharded takes ZeRO-Offload's layout
(`runtime.offload`, `lean`): the device keeps its bf16 copy alone, neither the float32 master nor its gradient
(`TierCost.lean_bytes_saved`), and the link carries the copy's dtype each way (`lean_transfer_s`). Its gradient is on
the device only in flight, in the sync's buckets (`lean_in_flight_bytes`). `TierCost.layout(factor)` is the tier as a
block of 1/factor of the parameter runs it: ZeRO storage (factor > 1) keeps the float32 layout.

The solver weighs the tier per parameter (`parallelize(offload="auto")`, `autopar plan --offload auto`): each
parameter option carries its `TierCost` (`problem.Option.host`) and the ILP decides the tier beside sharding,
ZeRO and recompute, under a host-memory budget per rank (`host_budget_per_rank`). A forced tier
(`offload="optimizer"` or names) pins the named parameters to the host tier: the profile keeps no device state for
them and each option carries their tier (`problem.Option.forced_host`, `forced_tier`), which the ILP prices as it prices a
chosen tier with h fixed to 1, so their sharding, ZeRO storage and recompute are chosen knowing what the tier keeps on
the device (ZeRO-Offload's layout or the float32 one) and what it costs:

    cost = tier_cost(profile.params[fqn], shard=2, mesh=mesh)   # one parameter's two tiers, per rank
    profile = offloaded_profile(profile, names)                   # their tier forced: no device state for them
    plan = with_offload(solve(traced, profile, mesh), names)      # the solved plan, `names` marked on the host tier
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from typing import AbstractSet, Iterable

from autopar.profiler.types import GraphProfile, ParamCost, ParamProfile
from autopar.solver.cost import compute_time_s
from autopar.solver.mesh import HOST_LINKS, Mesh
from autopar.solver.plan import Plan
from autopar.solver.spec import Shard, Spec

# torch.optim.AdamW(foreach=True) on float32 CPU tensors: 2.1e8 parameters a second of one core's CPU time,
# measured on this project's CI machine (16 tensors of 2**20 elements, torch 2.13, one thread; best of five
# steps). A training host steps with several cores (torch's CPU ops split large tensors over its intra-op
# threads): the default assumes 8, about what the copies over the memory bus allow (AdamW reads 4 and writes 3
# float32 tensors, 28 bytes a parameter: 47 GB/s at this rate).
HOST_ADAMW_PARAMS_PER_S_PER_CORE = 2.1e8
HOST_CORES = 8
HOST_ADAMW_PARAMS_PER_S = HOST_ADAMW_PARAMS_PER_S_PER_CORE * HOST_CORES


@dataclass(frozen=True)
class TierCost:
    """One parameter's block on one rank (1/`shard` of it) on the host tier, against the device tier."""

    device_bytes_saved: float  # its optimizer state, off the device
    host_params_bytes: float  # its master
    host_grads_bytes: float  # its gradient's host copy
    host_optimizer_bytes: float  # its optimizer state
    transfer_s: float  # the gradient device-to-host, the updated value host-to-device
    host_step_s: float  # the optimizer's step on the host
    device_step_s: float  # the device's optimizer step it replaces
    # ZeRO-Offload's layout (mixed precision, the parameter computed on a copy): the master and its gradient off the
    # device, the copy's bf16 bytes each way over the link, and the gradient in flight (its copy's and its sum's
    # bytes: `lean_in_flight_bytes`). 0 without a copy.
    lean_bytes_saved: float = 0.0
    lean_transfer_s: float = 0.0
    copy_grad_bytes: float = 0.0
    summed_grad_bytes: float = 0.0

    @property
    def lean(self) -> bool:
        return self.lean_bytes_saved > 0

    def layout(self, factor: float) -> TierCost:
        """The tier of a block of 1/`factor` of the parameter (ZeRO storage over `factor` ranks: float32 layout) or of
        the whole block (factor 1: ZeRO-Offload's layout where the parameter has a copy)."""
        if factor > 1:
            return replace(self.scaled(factor), lean_bytes_saved=0.0, lean_transfer_s=0.0, copy_grad_bytes=0.0,
                           summed_grad_bytes=0.0)
        return replace(self, transfer_s=self.lean_transfer_s) if self.lean else self

    @property
    def step_s(self) -> float:
        """What the host tier adds to a step (the runtime overlaps none of it with compute)."""
        return self.transfer_s + self.host_step_s

    @property
    def host_bytes(self) -> float:
        return self.host_params_bytes + self.host_grads_bytes + self.host_optimizer_bytes

    def scaled(self, factor: float) -> TierCost:
        """The same parameter's block of 1/`factor` of this one (ZeRO storage over `factor` more ranks)."""
        return TierCost(*(getattr(self, f.name) / factor for f in fields(self)))


# what a gradient in flight is one of: a parameter's, or the layer's largest in a tied class (a sum of them never is)
_LARGEST = ("copy_grad_bytes", "summed_grad_bytes")


def summed(costs: Iterable[TierCost]) -> TierCost:
    """The tier of several parameters at once (a tied class of layers: `problem._sum`)."""
    costs = list(costs)
    return TierCost(*((max if f.name in _LARGEST else sum)(getattr(c, f.name) for c in costs) for f in fields(TierCost)))


def lean_in_flight_bytes(tier: TierCost, bucket_bytes: float, total_bytes: float) -> float:
    """The device bytes of lean gradients in flight with `tier`'s parameter on the host tier (`runtime.grad_sync`'s host
    buckets): a bucket at its launch, its copies' gradients and its packed sum (`bucket_bytes` of the reduce dtype, or
    the parameter's alone where larger), beside the next bucket's copies' gradients as backward fills it; at most every
    lean gradient at once, `total_bytes` (of copies and sums)."""
    if not tier.lean or not tier.summed_grad_bytes:
        return 0.0
    summed_bytes = max(bucket_bytes, tier.summed_grad_bytes)
    copies_bytes = summed_bytes * tier.copy_grad_bytes / tier.summed_grad_bytes
    return min(total_bytes, summed_bytes + 2 * copies_bytes)


# Of the machine's physical memory, what the host tier may take by default: the rest is the OS's, the data
# loaders' and the process's own (the model's host copy while it is parallelized, pinned staging buffers).
HOST_MEMORY_SHARE = 0.75


def machine_memory_bytes() -> float:
    """This machine's physical memory (`os.sysconf`)."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def host_budget_per_rank(host_memory_bytes: float | None, ranks_per_host: int) -> float:
    """Host bytes each of `ranks_per_host` ranks may keep on the host tier: `host_memory_bytes` of the machine
    (default: `HOST_MEMORY_SHARE` of this machine's physical memory) split evenly between them."""
    total = HOST_MEMORY_SHARE * machine_memory_bytes() if host_memory_bytes is None else float(host_memory_bytes)
    return total / max(1, ranks_per_host)


def storage_shard(spec: Spec, mesh: Mesh) -> int:
    """Into how many blocks `spec` splits a parameter over `mesh`: each rank stores one."""
    return math.prod(n for p, n in zip(spec.placements, mesh.shape) if isinstance(p, Shard))


def tier_cost(param: ParamProfile | ParamCost, shard: float, mesh: Mesh, host_params_per_s: float = HOST_ADAMW_PARAMS_PER_S) -> TierCost:
    """The host tier of `param`'s block of 1/`shard` of it on a rank of `mesh` (a frozen parameter, which the
    optimizer never steps, saves and costs nothing)."""
    if not param.optimizer_bytes:
        return TierCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    # (under mixed precision param_bytes holds the master and its compute copy, which stays on the device)
    param_bytes, grad_bytes = (param.param_bytes - param.copy_bytes) / shard, param.grad_bytes / shard
    copy_bytes = param.copy_bytes / shard
    device_step_s = param.update_launches * mesh.op_overhead_s + compute_time_s(0.0, param.update_write_bytes / shard, mesh)
    return TierCost(
        device_bytes_saved=param.optimizer_bytes / shard,
        host_params_bytes=param_bytes,
        host_grads_bytes=grad_bytes,
        host_optimizer_bytes=param.optimizer_bytes / shard,
        transfer_s=(grad_bytes + param_bytes) / mesh.host_link_bytes_per_s,
        # a mesh without a host link (CPU, hand-made) is its own host: the step runs on the same cores and memory
        host_step_s=param.numel / shard / host_params_per_s if mesh.hardware in HOST_LINKS else device_step_s,
        device_step_s=device_step_s,
        lean_bytes_saved=param_bytes + grad_bytes if copy_bytes else 0.0,
        lean_transfer_s=2 * copy_bytes / mesh.host_link_bytes_per_s,
        copy_grad_bytes=copy_bytes,
        summed_grad_bytes=(param.grad_bytes if param.reduce_bytes is None else param.reduce_bytes) / shard if copy_bytes else 0.0,
    )


def offloaded_profile(profile: GraphProfile, names: AbstractSet[str]) -> GraphProfile:
    """`profile` with `names` on the host tier by the caller's choice: no optimizer state on the device for them
    and no step there (`cost.optimizer_step_s`), their state kept as `host_optimizer_bytes`, from which the solver
    prices the tier they are forced to (`forced_tier`)."""
    if not names:
        return profile
    params = {fqn: replace(p, optimizer_bytes=0, host_optimizer_bytes=p.optimizer_bytes)
              if fqn in names else p for fqn, p in profile.params.items()}
    return replace(profile, params=params)


def forced_tier(param: ParamProfile | ParamCost, shard: float, mesh: Mesh) -> TierCost | None:
    """The host tier `param` is forced to (`offloaded_profile`), of its block of 1/`shard` on a rank of `mesh`; None
    for a parameter the caller left to the device or to the solver."""
    if not param.host_optimizer_bytes:
        return None
    return tier_cost(replace(param, optimizer_bytes=param.host_optimizer_bytes), shard, mesh)


def with_offload(plan: Plan, names: AbstractSet[str]) -> Plan:
    """`plan` (solved for `offloaded_profile(profile, names)`, which priced their tier) with `names` marked on the
    host tier."""
    if not names:
        return plan
    return replace(plan, params=tuple(replace(p, tier="host") if p.fqn in names else p for p in plan.params))
