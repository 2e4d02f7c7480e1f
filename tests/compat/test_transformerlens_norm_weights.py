"""The norms' weights by TransformerLens's names (``blocks[L].ln1.w``, ``tl_parameters()``'s ``ln_final.w``): the gain
each norm applies, as TransformerLens 3.9's own weight conversion gives it (Gemma's RMSNorm applies ``1 + weight``)."""

from __future__ import annotations

import pytest
import torch
import transformers

import nnterp
from nnterp.compat.transformer_lens.config import WeightRefused

from ..conftest import tiny_tokenizer
from .tl_models import tiny_llama, transformer_lens_model


def tiny_gemma():
    torch.manual_seed(2)
    config = transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                                      max_position_embeddings=64)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return hf


def transformer_lens_gemma_weights(hf):
    """TransformerLens's conversion of Gemma's weights (what its from_pretrained_no_processing loads)."""
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gemma import convert_gemma_weights

    c = hf.config
    cfg = HookedTransformerConfig(
        n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_heads=c.num_attention_heads, d_head=c.head_dim,
        d_mlp=c.intermediate_size, n_ctx=c.max_position_embeddings, d_vocab=c.vocab_size, act_fn="gelu_pytorch_tanh",
        normalization_type="RMS", n_key_value_heads=c.num_key_value_heads, positional_embedding_type="rotary",
        gated_mlp=True, original_architecture="GemmaForCausalLM")
    return convert_gemma_weights(hf, cfg)


def norm_names(weights) -> list[str]:
    return sorted(name for name in weights if name.startswith(("ln_final.", "blocks.")) and ".ln" in f".{name}")


def test_gemmas_norm_weights_are_transformerlenss_one_plus_weight():
    hf = tiny_gemma()
    theirs = transformer_lens_gemma_weights(hf)
    model = nnterp.HookedTransformer.from_pretrained("gemma", hf_model=hf, tokenizer=tiny_tokenizer(300))
    ours = dict(model.tl_named_parameters())
    names = norm_names(theirs)
    assert names and names == norm_names(ours)
    for name in names:
        torch.testing.assert_close(ours[name], theirs[name], msg=name)
    torch.testing.assert_close(model.blocks[1].ln2.w, theirs["blocks.1.ln2.w"])
    with pytest.raises(WeightRefused, match="plus 1"):  # the sum is no parameter: an edit would change nothing
        model.blocks[0].ln1.w.mul_(2)


def test_llamas_norm_weights_are_the_parameters_themselves(gpt2_tokenizer_dir):
    hf = tiny_llama()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    theirs = transformer_lens_model(hf, tokenizer)
    model = nnterp.HookedTransformer.from_pretrained("llama", hf_model=hf, tokenizer=tokenizer)
    ours = dict(model.tl_named_parameters())
    for name in norm_names(ours):
        torch.testing.assert_close(ours[name], theirs.state_dict()[name], msg=name)
    assert model.blocks[0].ln1.w is hf.model.layers[0].input_layernorm.weight  # live: an edit reaches the model
