"""The Megatron RNG rule: independent masks across shards, identical masks across replicas."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.rng import fork_rng_for, random_op, shard_index
from autopar.solver.spec import Spec

SPECS = ("RR", "S(0)R", "RS(1)", "S(0)S(1)")


def _masks(rank: int, world_size: int) -> dict[str, object]:
    mesh = ProcessMesh((2, 2))
    torch.manual_seed(0)
    out: dict[str, object] = {"coord": mesh.coordinate}
    x = torch.ones(64, 64)
    for text in SPECS:
        with fork_rng_for(Spec.parse(text), mesh.coordinate, mesh.shape):
            out[text] = F.dropout(x, 0.5) != 0
        with fork_rng_for(Spec.parse(text), mesh.coordinate, mesh.shape):
            out[text + " again"] = F.dropout(x, 0.5) != 0
    # The graph-callable form, the activation sharded over mesh axis 0 only.
    y, mask = random_op(torch.ops.aten.native_dropout.default, (mesh.group_name(0),), x, 0.5, True)
    out["graph S(0)R"] = mask
    out["after"] = torch.rand(4)  # the default generators are still in step
    return out


def test_masks_follow_the_sharding(spmd):
    res = spmd(_masks, 4)
    coords = [r["coord"] for r in res]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for text in SPECS:
        spec = Spec.parse(text)
        for a in range(4):
            for b in range(4):
                same_shard = shard_index(spec, coords[a], (2, 2)) == shard_index(spec, coords[b], (2, 2))
                assert torch.equal(res[a][text], res[b][text]) == same_shard, (text, coords[a], coords[b])
        for r in res:
            assert not torch.equal(r[text], r[text + " again"])  # a fresh draw per call
            assert 0.45 < r[text].float().mean().item() < 0.55  # still dropout(p=0.5)
    for a in range(4):
        for b in range(4):
            same_row = coords[a][0] == coords[b][0]
            assert torch.equal(res[a]["graph S(0)R"], res[b]["graph S(0)R"]) == same_row
        assert torch.equal(res[a]["after"], res[0]["after"])


def test_shard_index_is_row_major_over_shard_axes():
    spec = Spec.parse("S(0)RS(1)")
    assert [shard_index(spec, (i, j, k), (2, 3, 4)) for i, j, k in ((0, 2, 0), (0, 0, 3), (1, 1, 0), (1, 0, 3))] == [0, 3, 4, 7]


def test_a_random_op_forks_only_the_generator_of_its_device(monkeypatch):
    """On a CPU tensor no CUDA generator is read or seeded, however many GPUs are visible (each fork of
    every GPU's generator cost a state copy per device per dropout, and initialised CUDA in CPU ranks)."""
    def touched(*args, **kwargs):
        raise AssertionError("a CUDA generator was touched")

    torch.manual_seed(0)  # (seeds every GPU's generator too: before they are watched)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
        monkeypatch.setattr(torch.cuda, name, touched)
    x = torch.ones(256)
    before = torch.get_rng_state()
    with fork_rng_for(Spec.parse("S(0)"), (1,), (2,), seed=5):
        first = F.dropout(x, 0.5)
    assert torch.equal(torch.get_rng_state(), before)  # the CPU generator is restored
    with fork_rng_for(Spec.parse("S(0)"), (1,), (2,), seed=5):
        assert torch.equal(F.dropout(x, 0.5), first)  # the same seed and shard draw the same mask
    with fork_rng_for(Spec.parse("S(0)"), (0,), (2,), seed=5):
        assert not torch.equal(F.dropout(x, 0.5), first)  # another shard draws another
