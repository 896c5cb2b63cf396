"""The copies of each replicated parameter compared across ranks, by a checksum of their bits.

    check_replicas(pm.named_parameters(), pm.param_storage(), pm.mesh, "after 100 training steps")

A parameter stored Replicate on a mesh axis has one copy per rank of that axis, and the
copies stay equal only because every rank applies the same update to the same values.
Something done on one rank alone (a gradient hook or an optimizer hook registered there, an
in-place edit, a learning rate read from a per-rank config) parts them without any error:
measured, a hook on rank 1 left the copies 8.8e-4 apart after 3 steps, and a checkpoint
then held a mix of the ranks' copies (DCP writes each replicated tensor once, from one rank).

The check sums each local tensor's bits as integers (one pass over the parameters, a few
microseconds per megabyte), gathers every rank's sums in one all-gather of
`world x (parameters + mesh axes + 1)` integers, and compares the sums of each parameter
within each set of ranks holding copies of the same block: the same result on every rank,
so every rank raises or none does. A difference names the parameter, the ranks, and how far
apart the copies are (one more all-gather, of that parameter, on the way to the error).
`ParallelModule` runs it every `drift_check_every` training forwards and before every save.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from autopar.errors import DriftError
from autopar.runtime import comm
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.spec import Shard, Spec

_INTEGER_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_NAMED = 5  # parameters named in the error beyond the first


def checksum(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t`'s elements read as integers of their size (a 0-d int64 tensor on `t`'s device): equal
    copies give equal sums; a change that does not cancel out exactly gives another."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_INTEGER_OF_SIZE[flat.element_size()]).sum(dtype=torch.int64)


def _replica_key(spec: Spec, coordinate: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """What identifies the block a rank holds: its coordinates on the axes that split the parameter."""
    return tuple(c for c, p, n in zip(coordinate, spec.placements, shape) if isinstance(p, Shard) and n > 1)


def check_replicas(params: Iterable[tuple[str, torch.Tensor]], specs: Mapping[str, Spec], mesh: ProcessMesh,
                   when: str, every_steps: int) -> None:
    """Raise `DriftError` on every rank when the copies of some replicated parameter differ (a collective).
    when: what the check follows, for the message; every_steps: how often it runs, for the message."""
    replicated = [(fqn, t) for fqn, t in params
                  if any(not isinstance(p, Shard) and n > 1 for p, n in zip(specs[fqn].placements, mesh.shape))]
    if not replicated:  # (the same on every rank: the plan says which parameters are replicated)
        return
    device = replicated[0][1].device
    mine = torch.stack([torch.tensor(torch.distributed.get_rank(), dtype=torch.int64, device=device),
                        *(torch.tensor(c, dtype=torch.int64, device=device) for c in mesh.coordinate),
                        *(checksum(t).to(device) for _, t in replicated)])
    group = mesh.flat_group_name(range(mesh.ndim))
    rows = comm.all_gather(mine, group).view(-1, mine.numel()).tolist()
    drifted = []
    for i, (fqn, _) in enumerate(replicated):
        copies: dict[tuple[int, ...], dict[int, list[int]]] = {}  # block -> checksum -> ranks
        for row in rows:
            key = _replica_key(specs[fqn], tuple(row[1:1 + mesh.ndim]), mesh.shape)
            copies.setdefault(key, {}).setdefault(row[1 + mesh.ndim + i], []).append(row[0])
        split = next((by_sum for by_sum in copies.values() if len(by_sum) > 1), None)
        if split is not None:
            drifted.append((i, fqn, sorted(split.values())))
    if drifted:
        raise DriftError(_message(drifted, replicated, group, when, every_steps))


def _message(drifted: list, replicated: list, group: str, when: str, every_steps: int) -> str:
    i, fqn, parts = drifted[0]
    local = replicated[i][1].detach()
    copies = comm.all_gather(local.reshape(-1), group).view(-1, local.numel())  # every rank's, in group order
    ranks = torch.distributed.get_process_group_ranks(torch.distributed.distributed_c10d._resolve_process_group(group))
    first = {r: copies[ranks.index(r)] for r in (part[0] for part in parts)}
    apart = max((first[a].double() - first[b].double()).abs().max().item() for a in first for b in first)
    others = [f for _, f, _ in drifted[1:]]
    also = f"; {len(others)} more drifted too: {others[:_NAMED]}{' ...' if len(others) > _NAMED else ''}" if others else ""
    holders = " against ".join(f"ranks {part}" for part in parts)
    every = f"every {every_steps} training steps and " if every_steps else ""
    return (f"the copies of replicated parameter {fqn} differ across ranks {when}: {holders} hold different values, "
            f"up to {apart:.3g} apart{also}. Every rank applies the same update to its copy, so something changed "
            "one rank's alone: a gradient or optimizer hook registered on some ranks only, an in-place edit on one "
            "rank, an optimizer whose settings differ between ranks. Make every such change on every rank alike. "
            f"(Checked {every}before every save: parallelize(..., drift_check_every=N), or pm.drift_check_every.)")
