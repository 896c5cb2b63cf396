"""Checkpoints lose nothing: a rank SIGKILLed before, during or after a save (synchronous or in the background),
on 2 and 4 ranks (the 4-rank checkpoints loaded on 2), leaves the last complete checkpoint in place, and it loads and equals its step's state; the
survivors raise an error saying so. A flipped byte is found and named before anything loads, and a crafted
`.metadata` is refused unread.

The runtime's small classifier, fc1's weight stored split (each rank writes a file of its own), AdamW. Each
save records its step in `extra`; the reference is one device's model and optimizer after that many steps.
"""
from __future__ import annotations

import os
import pickle
import re
import signal
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tests.codegen.harness import Classifier, classifier_case, parallel_module, step
from tests.codegen.plans import cpu_mesh, greedy_plan

from autopar.errors import CheckpointError
from autopar.runtime import checkpoints
from autopar.runtime.checkpoints import latest_checkpoint
from autopar.runtime.launch import RankDied, run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.state_dict import StateDictError

LR = 0.05
CALL_TIMEOUT_S = 3.0  # survivors of a rank that died before the save wait this long at its arrival check
GROUP_TIMEOUT_S = 15.0  # never reached: a killed rank's connections close at once


def _split_weight_plan(traced, world: int):
    return greedy_plan(traced, cpu_mesh((world,)), {**{n: "S(0)" for n in traced.input_names}, "p_fc1_weight": "S(0)"})


