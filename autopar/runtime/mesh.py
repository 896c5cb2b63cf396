"""Process groups for a logical mesh: one group per mesh axis for this rank.

    mesh = ProcessMesh((2, 2))            # inside an initialised world of 4 ranks
    mesh.coordinate                       # (1, 0) on rank 2 (row-major, like torch's DeviceMesh)
    all_reduce(x, mesh.group_name("tp"))  # collectives take the c10d group name

Built on torch's `DeviceMesh` (`init_device_mesh` creates and registers the
groups); we keep it so DTensor-based tools (DCP, benchmarks) can use the same mesh.
Generated code names groups by their c10d name, which
`torch.distributed.distributed_c10d._resolve_process_group` maps back to the group.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.errors import AutoparError
from autopar.solver.mesh import default_axis_names

logger = logging.getLogger(__name__)

Axis = int | str  # a mesh axis by position or by name


class MeshError(AutoparError):
    """The mesh does not fit the world, or an axis does not exist."""


def _default_device_type() -> str:
    # NCCL works on CUDA tensors only; gloo's tensors stay on the host unless the caller passes a DeviceMesh or
    # device_type="cuda" (asking CUDA whether it is there would initialise it in every CPU rank of a GPU host)
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


class ProcessMesh:
    """This rank's view of a logical device mesh over the initialised world."""

    def __init__(self, shape: Sequence[int] | DeviceMesh, axis_names: Sequence[str] | None = None, device_type: str | None = None):
        if not dist.is_initialized():
            raise MeshError("ProcessMesh needs an initialised process group; call autopar.runtime.launch.init_from_env() (torchrun) or use run_ranks()")
        if isinstance(shape, DeviceMesh):
            self.device_mesh = shape
            names = shape.mesh_dim_names or default_axis_names(shape.ndim)
            if axis_names is not None and tuple(axis_names) != tuple(names):
                raise MeshError(f"axis_names {tuple(axis_names)} differ from the DeviceMesh's mesh_dim_names {tuple(names)}; pass one or the other")
            if shape.mesh_dim_names is None:
                raise MeshError(f"the DeviceMesh has no mesh_dim_names; build it with init_device_mesh(..., mesh_dim_names={names})")
        else:
            shape = tuple(int(n) for n in shape)
            world = dist.get_world_size()
            if math.prod(shape) != world:
                factors = " * ".join(str(n) for n in shape)
                raise MeshError(f"mesh shape {shape}: {factors} = {math.prod(shape)} != WORLD_SIZE({world}); choose a shape whose product is the world size")
            names = tuple(axis_names) if axis_names is not None else default_axis_names(len(shape))
            if len(names) != len(shape):
                raise MeshError(f"{len(names)} axis names {names} for a {len(shape)}-axis mesh {shape}")
            self.device_mesh = init_device_mesh(device_type or _default_device_type(), shape, mesh_dim_names=names)
        self.axis_names: tuple[str, ...] = tuple(names)
        self.shape: tuple[int, ...] = tuple(self.device_mesh.shape)
        coord = self.device_mesh.get_coordinate()
        if coord is None:
            raise MeshError(f"rank {dist.get_rank()} is not part of the mesh {self.shape}")
        self.coordinate: tuple[int, ...] = tuple(coord)
        self._groups = tuple(self.device_mesh.get_group(i) for i in range(len(self.shape)))
        # host-side agreement between ranks (`runtime.same_inputs`) on CPU tensors: beside NCCL, which takes
        # device tensors only, a gloo group of the world (made here, where every rank builds its mesh); else
        # the default group (gloo, or torch's fake group that simulates a rank)
        backend = str(dist.get_backend())
        self.cpu_group: dist.ProcessGroup | None = (
            dist.new_group(backend="gloo") if "nccl" in backend and "gloo" not in backend else None)
        self._flat: dict[tuple[int, ...], str] = {}
        if dist.get_rank() == 0:
            logger.info("runtime: mesh %s over %d ranks, groups %s", dict(zip(self.axis_names, self.shape)), dist.get_world_size(), self.group_names)

    def axis_index(self, axis: Axis) -> int:
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise MeshError(f"mesh has no axis {axis!r}; axes are {self.axis_names}")
            return self.axis_names.index(axis)
        if not 0 <= axis < len(self.shape):
            raise MeshError(f"mesh axis {axis} out of range for a {len(self.shape)}-axis mesh {self.shape}")
        return axis

    def group(self, axis: Axis) -> dist.ProcessGroup:
        return self._groups[self.axis_index(axis)]

    def group_name(self, axis: Axis) -> str:
        """The c10d name of the axis' group: what generated code passes to the collectives."""
        return self.group(axis).group_name

    def flat_group_name(self, axes: Sequence[Axis]) -> str:
        """The c10d name of one group spanning several axes (this rank's sub-mesh over them).

        One all-reduce over it sums over all those axes (gradient sync over dp x sp, say)
        instead of one per axis. The first call for a set of axes creates the group: every
        rank must make it, in the same order (as for any group creation).
        """
        idx = sorted({self.axis_index(a) for a in axes})
        if len(idx) == 1:
            return self.group_name(idx[0])
        key = tuple(idx)
        if key not in self._flat:
            names = tuple(self.axis_names[i] for i in idx)
            # torch's DeviceMesh flattening (private API, pinned torch) builds and caches the group.
            self._flat[key] = self.device_mesh[names]._flatten().get_group().group_name
        return self._flat[key]

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.group_name for g in self._groups)

    def axis_size(self, axis: Axis) -> int:
        return self.shape[self.axis_index(axis)]

    def axis_rank(self, axis: Axis) -> int:
        """This rank's position along `axis` (= its rank inside the axis' group)."""
        return self.coordinate[self.axis_index(axis)]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"ProcessMesh({axes}; coordinate={self.coordinate})"
