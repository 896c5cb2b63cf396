"""Where reports are printed: rich consoles on stdout/stderr and a progress spinner for slow phases."""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator

from rich.console import Console


def out_console() -> Console:
    # Looked up per call so tests capturing sys.stdout see the output; 160 columns off a terminal keeps tables unwrapped.
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160, highlight=False)


def err_console() -> Console:
    return Console(file=sys.stderr, width=None if sys.stderr.isatty() else 120, highlight=False)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A spinner on stderr while `name` runs; its duration is printed when it took over a second."""
    console = err_console()
    start = time.perf_counter()
    with console.status(f"{name}...", spinner="dots"):
        yield
    elapsed = time.perf_counter() - start
    if elapsed > 1.0:
        console.print(f"[dim]{name}: {elapsed:.1f} s[/dim]")
