"""Every error autopar raises on purpose: each names the offending value and the fix."""
from __future__ import annotations


class AutoparError(Exception):
    """Base class: catch this to handle any autopar failure."""


class TraceError(AutoparError):
    """The model could not be captured as a graph (names the user's source line)."""


class InfeasibleError(AutoparError):
    """No plan fits the memory budget; carries the minimum that would fit.

    `min_memory_bytes`: what the leanest plan found needs (`ilp.budget_that_fits` of it is a budget that
    fits). `lower_bound_bytes`: what
    every plan needs at least, as the solver proved it: the same number unless the search for the leanest
    plan stopped at its time limit."""

    def __init__(self, message: str, min_memory_bytes: float | None = None, lower_bound_bytes: float | None = None):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.lower_bound_bytes = min_memory_bytes if lower_bound_bytes is None else lower_bound_bytes


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
