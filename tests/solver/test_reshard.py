"""Every resharding path, checked by simulating the collectives' math on per-rank shards."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from autopar.solver.mesh import make_mesh
from autopar.solver.reshard import apply_step, reshard_cost, reshard_steps
from autopar.solver.spec import Spec
from autopar.solver.strategies.dtensor_adapter import candidate_specs
from autopar.solver.strategies.simulate import assemble, run_collective, shard

SHAPE = (4, 8, 12)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_every_path_between_even_specs_is_exact(mesh_shape):
    mesh = make_mesh(math.prod(mesh_shape), mesh_shape, "h100")
    full = torch.randn(SHAPE, dtype=torch.float64)
    specs = candidate_specs(SHAPE, mesh_shape)
    checked = 0
    for src, dst in itertools.product(specs, specs):
        steps = reshard_steps(src, dst, SHAPE, mesh)
        ranks, spec = shard(full, src, mesh_shape, torch.Generator().manual_seed(1)), src
        for step in steps:
            ranks, spec = run_collective(ranks, step, mesh_shape), apply_step(spec, step)
        assert spec == dst, f"{src} -> {dst}: steps {[str(s) for s in steps]} end at {spec}"
        torch.testing.assert_close(assemble(ranks, dst, mesh_shape), full)
        checked += 1
    print(f"\nmesh {mesh_shape}: {checked} resharding paths verified")
    assert checked == len(specs) ** 2


def test_known_cheapest_sequences():
    mesh = make_mesh(4, (2, 2), "h100")
    steps = lambda a, b: [str(s) for s in reshard_steps(Spec.parse(a), Spec.parse(b), SHAPE, mesh)]  # noqa: E731
    assert steps("S(0)S(0)", "RR") == ["all_gather[axis 1 from=0]", "all_gather[axis 0 from=0]"]  # inner axis first
    assert steps("PR", "S(1)R") == ["reduce_scatter[axis 0 to=1]"]
    assert steps("S(0)R", "S(2)R") == ["all_to_all[axis 0 from=0 to=2]"]
    assert sorted(steps("RR", "S(1)S(2)")) == ["slice[axis 0 to=1]", "slice[axis 1 to=2]"]


def test_cost_matches_ring_formula_by_hand():
    mesh = make_mesh(4, (4,), "h100")
    a = mesh.axes[0]
    nbytes = 4 * 8 * 12 * 4
    # all-reduce of the full fp32 tensor: 2(n-1)/n * bytes / beta + 2(n-1) alpha; backward: nothing
    expect = 2 * 3 / 4 * nbytes / a.beta_bytes_per_s + 6 * a.alpha_s
    assert reshard_cost(Spec.parse("P"), Spec.parse("R"), SHAPE, 4, mesh) == pytest.approx(expect)
    # all-gather forward ((n-1)/n * gathered bytes); backward is a local slice (memory copy only)
    ag = 3 / 4 * nbytes / a.beta_bytes_per_s + 3 * a.alpha_s
    sl = nbytes / 4 / mesh.mem_bandwidth_bytes_per_s  # keep 1/n of the replicated tensor
    assert reshard_cost(Spec.parse("S(0)"), Spec.parse("R"), SHAPE, 4, mesh) == pytest.approx(ag + sl)
    assert reshard_cost(Spec.parse("S(0)"), Spec.parse("R"), SHAPE, 4, mesh, with_backward=False) == pytest.approx(ag)


def test_one_search_per_source_and_shape_class():
    """Costs depend on the shape only through bytes and divisibility: one search from a source prices
    every destination, and tensors of one shape class share the searches."""
    from autopar.solver.reshard import _paths_from, shape_class

    mesh = make_mesh(4, (2, 2), "h100")
    shape, same_class, other_class = (8, 6, 4), (4, 6, 8), (8, 4, 6)  # equal bytes; dim 1 of the last splits by 4
    assert shape_class(shape, 4, mesh.shape) == shape_class(same_class, 4, mesh.shape)
    assert shape_class(shape, 4, mesh.shape) != shape_class(other_class, 4, mesh.shape)
    specs = candidate_specs(shape, mesh.shape)
    _paths_from.cache_clear()
    costs = {(s, d): reshard_cost(s, d, shape, 4, mesh) for s in specs for d in specs}
    searches = _paths_from.cache_info().misses
    assert searches <= 2 * len(specs) < len(costs)  # forward and gradient sources, not one search per pair
    assert all(reshard_cost(s, d, same_class, 4, mesh) == v for (s, d), v in costs.items())
    assert _paths_from.cache_info().misses == searches  # the same class: no new search
    reshard_cost(Spec.parse("S(1)S(1)"), Spec.parse("RR"), other_class, 4, mesh)  # even only in the other class
    assert _paths_from.cache_info().misses > searches
