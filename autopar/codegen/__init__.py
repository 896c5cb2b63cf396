"""Stage 5: lower a Plan to one rank's distributed fx.GraphModule (local shards, explicit collectives)."""
from autopar.codegen.lower import LoweringInfo, lower
from autopar.codegen.module import ParallelModule
from autopar.codegen.shapes import LoweringError

__all__ = ["lower", "LoweringInfo", "LoweringError", "ParallelModule"]
