"""The parallel module's submodules look like the model's: their classes and plain attributes.

    dress_like(pm, model)
    isinstance(pm.transformer.h[0].ln_1, nn.LayerNorm)   # True, as on the model

A `ParallelModule` keeps the model's parameter and buffer names by registering them
on containers at the model's paths. Plain `nn.Module` containers answered every
question about a module's type with "no", and code that sorts parameters by the
type of the module holding them then sorted them otherwise than on one device:
Hugging Face's Trainer leaves the weights of `nn.LayerNorm` modules out of weight
decay by type (GPT-2's `ln_1`, CLIP's `layer_norm1`, whose names its patterns miss),
so they were decayed, silently. Each container now takes the class of the model's
module at its path and the plain (non-tensor, non-module) attributes that module
holds (`normalized_shape`, `eps`, a config): `isinstance`, `repr`, indexing a
`ModuleList` work as on the model. Its forward is refused: the graph computes the
model, and a submodule run on this rank's shards would not compute its part of it.
"""
from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import nn


def dress_like(module: nn.Module, model: nn.Module) -> None:
    """Give each plain container under `module` the class and plain attributes of `model`'s module at its path."""
    for path, original in model.named_modules():
        if not path:
            continue  # the root is the parallel module itself
        try:
            container = module.get_submodule(path)
        except AttributeError:  # a module with no parameters or buffers (dropout, an activation) has no container
            continue
        if type(container) is not nn.Module:
            continue
        own = vars(container)  # its parameters, buffers, children and (empty) hooks stay its own
        for key, value in vars(original).items():
            if key not in own and not isinstance(value, (torch.Tensor, nn.Module)):
                own[key] = value
        for mine, theirs in ((container._parameters, original._parameters), (container._buffers, original._buffers)):
            for name, value in theirs.items():
                if value is None:  # registered empty (`nn.Linear(bias=False)`'s bias): as the model has it
                    mine.setdefault(name, None)
        container.__class__ = type(original)
        container.forward = _refuse_forward


def _refuse_forward(*args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError("a submodule of a parallel module holds this rank's shards and does not run: call the parallel "
                       "module itself, which computes the whole model (its outputs hold what the submodule would give)")
