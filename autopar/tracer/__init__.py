"""Stage 1: capture the model as a core-ATen fx graph on fake tensors."""
from autopar.tracer.call_arguments import CallArguments, split_sample_input
from autopar.tracer.capture import TracedGraph, trace
from autopar.tracer.device import with_device
from autopar.tracer.nodes import module_path, output_vals, tensor_args

__all__ = ["CallArguments", "TracedGraph", "trace", "split_sample_input", "tensor_args", "output_vals", "module_path", "with_device"]
