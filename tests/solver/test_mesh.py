"""Mesh presets, shapes and JSON (calibrate() on real ranks: tests/runtime/test_calibrate.py)."""
from __future__ import annotations

import pytest

from autopar.solver.mesh import PRESETS, Mesh, candidate_shapes, make_mesh


def test_candidate_shapes():
    assert candidate_shapes(8) == [(8,), (2, 4), (4, 2)]
    assert candidate_shapes(6) == [(6,), (2, 3), (3, 2)]
    assert candidate_shapes(1) == [(1,)]


def test_make_mesh_and_json_round_trip():
    m = make_mesh(32, (4, 8), "h100-ib")
    assert m.shape == (4, 8) and m.num_devices == 32
    assert m.axes[0].beta_bytes_per_s == PRESETS["h100-ib"].axes[0].beta_bytes_per_s  # outer axis: InfiniBand
    assert m.axes[1].beta_bytes_per_s > 5 * m.axes[0].beta_bytes_per_s  # inner axis: NVLink
    assert Mesh.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match=r"4 \* 4 = 16 != num_devices \(8\)"):
        make_mesh(8, (4, 4))
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        make_mesh(8, hardware="tpu")


def test_json_round_trip_of_calibrated_fields_and_old_files():
    from dataclasses import replace

    from autopar.solver.mesh import AxisGroup, LinkCost
    from autopar.solver.plan_io import load_mesh, mesh_to_json

    ax = replace(make_mesh(4, hardware="cpu").axes[0],
                 per_kind=(LinkCost("all_reduce", 1.4e-3, 3.5e8), LinkCost("reduce_scatter", 2.3e-3, 1.2e8)),
                 scalar_alpha_s=3e-4)
    m = replace(make_mesh(4, hardware="cpu"), axes=(ax,), op_overhead_s=1.2e-5, recompute_op_overhead_s=3.5e-5,
                recompute_region_s=9e-5)
    assert Mesh.from_json(m.to_json()) == m
    assert m.with_shape((2, 2)).axes[1].per_kind == ax.per_kind  # relayout keeps the measured links
    # a measured group over both axes of a 2x2 layout survives renaming its axes, not another layout
    two = replace(m.with_shape((2, 2)), groups=(AxisGroup((0, 1), replace(ax, name="dp+tp", size=4)),))
    assert Mesh.from_json(two.to_json()) == two
    assert two.with_shape((2, 2), ("a", "b")).groups == two.groups and two.with_shape((4,)).groups == ()
    # plan_io's mesh files (what `autopar calibrate --save` writes) carry the same fields
    import tempfile
    for mesh in (m, two):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(mesh_to_json(mesh))
        assert load_mesh(f.name) == mesh
    # files written before the fields existed load with their defaults
    old = m.to_json()
    for key in ("op_overhead_s", "recompute_op_overhead_s", "recompute_region_s", "groups"):
        del old[key]
    del old["axes"][0]["per_kind"]
    del old["axes"][0]["scalar_alpha_s"]
    assert Mesh.from_json(old) == replace(m, axes=(replace(ax, per_kind=(), scalar_alpha_s=None),), op_overhead_s=0.0,
                                          recompute_op_overhead_s=0.0, recompute_region_s=0.0)
    with pytest.raises(ValueError, match="recompute_region_s must be >= 0"):
        replace(m, op_overhead_s=-1.0)