def _arm(phase: str) -> None:
    """This rank SIGKILLs itself at `phase` of the save that follows."""
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if phase == "during":  # its second item: its file cut short, no metadata written
        write, calls = filesystem._write_item, []

        def write_then_die(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                die()
            return write(*args, **kwargs)
        filesystem._write_item = write_then_die
    elif phase == "publishing":  # rank 0, its manifest written, just before the rename that publishes
        rename = os.rename

        def rename_or_die(src, dst, *args, **kwargs):
            if str(src).endswith(".partial"):
                die()
            return rename(src, dst, *args, **kwargs)
        checkpoints.os.rename = rename_or_die


def _train_save_and_crash(rank, world, model, sample, traced, plan, root, phase, background, victim):
    """Step, save (step 1), step, save again (step 2) with rank `victim` killed at `phase` of that save. The
    survivors return what they saw."""
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    step(pm, opt, sample)
    pm.save_checkpoint(root, opt, extra={"step": 1})
    step(pm, opt, sample)
    pm.call_timeout_s = CALL_TIMEOUT_S  # (short for the save a rank misses, not before: ranks lower at their own pace)
    if rank == victim:
        if phase == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        _arm(phase)
    try:
        written = pm.save_checkpoint(root, opt, extra={"step": 2}, background=background)
        if written is not None:
            written.result()
    except Exception as err:  # noqa: BLE001 -- what a survivor saw is the test's subject
        return type(err).__name__, str(err)
    if rank == victim and phase == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return None


def _cases(world: int) -> list[tuple[str, bool, int]]:
    """(phase, background, victim) of each world. A rank killed before the save never reaches it, so a
    background save's "before" is a synchronous one's (both wait in the same arrival check) and runs once."""
    cases = [("before", False, world - 1)] + [(phase, background, world - 1) for phase in ("during", "after")
                                               for background in (False, True)]
    return cases + [("publishing", False, 0)] if world == 2 else cases



_LOADS = {"before": 1, "during": 1, "after": 2, "publishing": 1}  # the step of the newest complete checkpoint


def _reference(model, sample, steps: int):
    """One device's model and AdamW state after `steps` steps on the whole batch."""
    ref = Classifier()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        ref(*sample).backward()
        opt.step()
    return ref.state_dict(), get_optimizer_state_dict(ref, opt)


def _load_each(rank, world, model, sample, traced, plan, roots):
    """Load the newest checkpoint of each root into a fresh module: its step, full parameters and optimizer state."""
    out = []
    for root in roots:
        pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
        opt = torch.optim.AdamW(pm.parameters(), lr=LR)
        extra = {"step": 0}
        loaded = pm.load_checkpoint(root, opt, extra=extra)
        out.append((os.path.basename(loaded), extra["step"], pm.state_dict(), pm.optimizer_state_dict(opt)))
    return out


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_killed_at_any_point_of_a_save_leaves_the_last_complete_checkpoint(tmp_path, world):
    model, sample, traced, *_ = classifier_case()
    plans = {size: _split_weight_plan(traced, size) for size in {2, world}}
    cases = _cases(world)
    seen = {}
    for phase, background, victim in cases:
        root = str(tmp_path / f"{world}-{phase}-{'background' if background else 'sync'}")
        results = run_ranks(_train_save_and_crash, world, model, sample, traced, plans[world], root, phase, background,
                            victim, timeout_s=120, group_timeout_s=GROUP_TIMEOUT_S, may_die={victim})
        assert isinstance(results[victim], RankDied), (world, phase, background, results[victim])
        seen[root] = [r for i, r in enumerate(results) if i != victim]
        leftovers = [n for n in os.listdir(root) if not n.startswith("ckpt-")]
        assert all(n.endswith(".partial") for n in leftovers), leftovers  # a crashed save's files, never published

    references = {steps: _reference(model, sample, steps) for steps in (1, 2)}
    roots = list(seen)
    loaded = run_ranks(_load_each, 2, model, sample, traced, plans[2], roots, timeout_s=120)[0]
    for (phase, background, victim), root, (name, steps, state, osd) in zip(cases, roots, loaded):
        case = f"{world} ranks, rank {victim} killed {phase} a {'background' if background else 'synchronous'} save"
        assert (name, steps) == (f"ckpt-00000{_LOADS[phase]}", _LOADS[phase]), case
        want_state, want_osd = references[steps]
        for fqn, want in want_state.items():
            torch.testing.assert_close(state[fqn], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}, {fqn}: {m}")
        for fqn, entries in want_osd["state"].items():
            for key, want in entries.items():
                torch.testing.assert_close(osd["state"][fqn][key], want, rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"{case}, {fqn} {key}: {m}")
        for survivor in seen[root]:  # each survivor heard of it, in autopar's words, well within the timeouts
            if phase == "after":
                assert survivor is None, (case, survivor)  # its save was complete; the loss shows in its next step
                continue
            kind, message = survivor
            assert "for the process group's timeout" not in message, (case, message)  # a closed connection: at once
            if phase == "before":
                assert kind == "CallMismatchError" and re.search(rf"\(checked call 2\) for ranks \[[\d, ]*{victim}\], which have not made it", message), case
            else:
                assert kind == "CheckpointError" and "was not published" in message, (case, message)
                assert "ckpt-000001" in message, (case, message)  # the one a resumed run loads


def _save_once(rank, world, model, sample, traced, plan, root):
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    step(pm, opt, sample)
    pm.save_checkpoint(root, opt, extra={"step": 1})


def _load_or_refuse(rank, world, model, sample, traced, plan, root):
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    try:
        pm.load_checkpoint(root, opt)
    except (CheckpointError, StateDictError) as err:
        after = pm.state_dict()
        return type(err).__name__, str(err), all(torch.equal(before[k], after[k]) for k in before)
    return None


class _Payload:
    """What a crafted pickle runs when loaded: it leaves a file behind."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_flipped_byte_or_a_crafted_metadata_is_refused_before_anything_loads(tmp_path):
    model, sample, traced, *_ = classifier_case()
    plan = _split_weight_plan(traced, 2)
    root = tmp_path / "ckpt"
    run_ranks(_save_once, 2, model, sample, traced, plan, str(root), timeout_s=60)
    directory = Path(latest_checkpoint(root))

    shard = directory / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # one bit of the last item rank 1 wrote
    shard.write_bytes(bytes(data))
    kind, message, untouched = run_ranks(_load_or_refuse, 2, model, sample, traced, plan, str(root), timeout_s=60)[0]
    assert kind == "CheckpointError" and untouched
    assert "__1_0.distcp does not match its checksum: " in message and "changed" in message
    assert "model.fc1.weight" in message or "optim.state.fc1.weight" in message, message

    # a .metadata crafted to run code (the manifest removed, as whoever crafted it would): refused, nothing run
    (directory / "autopar-manifest.json").unlink()
    marker = tmp_path / "ran"
    (directory / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    kind, message, untouched = run_ranks(_load_or_refuse, 2, model, sample, traced, plan, str(root), timeout_s=60)[0]
    assert not marker.exists()
    assert kind == "CheckpointError" and untouched
    assert "names pathlib.Path.touch, which is not part of a checkpoint's metadata: refused unread" in message
