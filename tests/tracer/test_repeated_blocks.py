"""A stack of identical blocks captured two deep and copied: the same graph as the whole model's capture,
and the whole capture wherever the blocks do not run alike."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.profiler import profile
from autopar.tracer import capture, repeated_blocks, trace
from tests.zoo import load_zoo


def node_rows(traced) -> list[tuple]:
    """Per node: kind, name, target, what it reads, its output's shape and dtype, and its module path."""
    rows = []
    for n in traced.gm.graph.nodes:
        val = n.meta.get("val")
        reads = [a.name if isinstance(a, torch.fx.Node) else repr(a) for a in pytree.tree_leaves((n.args, n.kwargs))]
        rows.append((n.op, n.name, str(n.target), reads, tuple(map(str, val.shape)) if isinstance(val, torch.Tensor) else None,
                     val.dtype if isinstance(val, torch.Tensor) else None, n.meta.get("nn_module_stack")))
    return rows


FIELDS = ("param_fqns", "buffer_fqns", "input_names", "in_spec", "out_spec", "output_names", "loss_index",
          "buffer_mutations", "tied_params", "symbols", "nonpersistent_buffers")


@pytest.fixture
def copies(monkeypatch) -> list[bool]:
    """Stacks of 3 or more blocks copied; one entry per trace: whether its stack was copied."""
    made: list[bool] = []
    stamped = capture.export_stamped

    def spy(*args):
        result = stamped(*args)
        made.append(result is not None)
        return result
    monkeypatch.setattr(capture, "export_stamped", spy)
    monkeypatch.setattr(repeated_blocks, "MIN_BLOCKS", 3)
    return made


def whole(model, sample, **kw):
    """The model traced without copying blocks: the reference."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(repeated_blocks, "MIN_BLOCKS", 10**9)
        return trace(model, sample, **kw)


def four_layer_gpt():
    gpt2 = load_zoo("gpt2")
    gpt2.CONFIGS["four-layer"] = dataclasses.replace(gpt2.CONFIGS["tiny"], n_layer=4)
    try:
        return gpt2.build(2, 16, size="four-layer", device="meta")
    finally:
        del gpt2.CONFIGS["four-layer"]


def four_layer_hf_llama():
    import transformers as hf

    cfg = hf.LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128, max_position_embeddings=64, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = hf.LlamaForCausalLM(cfg).train()
        ids = torch.randint(0, 128, (2, 16))
    return model, {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("build", [four_layer_gpt, four_layer_hf_llama], ids=["gpt", "hf-llama"])
def test_copied_blocks_make_the_whole_models_graph(copies, build):
    model, sample = build()
    reference = whole(model, sample)
    traced = trace(model, sample)
    assert copies == [True]
    assert node_rows(traced) == node_rows(reference)
    for name in FIELDS:
        assert getattr(traced, name) == getattr(reference, name), name
    ours, theirs = profile(traced), profile(reference)
    assert ours.nodes == theirs.nodes and ours.params == theirs.params


class Block(nn.Module):
    def __init__(self, index: int, reads_index: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.index = index  # differs from block to block
        self.reads_index = reads_index

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if self.reads_index and self.index == 3:
            scale = 2.0
        return x + torch.tanh(self.fc(x)) * scale


class Stack(nn.Module):
    """Four blocks; `variant` makes them run unlike each other in one way the copy must notice."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.blocks = nn.ModuleList(Block(i, reads_index=variant == "index-read") for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = []
        for i, block in enumerate(self.blocks):
            if self.variant == "last-scaled":  # the parent treats block 3 unlike the others
                x = block(x, scale=0.5 if i == 3 else 1.0)
            elif self.variant == "work-between":
                x = block(x).relu()
            else:
                x = block(x)
            seen.append(x)
        if self.variant == "all-outputs":
            return torch.stack(seen).sum()
        return x.sum()


@pytest.mark.parametrize("variant,dynamic,copied", [
    ("alike", None, True), ("last-scaled", None, False), ("index-read", None, False), ("work-between", None, False),
    ("all-outputs", None, False),
    ("alike", {"batch": 0}, True),  # a symbolic batch size
])
def test_blocks_that_do_not_run_alike_are_traced_whole(copies, variant, dynamic, copied):
    model, sample = Stack(variant), torch.randn(2, 8)
    reference = whole(model, sample, dynamic_dims=dynamic)
    traced = trace(model, sample, dynamic_dims=dynamic)
    assert copies == [copied]
    assert node_rows(traced) == node_rows(reference)
