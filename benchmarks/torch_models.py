"""Models users write with torch.nn alone: does the solver's plan train them like one device?

    python benchmarks/torch_models.py                          # every model, 2 ranks, ample memory
    python benchmarks/torch_models.py --mesh 2x2 --fraction 0.35 --only lstm,sdpa_mask

A diagnostic sweep beside `hf_families.py`, over what is not a transformers model: recurrent layers
(unrolled by the trace), torch's own attention and encoder modules, 1-D and 2-D convolutions with batch
and group norm, a weight-norm parametrization, einsum, a diffusion-style MLP, nn.Transformer's encoder-decoder,
FNet's Fourier mixing (complex values) and a recommendation model's embedding bags. Each model is parallelized with the solver's plan (at `--fraction` of the memory
its ample-memory plan needs, when given) and takes one step; the table gives the loss and the largest
gradient error against the same step on one device, read back as in `hf_families.py`: one SGD step with
learning rate 1, then the full state dicts' differences. A model that fails prints the error's last line
(a budget no plan fits says so, with the need).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.runtime.launch import run_ranks
from autopar.tracer import split_sample_input
from _common import provenance_line, sweep, sweep_options

VOCAB, HIDDEN, BATCH, STEPS = 64, 32, 8, 12


class RecurrentLM(nn.Module):
    def __init__(self, cell: type[nn.Module] = nn.LSTM):
        super().__init__()
        self.emb, self.out = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
        self.rnn = cell(HIDDEN, HIDDEN, num_layers=2, batch_first=True)

    def forward(self, ids, labels):
        hidden, _ = self.rnn(self.emb(ids))
        return F.cross_entropy(self.out(hidden).flatten(0, 1), labels.flatten())


class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
        layer = nn.TransformerEncoderLayer(HIDDEN, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.enc, self.head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(HIDDEN, 5)

    def forward(self, ids, classes):
        return F.cross_entropy(self.head(self.enc(self.emb(ids)).mean(1)), classes, label_smoothing=0.1)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.out = nn.Embedding(VOCAB, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)
        self.attn = nn.MultiheadAttention(HIDDEN, 4, batch_first=True)

    def forward(self, ids, labels):
        x = self.emb(ids)
        mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)
        attended, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return F.cross_entropy(self.out(self.norm(x + attended)).flatten(0, 1), labels.flatten())


class AudioClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(1, 8, 5, padding=2), nn.BatchNorm1d(8), nn.ReLU(), nn.MaxPool1d(2),
                                 nn.Conv1d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                                 nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(16, 4))

    def forward(self, audio, classes):
        return F.cross_entropy(self.net(audio), classes)


class SmallUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down, self.mid = nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.up, self.out = nn.ConvTranspose2d(8, 8, 2, stride=2), nn.Conv2d(11, 3, 1)

    def forward(self, image, target):
        h = self.up(F.relu(self.mid(F.relu(self.down(image)))))
        h = F.interpolate(h, scale_factor=1.0, mode="nearest")
        return F.mse_loss(self.out(torch.cat([h, image], 1)), target)


class WeightNormRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.utils.parametrizations.weight_norm(nn.Linear(HIDDEN, HIDDEN))
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x, y):
        return F.mse_loss(self.out(torch.tanh(self.hidden(x))).squeeze(-1), y)


class EinsumMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.randn(4, HIDDEN, HIDDEN) / HIDDEN**0.5)
        self.norm, self.head = nn.RMSNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, labels):
        x = F.one_hot(ids, VOCAB).float() @ self.head.weight  # the head's weight read as an embedding too
        logits = self.head(F.gelu(self.norm(torch.einsum("bth,ehk->btk", x, self.mix) / 4)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


class DiffusionMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.time = nn.Sequential(nn.Linear(16, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN))
        self.inp, self.out = nn.Linear(8, HIDDEN), nn.Linear(HIDDEN, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 2 * HIDDEN), nn.GLU(),
                                                  nn.Linear(HIDDEN, HIDDEN)) for _ in range(2))

    def forward(self, x, t, noise):
        freqs = torch.exp(-math.log(10000) * torch.arange(8, dtype=torch.float32) / 8)
        h = self.inp(x) + self.time(torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], -1))[:, None]
        for block in self.blocks:
            h = h + block(h)
        return F.mse_loss(self.out(h), noise)


class MaskedAttentionLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, keep, labels):
        b, t = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, t, 3, 4, HIDDEN // 4).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        logits = self.out(attended.transpose(1, 2).reshape(b, t, HIDDEN))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Recommender(nn.Module):
    """DLRM's shape: dense features through an MLP, sparse ones through embedding bags, an MLP on both."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Sequential(nn.Linear(8, HIDDEN), nn.ReLU())
        self.items = nn.EmbeddingBag(1024, HIDDEN, mode="sum")
        self.words = nn.EmbeddingBag(VOCAB, HIDDEN, mode="mean", padding_idx=0)
        self.top = nn.Sequential(nn.Linear(3 * HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, dense, items, item_weights, words, clicked):
        h = torch.cat([self.dense(dense), self.items(items, per_sample_weights=item_weights), self.words(words)], 1)
        return F.binary_cross_entropy_with_logits(self.top(h).squeeze(1), clicked)


class Seq2SeqTransformer(nn.Module):
    """nn.Transformer, encoder and decoder: a padded source, a causal target mask (said to be causal: torch
    would otherwise test its values, which export cannot)."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
        self.transformer = nn.Transformer(HIDDEN, 4, 1, 1, 2 * HIDDEN, dropout=0.0, batch_first=True)

    def forward(self, src, tgt, labels):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.transformer(self.emb(src), self.emb(tgt), tgt_mask=mask, tgt_is_causal=True,
                             src_key_padding_mask=src == 0)
        return F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten())


class FourierMixer(nn.Module):
    """FNet: tokens mixed by a 2-D Fourier transform's real part (complex values between the two FFTs)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(2))
        self.ff = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = self.norms[0](h + torch.fft.fft(torch.fft.fft(h, dim=-1), dim=-2).real)
        h = self.norms[1](h + self.ff(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, STEPS))


def _padded_ids() -> torch.Tensor:
    ids = _ids()
    ids[::2, -3:] = 0  # every other sequence ends in padding
    return ids


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]] = {  # name -> (model, sample input)
    "lstm": (RecurrentLM, lambda: (_ids(), _ids())),
    "gru": (lambda: RecurrentLM(nn.GRU), lambda: (_ids(), _ids())),
    "transformer_encoder": (EncoderClassifier, lambda: (_ids(), torch.randint(0, 5, (BATCH,)))),
    "multihead_attention": (CausalSelfAttention, lambda: (_ids(), _ids())),
    "audio_conv1d": (AudioClassifier, lambda: (torch.randn(BATCH, 1, 32), torch.randint(0, 4, (BATCH,)))),
    "unet_conv2d": (SmallUNet, lambda: (torch.randn(BATCH, 3, 8, 8), torch.randn(BATCH, 3, 8, 8))),
    "weight_norm": (WeightNormRegressor, lambda: (torch.randn(BATCH, HIDDEN), torch.randn(BATCH))),
    "einsum_rmsnorm": (EinsumMixer, lambda: (_ids(), _ids())),
    "diffusion_mlp": (DiffusionMLP, lambda: (torch.randn(BATCH, 6, 8), torch.rand(BATCH) * 100, torch.randn(BATCH, 6, 8))),
    "sdpa_mask": (MaskedAttentionLM, lambda: (_ids(), torch.rand(BATCH, STEPS) > 0.2, _ids())),
    "fourier_mixing": (FourierMixer, lambda: (_ids(), _ids())),
    "seq2seq_transformer": (Seq2SeqTransformer, lambda: (_padded_ids(), _ids(), _ids())),
    "embedding_bag": (Recommender, lambda: (torch.randn(BATCH, 8), torch.randint(0, 1024, (BATCH, 6)), torch.rand(BATCH, 6),
                                            torch.randint(0, VOCAB, (BATCH, 4)), torch.randint(0, 2, (BATCH,)).float())),
}


