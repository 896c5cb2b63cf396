"""autopar: automatic parallelization of PyTorch training.

    model = autopar.parallelize(model, sample_input, device_mesh=(2, 2))

The pipeline (each stage a package, data flowing one way):
tracer.trace -> profiler.profile -> solver.solve -> codegen.lower -> runtime.
"""
from autopar.compat import settle_autograd_engine

settle_autograd_engine()  # first, before anything runs backward on fake tensors (torch 2.11 and 2.12)

from autopar.api import parallelize
from autopar.mixed_precision import MixedPrecision
from autopar.errors import AutoparError, InfeasibleError, MissingDependencyError, PlanFormatError, PlanMismatchError, TraceError
from autopar.solver.plan import Plan
from autopar.solver.plan_io import load_plan, save_plan

__all__ = [
    "parallelize",
    "MixedPrecision",
    "Plan",
    "load_plan",
    "save_plan",
    "AutoparError",
    "TraceError",
    "InfeasibleError",
    "PlanMismatchError",
    "PlanFormatError",
    "MissingDependencyError",
]
