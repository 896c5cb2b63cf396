"""ProcessMesh: coordinates, one group per axis, names that resolve, errors that name the fix."""
from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.runtime.mesh import MeshError, ProcessMesh


def _mesh_facts(rank: int, world_size: int) -> dict:
    mesh = ProcessMesh((2, 2))
    facts = {
        "coordinate": mesh.coordinate,
        "axis_names": mesh.axis_names,
        "sizes": (mesh.axis_size("dp"), mesh.axis_size(1)),
        "ranks": tuple(tuple(dist.get_process_group_ranks(mesh.group(a))) for a in ("dp", "tp")),
        "resolves": all(_resolve_process_group(mesh.group_name(a)) is mesh.group(a) for a in range(2)),
        "axis_rank": (mesh.axis_rank(0), mesh.axis_rank("tp")),
    }
    flat = mesh.flat_group_name(("tp", "dp"))
    facts["flat"] = (tuple(dist.get_process_group_ranks(_resolve_process_group(flat))), mesh.flat_group_name((0, 1)) == flat,
                     mesh.flat_group_name(("tp",)) == mesh.group_name("tp"))
    # Built from a torch DeviceMesh: the same groups.
    wrapped = ProcessMesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")))
    facts["wrapped"] = (wrapped.axis_names, wrapped.coordinate == mesh.coordinate)
    with pytest.raises(MeshError, match=r"2 \* 3 = 6 != WORLD_SIZE\(4\)"):
        ProcessMesh((2, 3))
    with pytest.raises(MeshError, match=r"no axis 'pp'; axes are \('dp', 'tp'\)"):
        mesh.group("pp")
    return facts


def test_mesh_2x2(spmd):
    facts = spmd(_mesh_facts, 4)
    for rank, f in enumerate(facts):
        row, col = divmod(rank, 2)  # row-major, like torch's DeviceMesh
        assert f["coordinate"] == (row, col) and f["axis_rank"] == (row, col)
        assert f["axis_names"] == ("dp", "tp") and f["sizes"] == (2, 2)
        # dp group: same column, tp group: same row
        assert f["ranks"] == ((col, col + 2), (2 * row, 2 * row + 1))
        assert f["resolves"]
        assert f["flat"] == ((0, 1, 2, 3), True, True)  # one group over both axes, created once
        assert f["wrapped"] == (("a", "b"), True)
