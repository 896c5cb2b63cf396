"""Start ranks: `run_ranks` forks a local gloo world (tests, benchmarks), `init_from_env` joins a torchrun world.

    results = run_ranks(fn, 4, x, timeout_s=60)   # fn(rank, world_size, x) on 4 forked ranks

Forking costs ~0.1 s per world (spawn re-imports torch: ~3 s per rank). The
parent binds a listening socket on port 0 (the OS picks a free port and holds it:
no race with other worlds started concurrently) and rank 0 serves the rendezvous
TCPStore on that socket. The parent starts no store itself, so it forks with no
store thread running (a thread holding a lock at fork time can deadlock a child).

The rendezvous (the store, gloo connecting every pair of ranks) can fail on a loaded
host: gloo's `connectFullMesh` has been seen to end in "Connection closed by peer"
once in hundreds of worlds. A world whose rendezvous fails on any rank, before any
rank runs `fn`, is started again, up to `RENDEZVOUS_ATTEMPTS` times; a failure after
that is `fn`'s and is raised.

Each rank's stderr (Python's, C++'s, the fault handler's dump of a deliberate crash)
goes to a file of its own that the parent copies to its own `sys.stderr` as it comes
(under pytest: the test's captured output), and a rank that dies without a word has
its last lines quoted in the `RankError`.

On a CUDA host: a forked child cannot use CUDA once its parent has initialised
it, so a parent that has starts its ranks by spawn (which pickles `fn`: it must be
a module's top-level function). Rank r's CUDA work goes to device r mod the
number of visible devices (`_own_device`): set when the rank first uses CUDA, so
a CPU rank on a GPU host makes no CUDA context.
"""
from __future__ import annotations

import faulthandler
import functools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Collection, Literal

import torch
import torch.distributed as dist

from autopar.errors import AutoparError

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
RENDEZVOUS_ATTEMPTS = 3
_READY_KEY = "autopar/launch/ready"  # each rank adds one once its process group is up
_GO_KEY = "autopar/launch/go"  # set by the last rank to come up: every rank then runs fn
_POLL_S = 0.2  # how often the parent relays the ranks' stderr while it waits
_TAIL_LINES = 15  # of a rank's stderr, quoted when it dies without a word


class RankError(AutoparError):
    """A rank started by `run_ranks` raised, died or timed out; carries the rank's traceback."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def _send(conn: mp.connection.Connection, msg: tuple) -> None:
    # Plain pickle, not Connection.send: torch registers multiprocessing reducers that pass tensors
    # as shared-memory handles, which the parent could no longer open once this rank has exited.
    conn.send_bytes(pickle.dumps(msg))


def _own_stderr(path: str) -> None:
    """This process's stderr, at the file descriptor and in Python, goes to `path`; so does the fault
    handler's dump, which pytest points at the terminal it started on, past its capture."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 -- the process's stderr until it exits
    if faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)


def _rendezvous(listener: socket.socket, rank: int, world_size: int, backend: str, timeout_s: float,
                group_timeout_s: float) -> None:
    """Join the world's process group; return once every rank has (no rank runs fn before)."""
    port = listener.getsockname()[1]
    if rank == 0:
        store = dist.TCPStore(_HOST, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              master_listen_fd=listener.fileno())
    else:
        listener.close()
        store = dist.TCPStore(_HOST, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=group_timeout_s))
    if store.add(_READY_KEY, 1) == world_size:
        store.set(_GO_KEY, "")
    store.wait([_GO_KEY])


def _own_device(rank: int, backend: str) -> None:
    """Give rank `rank` CUDA device rank mod (visible devices), where there are any. NCCL needs it before the
    process group exists; otherwise it is queued for CUDA's lazy initialisation (`torch.cuda._lazy_call`, which
    torch's own seeding uses), so a rank that never touches CUDA never makes a context."""
    count = torch.cuda.device_count()  # asks NVML where it can: initialises no CUDA
    if backend == "nccl":
        if count == 0:
            raise AutoparError(f"run_ranks: backend='nccl' needs CUDA devices and this host shows none "
                               f"(torch {torch.__version__}); use backend='gloo'")
        torch.cuda.set_device(rank % count)
    elif count:
        torch.cuda._lazy_call(functools.partial(torch.cuda.set_device, rank % count))


def _start_method() -> Literal["fork", "spawn"]:
    """fork, unless this process has initialised CUDA, which a forked child could not use."""
    return "spawn" if torch.cuda.is_initialized() else "fork"


