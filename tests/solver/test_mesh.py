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


# what `torch.cuda.get_device_name()` says on each, and the memory CUDA reports where the name does not tell
DEVICES = [("NVIDIA H100 80GB HBM3", None, "h100"), ("NVIDIA H100 PCIe", None, "h100-pcie"), ("NVIDIA H200", None, "h200"),
           ("NVIDIA A100-SXM4-40GB", None, "a100-40gb"), ("NVIDIA A100-SXM4-80GB", None, "a100"),
           ("NVIDIA A100 80GB PCIe", None, "a100"), ("NVIDIA A100-SXM4", 85.1e9, "a100"), ("NVIDIA A100-SXM4", 42.5e9, "a100-40gb"),
           ("NVIDIA L4", None, "l4"), ("NVIDIA GeForce RTX 4090", None, "rtx4090"), ("Tesla V100-SXM2-32GB", None, "v100")]


@pytest.mark.parametrize("name, memory_bytes, preset", DEVICES)
def test_presets_by_device_name(name, memory_bytes, preset):
    from autopar.solver.mesh import preset_for_device
    assert preset_for_device(name, memory_bytes) == preset


def test_an_unknown_gpu_is_named_with_the_fix():
    from autopar.solver.mesh import preset_for_device
    with pytest.raises(ValueError, match="no preset for the GPU 'NVIDIA B200'.*autopar calibrate"):
        preset_for_device("NVIDIA B200")


def test_a_preset_is_priced_at_a_precisions_rate():
    from autopar.solver.mesh import PRECISIONS, SUSTAINED
    # the H100 SXM datasheet's dense rates: fp32 67, TF32 494.7, bf16 989.4 TFLOP/s
    datasheet = {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12}
    for precision in PRECISIONS:
        mesh = make_mesh(8, (2, 4), "h100", precision=precision)
        assert mesh.flops_per_s == pytest.approx(SUSTAINED * datasheet[precision]) and mesh.precision == precision
        assert Mesh.from_json(mesh.to_json()) == mesh
    assert make_mesh(8, hardware="h100").precision == "bf16"  # the preset's own
    with pytest.raises(ValueError, match="one measured compute rate"):
        make_mesh(2, hardware="cpu").at_precision("tf32")


def test_fixed_overheads_per_layout_and_the_default_budget():
    from autopar.solver.assemble import budget_of as _budget
    h100 = make_mesh(8, (2, 4), "h100")
    o = h100.overheads
    # one communicator per split axis and one for the world (a sync over both axes)
    assert h100.overhead_bytes() == o.cuda_context_bytes + o.cublas_workspace_bytes + 3 * o.nccl_bytes_per_group
    assert make_mesh(1, hardware="h100").overhead_bytes() == o.cuda_context_bytes + o.cublas_workspace_bytes
    assert _budget(h100, None) == h100.memory_bytes - h100.overhead_bytes()
    assert _budget(h100, 3e9) == 3e9  # a budget the caller names is for the step's tensors
    assert make_mesh(4, hardware="cpu").overhead_bytes() == 0
