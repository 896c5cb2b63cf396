"""Models from the packages users install, trained as users would bring them: like one device?

    pip install -e .[zoo]                                   # timm, diffusers, x-transformers, transformers
    python benchmarks/real_models.py                        # every model, 2 and 4 ranks, ample and tight memory
    python benchmarks/real_models.py --only swin,unet2d --ranks 4 --tight 0.5

Each model (small configurations of the packages' own classes, built from code: no weights are
downloaded) is parallelized by `autopar.parallelize` on 2 ranks (mesh 2) and 4 ranks (mesh 2x2), at
an ample budget (the hardware's memory) and a tight one (`--tight` times what the ample plan needs),
and trained 3 steps. One device trains a copy of it the same 3 steps.

The comparison is SGD (learning rate `LR`), not AdamW: a gradient that is zero in exact arithmetic
(an attention key's bias, which softmax ignores) carries float32 round-off of about 1e-13, which
AdamW's normalisation turns into steps of +-lr, so AdamW would show a large difference where nothing
is wrong, and a threshold loose enough to pass it could hide a real error. Under SGD a parameter
moves by lr times its gradient, round-off stays round-off, and a wrong gradient shows in full. The
table gives the largest difference of the loss over the 3 steps (relative) and of any parameter
after them, divided by the learning rate (so in units of summed gradients), beside the same
parameter difference between one device in float32 and one in float64 (`fp32 err`: how far float32
round-off alone moves this model, the floor a distributed run cannot be expected to beat), and the
plan's predicted memory. A run that fails prints the last line of its error; a tight budget no plan meets says so.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import autopar
from autopar.runtime.launch import run_ranks
from autopar.tracer import split_sample_input
from autopar.tracer.closures import deep_copy
from _common import provenance_line

LR, STEPS, BATCH = 0.05, 3, 4


class WithLoss(nn.Module):
    """A model whose forward returns an output, with the loss a training loop computes from it."""

    def __init__(self, model: nn.Module, loss: Callable[[Any, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x, target):
        return self.loss(self.model(x), target)


def _image_classifier(make: Callable[[], nn.Module], size: int = 32) -> tuple[nn.Module, tuple]:
    model = WithLoss(make(), F.cross_entropy)
    return model, (torch.randn(BATCH, 3, size, size), torch.randint(0, 10, (BATCH,)))


def _timm(name: str, **kwargs: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    """timm's model class `name` (`timm.models.<module>.<Class>`), small as `kwargs` make it, 10 classes."""
    def build() -> tuple[nn.Module, tuple]:
        module, _, cls = name.rpartition(".")
        make = getattr(importlib.import_module(f"timm.models.{module}"), cls)
        return _image_classifier(lambda: make(num_classes=10, **kwargs), kwargs.get("img_size", 32))
    return build


def _timm_named(name: str, size: int = 32) -> Callable[[], tuple[nn.Module, tuple]]:
    """timm's registered model `name` as `timm.create_model` builds it, 10 classes, on `size`-pixel images."""
    def build() -> tuple[nn.Module, tuple]:
        import timm
        return _image_classifier(lambda: timm.create_model(name, pretrained=False, num_classes=10), size)
    return build


def _unet2d() -> tuple[nn.Module, tuple]:
    from diffusers import UNet2DModel

    class Denoiser(nn.Module):
        def __init__(self):
            super().__init__()
            self.unet = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                    block_out_channels=(32, 64), norm_num_groups=8,
                                    down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"))

        def forward(self, noisy, timesteps, noise):
            return F.mse_loss(self.unet(noisy, timesteps).sample, noise)

    return Denoiser(), (torch.randn(BATCH, 3, 16, 16), torch.randint(0, 1000, (BATCH,)), torch.randn(BATCH, 3, 16, 16))


def _x_transformer() -> tuple[nn.Module, tuple]:
    from x_transformers import Decoder, TransformerWrapper

    lm = TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=Decoder(dim=32, depth=2, heads=2, rotary_pos_emb=True))
    model = WithLoss(lm, lambda logits, labels: F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    return model, (torch.randint(0, 64, (BATCH, 16)), torch.randint(0, 64, (BATCH, 16)))


def _tokens(vocab: int, seq: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (BATCH, seq))
    return {"input_ids": ids, "labels": ids.clone()}


def _hf(config_name: str, model_name: str, sample: Callable[[], Any], **config: Any) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        import transformers
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config)), sample()
    return build


def _whisper_sample() -> dict[str, torch.Tensor]:
    return {"input_features": torch.randn(BATCH, 16, 32), "labels": torch.randint(0, 64, (BATCH, 8))}


def _clip_sample() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 64, (BATCH, 8)), "pixel_values": torch.randn(BATCH, 3, 32, 32), "return_loss": True}


def _clip() -> tuple[nn.Module, Any]:
    import transformers
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                           patch_size=8), projection_dim=16)
    return transformers.CLIPModel(config), _clip_sample()