def _loss(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _step(rank, world, model, sample, mesh, fraction):
    """One SGD step (lr 1) under the solver's plan: the loss, and the full parameters' change (the gradients)."""
    pm = autopar.parallelize(copy.deepcopy(model), sample, mesh)
    if fraction is not None:
        budget = fraction * pm.plan.memory.total_bytes
        pm = autopar.parallelize(copy.deepcopy(model), sample, mesh, memory_budget=budget)
    args, kwargs = pm.local_batch(split_sample_input(sample))
    loss = _loss(pm(*args, **kwargs))
    loss.backward()
    torch.optim.SGD(pm.parameters(), lr=1.0).step()
    after = pm.state_dict()
    return loss.item(), {k: v - after[k] for k, v in model.state_dict().items() if v.is_floating_point()}


def check(name: str, mesh: tuple[int, ...], fraction: float | None) -> tuple[float, float, float]:
    """(single-device loss, loss error, largest gradient error) of one model."""
    torch.manual_seed(0)
    build, make_sample = MODELS[name]
    model, sample = build(), make_sample()
    ref = copy.deepcopy(model)
    ref_loss = _loss(ref(*sample))
    ref_loss.backward()
    loss, step = run_ranks(_step, math.prod(mesh), model, sample, mesh, fraction, timeout_s=600)[0]
    grad_error = max((step[k] - p.grad).abs().max().item() for k, p in ref.named_parameters() if p.grad is not None)
    return ref_loss.item(), abs(loss - ref_loss.item()), grad_error


def main() -> None:
    opts, mesh, names = sweep_options(__doc__.splitlines()[0], "model", MODELS, lambda parser: parser.add_argument(
        "--fraction", type=float, help="plan at this fraction of the ample-memory plan's need"))
    failed = sweep("model", names, lambda name: check(name, mesh, opts.fraction), ("loss", "loss err", "grad err"))
    print(provenance_line("torch_models", mesh=opts.mesh, fraction=opts.fraction, failed=failed))


if __name__ == "__main__":
    main()
