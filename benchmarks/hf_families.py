"""Hugging Face families as users build them: does the solver's plan train like one device?

    python benchmarks/hf_families.py                        # every family, 2 ranks, ample memory
    python benchmarks/hf_families.py --only qwen2,t5 --mesh 2x2 --memory 1.2e6

A diagnostic sweep, wider than `tests/test_hf_families.py` (eight of these families):
each family is a tiny random model from its transformers config, dropout off, with
the config's defaults otherwise (KV cache on). It is parallelized with the solver's
plan on gloo ranks and takes one step; the table gives the loss and the largest
gradient error against the same step on one device: absolute, or relative to the
tensor's largest gradient where that is above 1 (DeiT's class token has gradients near 3e3). Gradients are read back
whatever the plan's layout: one SGD step with learning rate 1 on both sides, then
the full state dicts' differences. The last column is eval mode (`pm.eval()`) with the
config's own dropout: the loss error against the model's eval loss on one device. A
family that fails prints the error's last line.
"""
from __future__ import annotations

import copy
import math

import torch
import transformers as hf

import autopar
from autopar.runtime.launch import run_ranks
from autopar.tracer import split_sample_input
from _common import provenance_line, sweep, sweep_options

_LM = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
_KV = dict(_LM, num_key_value_heads=2)
_BERT = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)

FAMILIES = {  # name -> (model builder, input kind)
    "qwen2": (lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**_KV)), "lm"),
    "mistral": (lambda: hf.MistralForCausalLM(hf.MistralConfig(**_KV)), "lm"),
    "gemma": (lambda: hf.GemmaForCausalLM(hf.GemmaConfig(**_KV, head_dim=16)), "lm"),
    "gemma2": (lambda: hf.Gemma2ForCausalLM(hf.Gemma2Config(**_KV, head_dim=16)), "lm"),
    "phi3": (lambda: hf.Phi3ForCausalLM(hf.Phi3Config(**_KV, pad_token_id=0)), "lm"),
    "gpt_neox": (lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**_LM)), "lm"),
    "opt": (lambda: hf.OPTForCausalLM(hf.OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                   ffn_dim=128, word_embed_proj_dim=64)), "lm"),
    "falcon": (lambda: hf.FalconForCausalLM(hf.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                            num_attention_heads=4)), "lm"),
    "bloom": (lambda: hf.BloomForCausalLM(hf.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)), "lm"),
    "gptj": (lambda: hf.GPTJForCausalLM(hf.GPTJConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                                      n_positions=64)), "lm"),
    "mixtral": (lambda: hf.MixtralForCausalLM(hf.MixtralConfig(**_KV, num_local_experts=4, num_experts_per_tok=2)), "lm"),
    "qwen2_moe": (lambda: hf.Qwen2MoeForCausalLM(hf.Qwen2MoeConfig(**_KV, num_experts=4, num_experts_per_tok=2,
                                                                   moe_intermediate_size=32,
                                                                   shared_expert_intermediate_size=64)), "lm"),
    "t5": (lambda: hf.T5ForConditionalGeneration(hf.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                             num_heads=4, decoder_start_token_id=0)), "seq2seq"),
    "bart": (lambda: hf.BartForConditionalGeneration(hf.BartConfig(
        vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)), "seq2seq"),
    "roberta": (lambda: hf.RobertaForMaskedLM(hf.RobertaConfig(**_BERT)), "lm"),
    "deberta_v2": (lambda: hf.DebertaV2ForMaskedLM(hf.DebertaV2Config(**_BERT)), "lm"),
    "bert_classifier": (lambda: hf.BertForSequenceClassification(hf.BertConfig(**_BERT, num_labels=3)), "classify"),
    "vit": (lambda: hf.ViTForImageClassification(hf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                              intermediate_size=128, image_size=32, patch_size=8,
                                                              num_labels=5)), "image"),
    "swin": (lambda: hf.SwinForImageClassification(hf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
                                                                  num_heads=[2, 4], window_size=4, num_labels=5)), "image"),
    "llama": (lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**_KV)), "lm"),
    "qwen3": (lambda: hf.Qwen3ForCausalLM(hf.Qwen3Config(**_KV, head_dim=16)), "lm"),
    "gemma3": (lambda: hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(**_KV, head_dim=16)), "lm"),
    "olmo2": (lambda: hf.Olmo2ForCausalLM(hf.Olmo2Config(**_KV)), "lm"),
    "starcoder2": (lambda: hf.Starcoder2ForCausalLM(hf.Starcoder2Config(**_KV)), "lm"),
    "granite": (lambda: hf.GraniteForCausalLM(hf.GraniteConfig(**_KV)), "lm"),
    "cohere": (lambda: hf.CohereForCausalLM(hf.CohereConfig(**_KV)), "lm"),
    "phi": (lambda: hf.PhiForCausalLM(hf.PhiConfig(**_LM)), "lm"),
    "stablelm": (lambda: hf.StableLmForCausalLM(hf.StableLmConfig(**_KV)), "lm"),
    "gpt_bigcode": (lambda: hf.GPTBigCodeForCausalLM(hf.GPTBigCodeConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4)),
                    "lm"),
    "qwen3_moe": (lambda: hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(**_KV, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                                   moe_intermediate_size=32)), "lm"),
    "deepseek_v3": (lambda: hf.DeepseekV3ForCausalLM(hf.DeepseekV3Config(  # multi-head latent attention, MoE
        **_LM, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1)),
        "lm"),
    "mt5": (lambda: hf.MT5ForConditionalGeneration(hf.MT5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                               num_heads=4, decoder_start_token_id=0)), "seq2seq"),
    "modernbert": (lambda: hf.ModernBertForMaskedLM(hf.ModernBertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, pad_token_id=0)),
        "lm"),
    "electra": (lambda: hf.ElectraForMaskedLM(hf.ElectraConfig(**_BERT, embedding_size=32)), "lm"),
    "albert": (lambda: hf.AlbertForMaskedLM(hf.AlbertConfig(**_BERT, embedding_size=32)), "lm"),
    "distilbert": (lambda: hf.DistilBertForMaskedLM(hf.DistilBertConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4,
                                                                        hidden_dim=128)), "lm"),
    "deit": (lambda: hf.DeiTForImageClassification(hf.DeiTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                                 intermediate_size=128, image_size=32, patch_size=8,
                                                                 num_labels=5)), "image"),
    "convnext": (lambda: hf.ConvNextForImageClassification(hf.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                                                              num_labels=5, image_size=32)), "image"),
    "resnet": (lambda: hf.ResNetForImageClassification(hf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                                       num_labels=5)), "image"),
    "mobilevit": (lambda: hf.MobileViTForImageClassification(hf.MobileViTConfig(
        image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 48], num_labels=5)), "image"),
}


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """The same family rebuilt with every dropout probability of its config at 0, stochastic depth
    (`drop_path_rate`) included, so one device is the reference."""
    config = model.config
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key or "drop_path" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return type(model)(config).train()