_SMALL_TEXT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2)
MODELS: dict[str, tuple[str, Callable[[], tuple[nn.Module, Any]]]] = {  # name -> (package, build)
    "vit": ("timm", _timm("vision_transformer.VisionTransformer", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
    "convnext": ("timm", _timm("convnext.ConvNeXt", depths=(1, 1, 1, 1), dims=(16, 32, 64, 128))),
    "swin": ("timm", _timm("swin_transformer.SwinTransformer", img_size=32, patch_size=2, window_size=4, embed_dim=24,
                           depths=(1, 1), num_heads=(1, 2), drop_path_rate=0.0)),  # (random: timm's default is 0.1)
    "mlp_mixer": ("timm", _timm("mlp_mixer.MlpMixer", img_size=32, patch_size=8, num_blocks=2, embed_dim=32)),
    # 64 pixels: at 32 its last batch norms see 1x1 maps of a batch of 4, and float32 round-off alone moves the
    # parameters by 29 learning rates in 3 steps (`fp32 err`); at 64, by 9e-5
    "mobilenetv3": ("timm", _timm_named("mobilenetv3_small_050", size=64)),
    "resnet18": ("timm", _timm_named("resnet18")),
    "unet2d": ("diffusers", _unet2d),
    "x_transformer": ("x-transformers", _x_transformer),
    "whisper": ("transformers", _hf("WhisperConfig", "WhisperForConditionalGeneration", _whisper_sample, vocab_size=64,
                                    d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                                    max_source_positions=16, max_target_positions=16, decoder_start_token_id=1,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "clip": ("transformers", _clip),
    "mamba": ("transformers", _hf("MambaConfig", "MambaForCausalLM", lambda: _tokens(64), **_SMALL_TEXT, state_size=4)),
    "rwkv": ("transformers", _hf("RwkvConfig", "RwkvForCausalLM", lambda: _tokens(64), **_SMALL_TEXT, attention_hidden_size=32,
                                 intermediate_size=64, context_length=16)),
    "xlnet": ("transformers", _hf("XLNetConfig", "XLNetLMHeadModel", lambda: _tokens(64), vocab_size=64, d_model=32, n_layer=2,
                                  n_head=2, d_inner=64, dropout=0.0)),  # (random: its default is 0.1)
}


def _loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, tuple) else out.loss


def _call(model: nn.Module, sample: Any) -> Any:
    args, kwargs = split_sample_input(sample)
    return model(*args, **kwargs)


def _train(rank, world, model, sample, budget):
    """STEPS SGD steps under the solver's plan: (losses, rank 0's full parameters after, the plan's memory)."""
    mesh = (2,) if world == 2 else (2, world // 2)
    pm = autopar.parallelize(deep_copy(model), sample, mesh, memory_budget=budget)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    args, kwargs = pm.local_batch(split_sample_input(sample))
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(pm(*args, **kwargs))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = pm.state_dict()
    return losses, state if rank == 0 else None, pm.plan.memory.total_bytes


def _reference(model: nn.Module, sample: Any, dtype: torch.dtype = torch.float32) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One device's STEPS SGD steps, in `dtype`: (losses, parameters and buffers after)."""
    ref = deep_copy(model).to(dtype)
    sample = pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, sample)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(_call(ref, copy.deepcopy(sample)))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, ref.state_dict()


def _errors(losses: list[float], state: dict[str, torch.Tensor], ref: tuple) -> tuple[float, float]:
    """(largest relative loss difference over the steps, largest parameter difference after them / LR)."""
    ref_losses, ref_state = ref
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    step_err = max((state[k].double() - v.double()).abs().max().item() for k, v in ref_state.items() if v.is_floating_point())
    return loss_err, step_err / LR


def _row(name: str, ranks: int, budget_text: str, result: Any, noise: tuple[float, float]) -> None:
    print(f"{name:14} {ranks:>5} {budget_text:>16} " + (result if isinstance(result, str) else
          "{:>9.1e} {:>9.1e} {:>9.1e} {:>10.2f} {:>6.0f}".format(result[0], result[1], noise[1], result[2] / 2**20, result[3])),
          flush=True)


def _run(name: str, model: nn.Module, sample: Any, ref: tuple, ranks: int, budget: float | None) -> tuple[float, ...] | str:
    start = time.perf_counter()
    try:
        results = run_ranks(_train, ranks, model, sample, budget, timeout_s=900)
    except Exception as err:  # a sweep reports every model: the error's last line is the row
        return "failed: " + str(err).strip().splitlines()[-1][:200]
    losses, state, need = results[0]
    return (*_errors(losses, state, ref), need, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model names (default: all): " + ", ".join(MODELS))
    parser.add_argument("--ranks", default="2,4", help="comma-separated world sizes: 2 runs on mesh 2, 4 on mesh 2x2")
    parser.add_argument("--tight", type=float, default=0.6, help="the tight budget, as a fraction of the ample plan's need")
    opts = parser.parse_args()
    names = opts.only.split(",") if opts.only else list(MODELS)
    print(f"{'model':14} {'ranks':>5} {'budget':>16} {'loss err':>9} {'step err':>9} {'fp32 err':>9} {'need MiB':>10} {'wall s':>6}")
    failed = 0
    for name in names:
        package, build = MODELS[name]
        try:
            torch.manual_seed(0)
            model, sample = build()
        except ImportError as err:
            _row(name, 0, "", f"skipped: {err} (pip install {package}, or .[zoo])", (0.0, 0.0))
            continue
        ref = _reference(model, sample)
        noise = _errors(*_reference(model, sample, torch.float64), ref)  # one device in float32 against float64
        for ranks in (int(r) for r in opts.ranks.split(",")):
            ample = _run(name, model, sample, ref, ranks, None)
            _row(name, ranks, "ample", ample, noise)
            failed += isinstance(ample, str)
            if isinstance(ample, str):
                continue
            need = ample[2]
            tight = _run(name, model, sample, ref, ranks, opts.tight * need)
            _row(name, ranks, f"{opts.tight:g}x = {opts.tight * need / 2**20:.2f} MiB", tight, noise)
            failed += isinstance(tight, str)
    print(provenance_line("real_models", ranks=opts.ranks, tight=opts.tight, lr=LR, steps=STEPS, failed=failed))


if __name__ == "__main__":
    main()