def _check_picklable(fn: Callable[..., Any], args: tuple) -> None:
    try:
        pickle.dumps((fn, args))
    except Exception as err:
        raise AutoparError(
            f"run_ranks: the ranks start by spawn (start_method='spawn', or this process has initialised CUDA), which "
            f"pickles fn and its arguments; {getattr(fn, '__qualname__', fn)!r} or an argument cannot be pickled ({err}). Define fn at a "
            "module's top level and pass plain arguments, or start the ranks before this process uses CUDA") from err


def _child(
    conn: mp.connection.Connection,
    listener: socket.socket,
    stderr_path: str,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    group_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    _own_stderr(stderr_path)
    # One intra-op thread per rank: ranks share few cores, oversubscription makes collectives crawl.
    torch.set_num_threads(1)
    phase = "error"
    try:
        _own_device(rank, backend)
        phase = "rendezvous"
        _rendezvous(listener, rank, world_size, backend, timeout_s, group_timeout_s)
        phase = "error"
        result = fn(rank, world_size, *args)
        dist.destroy_process_group()
        _send(conn, ("ok", result))
    except BaseException as exc:  # noqa: BLE001 -- forwarded to the parent, which re-raises it
        # Timestamped so the parent can tell the first failure from its echoes on the peers
        # ("Connection closed by peer" once this rank exits).
        _send(conn, (phase, f"{type(exc).__name__}: {exc}", traceback.format_exc(), time.time()))
    finally:
        conn.close()


class _Relay:
    """The ranks' stderr files, copied to this process's `sys.stderr` as they grow."""

    def __init__(self, world_size: int):
        self._dir = tempfile.TemporaryDirectory(prefix="autopar-ranks-")
        self.paths = [os.path.join(self._dir.name, f"rank{r}.stderr") for r in range(world_size)]
        self._done = [0] * world_size

    def pump(self) -> None:
        for rank, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self._done[rank])
                    data = f.read()
            except FileNotFoundError:
                continue
            if data:
                self._done[rank] += len(data)
                sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()

    def tail(self, rank: int) -> str:
        try:
            with open(self.paths[rank], "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        # without the frames and the module list of a fault handler's dump, which bury its first line
        said = [line for line in lines if line.strip() and not line.startswith(("  File ", "Extension modules:"))]
        return "\n".join(said[-_TAIL_LINES:])

    def close(self) -> None:
        self.pump()
        self._dir.cleanup()


@dataclass(frozen=True)
class RankDied:
    """The result of a rank `run_ranks` was told may die (`may_die`) and did, without a word."""

    exit_code: int | None


class _RendezvousFailed(Exception):
    """A rank's process group did not come up: the world is started again."""


def _reports(conns: dict, timeout_s: float) -> list[tuple[float, int, str, str]]:
    """Error reports that arrive from the ranks still connected within `timeout_s` (read ones are dropped)."""
    found = []
    for conn in mp.connection.wait(list(conns), timeout=timeout_s):
        rank = conns.pop(conn)
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:  # died without a word: the other reports say more
            continue
        if msg[0] != "ok":
            found.append((msg[3], rank, msg[1], msg[2]))
    return found


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    backend: str = "gloo",
    group_timeout_s: float | None = None,
    may_die: Collection[int] = (),
    start_method: Literal["fork", "spawn"] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` forked ranks and return their results by rank.

    `fn` may be a closure (fork copies it, nothing is pickled on the way in); its
    result must be picklable (tensors come back by value). The first rank to fail
    aborts the world: the others are killed and a `RankError` carrying that rank's
    traceback is raised. After `timeout_s` every rank still running is killed and a
    `RankError` names them. A world whose process group fails to come up is started
    again (module docstring). `start_method`: default fork, or spawn where this process
    has initialised CUDA (module docstring); spawn pickles `fn` and `args`.

    group_timeout_s: the process group's timeout (default `timeout_s`): how long a collective waits for a
    peer that neither sends nor closes. may_die: ranks a fault-injection test kills on purpose; one that
    dies without a word gets a `RankDied` as its result, and the others run on to their own ends.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    start_method = start_method or _start_method()
    if start_method == "spawn":
        _check_picklable(fn, args)
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _run_world(fn, world_size, args, timeout_s, backend, group_timeout_s or timeout_s, frozenset(may_die),
                              start_method)
        except _RendezvousFailed as failed:
            if attempt == RENDEZVOUS_ATTEMPTS:
                raise RankError(f"the process group of {world_size} ranks did not come up in {attempt} attempts: "
                                f"{failed}") from None
            logger.warning("run_ranks: the process group of %d ranks did not come up (%s); starting it again",
                           world_size, failed)
    raise AssertionError("unreachable")


def _run_world(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float, backend: str,
               group_timeout_s: float, may_die: frozenset[int], start_method: str) -> list[Any]:
    ctx = mp.get_context(start_method)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((_HOST, 0))
    listener.listen(128)  # clients that connect before rank 0 serves wait in the backlog
    relay = _Relay(world_size)
    procs: list[mp.Process] = []
    conns: dict[mp.connection.Connection, int] = {}
    finished = False
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(child_end, listener, relay.paths[rank], rank, world_size, backend, timeout_s, group_timeout_s, fn, args),
                name=f"autopar-rank{rank}",
                daemon=True,
            )
            p.start()
            child_end.close()
            procs.append(p)
            conns[parent_end] = rank
        listener.close()  # rank 0 holds its own copy; if it dies, the other ranks' connects fail fast
        results: dict[int, Any] = {}
        errors: list[tuple[float, int, str, str]] = []  # (time, rank, message, traceback)
        dead: list[int] = []  # ranks whose connection closed without a message
        deadline = time.monotonic() + timeout_s
        while conns and not errors and not dead:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                missing = sorted(conns.values())
                raise RankError(f"ranks {missing} of {world_size} did not finish within timeout_s={timeout_s}; raise timeout_s or look for a collective only some ranks call", rank=missing[0])
            ready = mp.connection.wait(list(conns), timeout=min(left_s, _POLL_S))
            relay.pump()
            for conn in ready:
                rank = conns.pop(conn)
                try:
                    msg = pickle.loads(conn.recv_bytes())
                except EOFError:
                    if rank in may_die:
                        procs[rank].join(1.0)
                        results[rank] = RankDied(procs[rank].exitcode)
                    else:
                        dead.append(rank)
                    continue
                if msg[0] == "rendezvous":
                    raise _RendezvousFailed(f"rank {rank}: {msg[1]}")
                if msg[0] == "error":
                    errors.append((msg[3], rank, msg[1], msg[2]))
                else:
                    results[rank] = msg[1]
            if dead and not errors:
                # A rank that died without a word (a signal, an abort inside a collective) may be the echo
                # of a peer that failed just before and closed its connections: take that peer's report if
                # it is stamped before the death was seen; later reports are echoes of the death.
                died_at = time.time()
                errors += [e for e in _reports(conns, timeout_s=1.0) if e[0] <= died_at]
                if not errors:
                    rank = dead[0]
                    code = procs[rank].join(1.0) or procs[rank].exitcode
                    tail = relay.tail(rank)
                    said = f"; its last words on stderr:\n{tail}" if tail else ""
                    raise RankError(f"rank {rank} died without a result (exit code {code}){said}", rank=rank)
        if errors:
            errors += _reports(conns, timeout_s=1.0)  # give the peers a moment to report too; blame the earliest
            _, rank, text, tb = min(errors)
            others = sorted(r for _, r, _, _ in errors if r != rank)
            echo = f" (ranks {others} failed after it)" if others else ""
            raise RankError(f"rank {rank} raised {text}{echo}\n--- rank {rank} traceback ---\n{tb}", rank=rank, remote_traceback=tb)
        finished = True
        return [results[r] for r in range(world_size)]
    finally:
        # On failure the surviving ranks are likely blocked in a collective with the dead one: kill them now.
        for p in procs:
            p.join(timeout=5.0 if finished else 0.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in conns:
            conn.close()
        listener.close()
        relay.close()


def init_from_env(timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Join the world described by torchrun's environment; returns (rank, world_size, device).

    NCCL with one GPU per local rank when CUDA is available, gloo on CPU otherwise.
    An already initialised world (e.g. inside `run_ranks`) is joined as it is.
    """
    if dist.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        return dist.get_rank(), dist.get_world_size(), device
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise AutoparError(f"environment variable {var} is not set; launch with `torchrun --nproc_per_node N script.py`")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        logger.info("runtime: joined a world of %d ranks on %s (%s)", world_size, device, backend)
    return rank, world_size, device
