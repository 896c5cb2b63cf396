"""Full state dicts gather/slice shards exactly; DCP checkpoints round-trip and reshard."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.state_dict import (
    StateDictError,
    full_state_dict,
    load_full_state_dict,
    load_sharded,
    save_sharded,
    shard_pytree,
    shard_state_dict,
)
from autopar.solver.spec import Spec


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "wte.weight": torch.randn(8, 4, generator=gen),
        "fc.weight": torch.randn(4, 8, generator=gen),
        "fc.bias": torch.randn(8, generator=gen),
        "ln.weight": torch.randn(4, generator=gen),
    }


SPECS_1D = {"wte.weight": Spec.parse("S(0)"), "fc.weight": Spec.parse("S(1)"), "fc.bias": Spec.parse("S(0)"), "ln.weight": Spec.parse("R")}
SPECS_2D = {"wte.weight": Spec.parse("S(0)S(0)"), "fc.weight": Spec.parse("S(1)S(0)"), "fc.bias": Spec.parse("RS(0)"), "ln.weight": Spec.parse("RR")}


def _roundtrip(rank: int, world_size: int, mesh_shape: tuple[int, ...], specs: dict[str, Spec]) -> None:
    mesh = ProcessMesh(mesh_shape)
    full = _full()
    local = shard_state_dict(full, specs, mesh)
    # Independent reference for the nesting rule: shard k of n along the dim, k row-major over the sharding axes.
    for name, spec in specs.items():
        t = full[name]
        for axis, p in enumerate(spec.placements):
            if str(p).startswith("S"):
                t = t.chunk(mesh.shape[axis], p.dim)[mesh.coordinate[axis]]
        assert_close(local[name], t, rtol=0, atol=0)
    gathered = full_state_dict(local, specs, mesh)
    for name in full:
        assert_close(gathered[name], full[name], rtol=0, atol=0)
    zeros = {k: torch.zeros_like(v) for k, v in local.items()}
    ptrs = {k: v.data_ptr() for k, v in zeros.items()}
    load_full_state_dict(zeros, full, specs, mesh)
    for name in full:
        assert zeros[name].data_ptr() == ptrs[name]  # filled in place
        assert_close(zeros[name], local[name], rtol=0, atol=0)
    with pytest.raises(StateDictError, match=r"missing \['ln.weight'\]"):
        load_full_state_dict(zeros, {k: v for k, v in full.items() if k != "ln.weight"}, specs, mesh)
    # A batch: tensor leaves cut by position, other leaves passed through.
    x, y = full["wte.weight"], full["fc.weight"]
    batch = shard_pytree({"x": x, "flag": True, "y": y}, (specs["wte.weight"], specs["fc.weight"]), mesh)
    assert batch["flag"] is True
    assert_close(batch["x"], local["wte.weight"], rtol=0, atol=0)
    assert_close(batch["y"], local["fc.weight"], rtol=0, atol=0)
    with pytest.raises(StateDictError, match="2 tensors in the batch but 1 input specs"):
        shard_pytree((x, y), (specs["wte.weight"],), mesh)


@pytest.mark.parametrize("mesh_shape, specs", [((2,), SPECS_1D), ((2, 2), SPECS_2D)])
def test_full_state_dict_roundtrip(spmd, mesh_shape, specs):
    world = 2 if len(mesh_shape) == 1 else 4
    spmd(_roundtrip, world, mesh_shape, specs)


def _dcp(rank: int, world_size: int, path: str) -> None:
    mesh = ProcessMesh((world_size,))
    full = _full()
    save_sharded(shard_state_dict(full, SPECS_1D, mesh), SPECS_1D, mesh, path)
    # Load under different specs: DCP reshards (S(0) -> S(1), S(1) -> R, ...).
    other = {"wte.weight": Spec.parse("S(1)"), "fc.weight": Spec.parse("R"), "fc.bias": Spec.parse("R"), "ln.weight": Spec.parse("S(0)")}
    target = {k: torch.zeros_like(v) for k, v in shard_state_dict(full, other, mesh).items()}
    load_sharded(target, other, mesh, path)
    expected = shard_state_dict(full, other, mesh)
    for name in full:
        assert_close(target[name], expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_dcp_save_load_reshards(spmd, tmp_path):
    spmd(_dcp, 2, str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "ckpt-000001" / ".metadata").exists()
