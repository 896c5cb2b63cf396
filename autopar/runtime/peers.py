"""What a rank knows of the others when a collective fails: the call each was last in, the errors they raised.

    note_call(store(), number, "pm.save_checkpoint('ck')")   # `runtime.arrival`, at each checked call
    note_failure("CallMismatchError: ...")          # before this rank raises an error its peers will meet
    raise collective_failed(err, "all-reduce", pg)  # a gloo/NCCL error with autopar's words on top

A rank that dies or raises leaves its peers blocked in their next collective, until gloo
sees the connection close ("Connection closed by peer") or the process group's timeout
passes ("Application timeout caused pair closure", after a SIGSTOP). Those words name no
rank and no cause. The notes live in the process group's key-value store (torch's
`TCPStore`), which every rank reaches without a collective; reading them on the way to
an error costs a few round trips, and is skipped (with a word saying so) when the store
itself is gone (its server was the rank that died) or does not answer within
`_STORE_READ_S`.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from autopar.errors import CollectiveError

_PREFIX = "autopar/peers"
_STORE_READ_S = 2.0  # how long a failing rank waits for the store's answer before giving up on the notes


def store() -> dist.Store | None:
    """The default process group's store, when there are other ranks to hear of."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    # torch keeps the store `init_process_group` made (or was given) here; there is no public accessor
    return dist.distributed_c10d._get_default_store()


def note_call(kv: dist.Store, number: int, what: str) -> None:
    """This rank is in its checked call `number`, `what` (read when some rank's wait or collective fails)."""
    kv.set(f"{_PREFIX}/last/{dist.get_rank()}", f"{number}\t{what}")


def note_failure(message: str) -> None:
    """Leave `message` (an error this rank is about to raise) where the peers' failures will read it."""
    kv = store()
    if kv is None:
        return
    try:
        kv.set(f"{_PREFIX}/failed/{dist.get_rank()}", message)
    except RuntimeError:  # the store is gone: the peers learn it from their own errors
        pass


def last_calls(kv: dist.Store, world: int) -> dict[int, str]:
    """rank -> the checked call it was last in ('pm.state_dict() (call 4)'); ranks that made none are left out."""
    keys = [f"{_PREFIX}/last/{r}" for r in range(world)]
    out = {}
    for rank, key in enumerate(keys):
        if kv.check([key]):
            number, what = kv.get(key).decode().split("\t", 1)
            out[rank] = f"{what} (checked call {number})"
    return out


def describe_ranks(kv: dist.Store, world: int, missing: list[int] | None = None) -> str:
    """Lines naming each rank's last checked call and the errors ranks noted before raising."""
    calls = last_calls(kv, world)
    lines = [f"  rank {r}: last in {calls[r]}" if r in calls else f"  rank {r}: no checked call yet"
             for r in range(world) if missing is None or r in missing]
    for r in range(world):
        key = f"{_PREFIX}/failed/{r}"
        if r != dist.get_rank() and kv.check([key]):
            lines.append(f"  rank {r} raised: {kv.get(key).decode()}")
    return "\n".join(lines)


def _peer_notes(world: int) -> str:
    """`describe_ranks` read with a short timeout: the store may have died with its server."""
    kv = store()
    if kv is None:
        return ""
    saved = kv.timeout
    try:
        kv.set_timeout(timedelta(seconds=_STORE_READ_S))
        return "what the ranks noted in the store:\n" + describe_ranks(kv, world)
    except RuntimeError as err:
        return f"(the ranks' notes are out of reach: the store does not answer, {type(err).__name__}; its server may be the rank that died)"
    finally:
        try:
            kv.set_timeout(saved)
        except RuntimeError:
            pass


def collective_failed(err: BaseException, op: str, pg: dist.ProcessGroup | None) -> CollectiveError:
    """A `CollectiveError` for `err`, raised by gloo or NCCL in collective `op` over `pg`, saying what it means
    for a training job and what the other ranks were doing."""
    said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size()))
    lowered = said.lower()
    if "timeout" in lowered or "timed out" in lowered:
        cause = ("a peer sent nothing for the process group's timeout: it is stopped (SIGSTOP, a debugger), hung in "
                 "code of its own, or far behind (a slow data loader, a rank saving alone)")
    elif any(word in lowered for word in ("closed", "reset", "broken pipe", "refused", "abort")):
        cause = ("a peer closed its connection: it died (killed, out of memory, a crash) or raised an error and "
                 "exited; its own error comes first in its log")
    else:
        cause = "the ranks' collectives did not match (another collective or another size on some rank)"
    return CollectiveError(f"rank {dist.get_rank()}: {op} over ranks {ranks} failed: {cause}.\n"
                           f"{_peer_notes(dist.get_world_size())}\n{dist.get_backend(pg)} said: {said}")
