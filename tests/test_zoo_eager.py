"""Every zoo model in examples/ builds, trains one eager step on cpu, and builds at full size on meta."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.codegen.harness import call, loss_of
from tests.zoo import ZOO, load_zoo


def run(model: torch.nn.Module, sample) -> torch.Tensor:
    return loss_of(call(model, sample))


def tiny_step(module: ModuleType, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    model, sample = module.build(batch_size=2, seq_len=16, size="tiny", device="cpu", seed=seed)
    loss = run(model, sample)
    loss.backward()
    return model, loss.detach()


@pytest.fixture(scope="module", params=ZOO)
def zoo(request) -> ModuleType:
    return load_zoo(request.param)


def test_tiny_trains_on_cpu(zoo):
    model, loss = tiny_step(zoo)
    assert model.training
    assert loss.ndim == 0 and torch.isfinite(loss), loss
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_same_seed_same_loss(zoo):
    _, a = tiny_step(zoo, seed=3)
    _, b = tiny_step(zoo, seed=3)
    _, c = tiny_step(zoo, seed=4)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)


def test_default_size_builds_on_meta(zoo):
    model, sample = zoo.build()  # the real default size, on meta: no memory, whatever its size
    assert all(p.is_meta for p in model.parameters())
    tensors = sample.values() if isinstance(sample, dict) else sample if isinstance(sample, tuple) else [sample]
    assert all(t.is_meta for t in tensors)


@pytest.mark.parametrize(
    ("name", "size", "n_params"),
    [
        ("gpt2", "small", 124_439_808),  # tied LM head counted once
        ("hf_gpt2", "small", 124_439_808),
        ("llama", "7b", 6_738_415_616),
        ("hf_llama", "7b", 6_738_415_616),
        ("llama", "8b-gqa", 8_030_261_248),
        ("bert", "base", 109_483_778),  # == HF BertForSequenceClassification, 2 labels
        ("vit", "base", 86_567_656),  # == timm vit_base_patch16_224
        ("resnet", "resnet18", 11_689_512),  # == torchvision resnet18
    ],
)
def test_param_count(name, size, n_params):
    model, _ = load_zoo(name).build(size=size)
    assert sum(p.numel() for p in model.parameters()) == n_params
