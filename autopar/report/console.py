"""Where reports are printed: rich consoles on stdout/stderr and the progress of slow phases."""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def out_console() -> Console:
    # Looked up per call so tests capturing sys.stdout see the output; 160 columns off a terminal keeps tables unwrapped.
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160, highlight=False)


def err_console() -> Console:
    return Console(file=sys.stderr, width=None if sys.stderr.isatty() else 120, highlight=False)


@contextlib.contextmanager
def phase(name: str) -> Iterator[Callable[[str], None]]:
    """Progress of a slow phase on stderr: on a terminal a spinner with the phase's current step and its elapsed
    time, piped a line per step with the time since the phase began; its duration once it took over a second.
    Yields the function that names the current step (`solve_for_devices(progress=...)`)."""
    console = err_console()
    start = time.perf_counter()
    if console.is_terminal:
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task(f"{name}...")
            yield lambda step: progress.update(task, description=f"{name}: {step}")
    else:
        yield lambda step: console.print(f"{name}: {step} ({time.perf_counter() - start:.1f} s)", highlight=False)
    elapsed = time.perf_counter() - start
    if elapsed > 1.0:
        console.print(f"[dim]{name}: {elapsed:.1f} s[/dim]")
