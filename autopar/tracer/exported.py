"""What the tracer reads of torch.export's result: the graph, what its inputs and outputs are, the state.

An `ExportedProgram` checks itself against the module it came from; a graph built from one (the copies
of a stack of identical blocks, `repeated_blocks`) is not the export of any module, so the tracer's
passes read this plain record instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import fx
from torch.export.graph_signature import InputSpec, OutputSpec
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class Exported:
    gm: fx.GraphModule
    input_specs: tuple[InputSpec, ...]  # one per placeholder, in order
    output_specs: tuple[OutputSpec, ...]  # one per output, in order
    state_dict: Mapping[str, torch.Tensor]  # parameter and buffer FQN -> tensor
    constants: Mapping[str, torch.Tensor]  # lifted tensor constant FQN -> tensor
    out_spec: pytree.TreeSpec  # structure of the user outputs

    @classmethod
    def of(cls, ep: torch.export.ExportedProgram) -> "Exported":
        return cls(gm=ep.graph_module, input_specs=tuple(ep.graph_signature.input_specs),
                   output_specs=tuple(ep.graph_signature.output_specs), state_dict=ep.state_dict,
                   constants=ep.constants, out_spec=ep.call_spec.out_spec)