def sample_for(kind: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (4, 16), generator=gen)
    if kind == "image":
        return {"pixel_values": torch.randn(4, 3, 32, 32, generator=gen), "labels": torch.randint(0, 5, (4,), generator=gen)}
    if kind == "classify":
        mask = torch.ones(4, 16, dtype=torch.long)
        mask[1, 10:] = 0  # padding
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (4,), generator=gen)}
    labels = torch.randint(3, 256, (4, 8), generator=gen) if kind == "seq2seq" else ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _step(rank, world, model, sample, mesh, budget):
    """One SGD step (lr 1) under the solver's plan: the loss, and the full parameters' change (the gradients)."""
    pm = autopar.parallelize(copy.deepcopy(model), sample, mesh, memory_budget=budget)
    args, kwargs = pm.local_batch(split_sample_input(sample))
    loss = pm(*args, **kwargs).loss
    loss.backward()
    torch.optim.SGD(pm.parameters(), lr=1.0).step()
    after = pm.state_dict()
    return loss.item(), {k: v - after[k] for k, v in model.state_dict().items() if v.is_floating_point()}


def _eval_loss(rank, world, model, sample, mesh, budget):
    """The eval-mode loss under the solver's plan (dropout off, as `pm.eval()` turns it off)."""
    pm = autopar.parallelize(copy.deepcopy(model), sample, mesh, memory_budget=budget)
    pm.eval()
    args, kwargs = pm.local_batch(split_sample_input(sample))
    with torch.no_grad():
        return pm(*args, **kwargs).loss.item()


def check(name: str, mesh: tuple[int, ...], budget: float | None) -> tuple[float, float, float, float]:
    """(single-device loss, loss error, largest relative gradient error, eval-mode loss error) of one family."""
    torch.manual_seed(0)
    build, kind = FAMILIES[name]
    with_dropout = build()
    model = without_dropout(copy.deepcopy(with_dropout))
    sample = sample_for(kind)
    ref = copy.deepcopy(model)
    ref_loss = ref(**sample).loss
    ref_loss.backward()
    loss, step = run_ranks(_step, math.prod(mesh), model, sample, mesh, budget, timeout_s=600)[0]
    grad_error = max((step[k] - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1.0)
                     for k, p in ref.named_parameters() if p.grad is not None)
    with torch.no_grad():
        eval_ref = copy.deepcopy(with_dropout).eval()(**sample).loss.item()
    eval_loss = run_ranks(_eval_loss, math.prod(mesh), with_dropout, sample, mesh, budget, timeout_s=600)[0]
    return ref_loss.item(), abs(loss - ref_loss.item()), grad_error, abs(eval_loss - eval_ref)


def main() -> None:
    opts, mesh, names = sweep_options(__doc__.splitlines()[0], "family", FAMILIES, lambda parser: parser.add_argument(
        "--memory", type=float, help="bytes per device (default: ample)"))
    failed = sweep("family", names, lambda name: check(name, mesh, opts.memory),
                   ("loss", "loss err", "grad err", "eval err"))
    print(provenance_line("hf_families", mesh=opts.mesh, memory=opts.memory, failed=failed))


if __name__ == "__main__":
    main()
