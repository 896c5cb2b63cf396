"""Model files and presets for the CLI: where `autopar plan MODEL.py` gets its model.

A MODEL.py defines either `model` and `sample_input` (a tensor, a tuple of
positional args or a dict of kwargs), or `build(batch_size, seq_len, ...)`
returning both. The model should live on the `meta` device so planning a 70B
model needs no 70B of memory: `build` receives `device="meta"` when it accepts
a `device` argument. A model whose batch is not dim 0 of its inputs (a sequence-first
model's `(seq, batch)`) sets `batch_dim` too, as `parallelize(..., batch_dim=)` takes it, so
that the plan prices the inputs as the ranks will feed them. `--hf-config gpt2|llama` builds
Hugging Face models from transformers' own config classes with random weights (nothing is
downloaded).

Unlike a plan file, a model file is Python and is executed: it is the user's code.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.errors import ModelFileError
from autopar.optional import install_command, require

log = logging.getLogger(__name__)

HF_PRESETS = ("gpt2", "llama")


def model_file_batch_dim(path: str | Path) -> Any:
    """The `batch_dim` a MODEL.py sets (`autopar.tracer.batch_dims`), 0 when it sets none."""
    return getattr(import_model_file(path), "batch_dim", 0)


def import_model_file(path: str | Path) -> Any:
    """Import a model file by path (it need not be in a package); imported once per process."""
    path = Path(path)
    # A unique, stable module name per path: two files with the same stem do not collide in
    # sys.modules, and the name is the same in every process (pickling looks modules up by name).
    name = "autopar_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path} is not a Python file\n  fix: pass a .py file that defines `model` and `sample_input` or `build(batch_size, seq_len)`")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name while it runs
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(name, None)
        package = (err.name or "").split(".")[0] if isinstance(err, ModuleNotFoundError) else ""
        if package:
            raise ModelFileError(f"{path} imports {package!r}, which is not installed\n  fix: {install_command(package)}") from err
        raise ModelFileError(f"{path} raised {type(err).__name__} while loading: {err}\n  fix: run `python {path}` to see the full error (or add --debug)") from err
    return module


def _call_build(build: Any, path: Path, batch_size: int | None, seq_len: int | None, device: str, extra: dict[str, Any]) -> tuple[nn.Module, Any]:
    params = inspect.signature(build).parameters
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    # Sizes are passed only when the user gave them: build()'s own defaults are the model's real shape.
    for key, value in (("batch_size", batch_size), ("seq_len", seq_len), *extra.items()):
        if value is None:
            continue
        if key not in params and not takes_any:
            flag = "--" + key.replace("_", "-")
            raise ModelFileError(f"{flag} was given but build() in {path} has no `{key}` argument\n  fix: drop {flag}, or add `{key}` to build()'s arguments")
        kwargs[key] = value
    if "device" in params or takes_any:
        kwargs["device"] = device
    try:
        result = build(**kwargs)
    except Exception as err:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ModelFileError(f"build({args}) in {path} raised {type(err).__name__}: {err}\n  fix: check the options passed to build() (add --debug for the traceback)") from err
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise ModelFileError(f"build() in {path} returned {type(result).__name__}, not (model, sample_input)\n  fix: end build() with `return model, sample_input`")
    return result


def load_model_file(
    path: str | Path,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device: str = "meta",
    **build_kwargs: Any,
) -> tuple[nn.Module, Any]:
    """(model, sample_input) from a MODEL.py; `build_kwargs` (e.g. size="tiny") go to its build()."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file {str(p)!r} does not exist\n  fix: pass the path of a .py file, e.g. `autopar plan examples/gpt2.py --gpus 8`")
    module = import_model_file(p)
    build = getattr(module, "build", None)
    if callable(build):
        return _call_build(build, p, batch_size, seq_len, device, build_kwargs)
    model, sample = getattr(module, "model", None), getattr(module, "sample_input", None)
    if isinstance(model, nn.Module) and sample is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in (("batch_size", batch_size), ("seq_len", seq_len), *build_kwargs.items()) if v is not None]
        if given:
            raise ModelFileError(f"{' '.join(given)} given but {p} defines a fixed `model`/`sample_input`, not build()\n  fix: drop {' '.join(given)}, or define build(batch_size, seq_len) in {p}")
        return model, sample
    raise ModelFileError(
        f"{p} defines neither `model` and `sample_input` nor a `build(batch_size, seq_len)` function\n"
        f"  fix: add `model = ...` and `sample_input = ...` (or `def build(batch_size, seq_len): return model, sample_input`) to {p}"
    )


def load_hf_preset(name: str, batch_size: int | None = None, seq_len: int | None = None, device: str = "meta") -> tuple[nn.Module, Any]:
    """GPT-2 small (GPT2Config()) or a LLaMA-2-7B-shape LlamaConfig, random weights on `device`."""
    if name not in HF_PRESETS:
        raise ModelFileError(f"unknown --hf-config preset {name!r}\n  fix: use one of {', '.join(HF_PRESETS)}")
    transformers = require("transformers", f"--hf-config {name}")  # only these presets need it

    if name == "gpt2":
        config = transformers.GPT2Config(use_cache=False)  # defaults are GPT-2 small, 124M
        cls, batch_size, seq_len = transformers.GPT2LMHeadModel, batch_size or 8, seq_len or 1024
        limit = config.n_positions
    else:
        # LLaMA-2 7B (LlamaConfig's defaults spelled out so a transformers change cannot move them).
        config = transformers.LlamaConfig(
            num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
            intermediate_size=11008, vocab_size=32000, max_position_embeddings=2048, use_cache=False,
        )
        cls, batch_size, seq_len = transformers.LlamaForCausalLM, batch_size or 1, seq_len or 2048
        limit = config.max_position_embeddings
    if seq_len > limit:
        raise ModelFileError(f"--seq-len {seq_len} exceeds the {name} context of {limit}\n  fix: pass --seq-len {limit} or less")
    config._attn_implementation = "sdpa"  # one attention node the solver can split by heads
    with torch.device(device):
        model = cls(config).train()
        input_ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    return model, {"input_ids": input_ids, "labels": input_ids.clone()}  # HF shifts labels itself
