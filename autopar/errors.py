"""Every error autopar raises on purpose: each names the offending value and the fix."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


class AutoparError(Exception):
    """Base class: catch this to handle any autopar failure."""


class TraceError(AutoparError):
    """The model could not be captured as a graph (names the user's source line)."""


@dataclass(frozen=True)
class Knobs:
    """How the entry point a user called names the settings a fix changes, so that an error raised in the solver
    speaks to that user: `memory_budget=` to `parallelize`'s caller, `--memory` to the CLI's."""

    memory: Callable[[float], str]  # a per-device budget in bytes -> how to pass it
    time_limit: Callable[[float], str]  # seconds -> how to pass them
    devices: str  # how to ask for more devices


def bytes_up(n: float) -> str:
    """Bytes to four significant digits, rounded up (a budget a user copies must not fall below the need)."""
    if n <= 0:
        return "0"
    scale = 10.0 ** (math.floor(math.log10(n)) - 3)
    return f"{math.ceil(n / scale - 1e-9) * scale:.4g}"


# `autopar.solver.solve` / `solve_for_devices` (the default wording); `parallelize` and the CLI re-word
SOLVER_KNOBS = Knobs(lambda b: f"memory_budget_bytes={bytes_up(b)}", lambda s: f"time_limit_s={s:g}", "use more devices")
PARALLELIZE_KNOBS = Knobs(lambda b: f"memory_budget={bytes_up(b)}", lambda s: f"time_limit_s={s:g}", "use more devices")
# ... where every optimizer state was kept on the device: the host tier is one more way out
PARALLELIZE_DEVICE_ONLY_KNOBS = Knobs(PARALLELIZE_KNOBS.memory, PARALLELIZE_KNOBS.time_limit,
                                      "use more devices, or pass offload='auto' to let the solver keep optimizer state "
                                      "in host memory")


class InfeasibleError(AutoparError):
    """No plan fits the memory budget; carries the minimum that would fit.

    `min_memory_bytes`: what the leanest plan found needs; `fits_bytes`: a budget under which the solver finds
    that plan (a hair above the need: `needs.budget_that_fits`), which the fix names. `lower_bound_bytes`: what
    every plan needs at least, as the solver proved it: the same number unless the search for the leanest
    plan stopped at its time limit. `cause` is the message without its fix, which names the settings of the entry
    point the user called (`worded_for`)."""

    def __init__(self, cause: str, min_memory_bytes: float | None = None, lower_bound_bytes: float | None = None,
                 fits_bytes: float | None = None, knobs: Knobs = SOLVER_KNOBS):
        self.cause = cause
        self.device_only = False  # every optimizer state was kept on the device: the host tier is a way out too
        self.min_memory_bytes = min_memory_bytes
        self.lower_bound_bytes = min_memory_bytes if lower_bound_bytes is None else lower_bound_bytes
        self.fits_bytes = min_memory_bytes if fits_bytes is None else fits_bytes
        super().__init__(f"{cause}\n  fix: {self.fix(knobs)}")

    def fix(self, knobs: Knobs) -> str:
        if self.fits_bytes is None:
            return knobs.devices
        return f"pass {knobs.memory(self.fits_bytes)} or more, or {knobs.devices}"

    def __reduce__(self):  # pickled as it is (ranks send errors to each other): its __init__ takes other arguments
        return _rebuilt, (type(self), self.args, self.__dict__)

    def worded_for(self, knobs: Knobs) -> InfeasibleError:
        """This error with its fix in `knobs`' words (same class, same numbers)."""
        worded = type(self).__new__(type(self))
        worded.__dict__.update(self.__dict__)
        worded.args = (f"{self.cause}\n  fix: {self.fix(knobs)}",)
        return worded


def _rebuilt(cls: type, args: tuple, state: dict) -> InfeasibleError:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class SearchTimeoutError(InfeasibleError):
    """The search stopped at its time limit (`time_limit_s`) before it found a plan within the budget or proved that
    none exists. `min_memory_bytes` is then the least need of a plan it did find (None: none in time), and the
    fix offers more time first."""

    def __init__(self, cause: str, time_limit_s: float, min_memory_bytes: float | None = None,
                 lower_bound_bytes: float | None = None, fits_bytes: float | None = None, knobs: Knobs = SOLVER_KNOBS):
        self.time_limit_s = time_limit_s
        super().__init__(cause, min_memory_bytes, lower_bound_bytes, fits_bytes, knobs)

    def fix(self, knobs: Knobs) -> str:
        more_time = f"pass {knobs.time_limit(2 * self.time_limit_s)} or more"
        return more_time if self.fits_bytes is None else f"{more_time}, or {knobs.memory(self.fits_bytes)} or more"


class PlanMismatchError(AutoparError):
    """A saved plan does not match the model/mesh it is applied to; lists what differs."""

    def __init__(self, message: str, differences: tuple[str, ...] = ()):
        super().__init__(message)
        self.differences = differences


class PlanFormatError(AutoparError):
    """A plan file is corrupt or of an unknown schema version."""


class ModelFileError(AutoparError):
    """A MODEL.py file (or --hf-config preset) could not give a model and a sample input."""


class UsageError(AutoparError):
    """Bad command-line arguments: the CLI exits with code 2."""


class InputsDifferError(AutoparError):
    """Ranks fed inputs of different shapes (or structure, or mode) in one step to a plan that exchanges
    activations between ranks (`runtime.same_inputs`)."""


class CallMismatchError(AutoparError):
    """The ranks made different collective calls of a parallel module at once (rank 0 a state dict or an
    evaluation alone, as a DDP loop does), or some made none in time (`runtime.arrival`)."""


class AlreadyParallelError(AutoparError):
    """A parallel module was handed to a wrapper that syncs or broadcasts parameters itself
    (`DistributedDataParallel`, which trainers wrap models in)."""


class CollectiveError(AutoparError):
    """A collective failed under a parallel module: a peer rank died, stopped or raised (`runtime.peers`); says
    what each rank was last doing, above the backend's own words."""


class InvalidValueError(AutoparError, ValueError):
    """An argument is out of its range (a NaN, infinite, zero or negative budget, time limit or mesh size)."""


class CheckpointError(AutoparError):
    """A checkpoint cannot be written or read as asked, or is corrupt (`runtime.checkpoints`): names the file and
    the tensor."""


class DriftError(AutoparError):
    """Copies of a replicated parameter differ across ranks (`runtime.drift`): names the parameter."""


class MissingDependencyError(AutoparError):
    """An optional package a feature needs is not installed; the message names the pip command."""
