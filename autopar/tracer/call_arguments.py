"""The forms a sample input (and a batch) takes: `model(*args, **kwargs)` as `(args, kwargs)`."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class CallArguments:
    """A sample input of positional and keyword arguments at once: `model(*args, **kwargs)`."""

    args: tuple
    kwargs: dict


pytree.register_dataclass(CallArguments, serialized_type_name="autopar.CallArguments")


def split_sample_input(sample_input: Any) -> tuple[tuple, dict]:
    """A sample input is a tensor, a tuple/list of positional args, a mapping of kwargs (a dict, or a tokenizer's
    `BatchEncoding`, which export takes only as a dict), or `CallArguments`."""
    if isinstance(sample_input, CallArguments):
        return tuple(sample_input.args), dict(sample_input.kwargs)
    if isinstance(sample_input, Mapping):
        return (), dict(sample_input)
    if isinstance(sample_input, (tuple, list)):
        return tuple(sample_input), {}
    return (sample_input,), {}
