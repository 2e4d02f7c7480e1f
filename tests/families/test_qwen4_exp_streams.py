"""Widened and parallel residual streams (Qwen4-Exp) against plain hooks.

Ground truth: module boundaries written from transformers' decoder-layer code, captured with forward hooks on the
unwrapped model; the identity is the block's own arithmetic (each sublayer's output injected into every copy of the
stream with its weight). Which block mixes tokens with attention is read from the HF modules, not from the spec.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer, ValueUnavailable, logit_lens
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof.miniature import miniature_config

from ..conftest import build_tiny, perturb, tiny_tokenizer
from ..families.test_families import (
    IDS,
    assert_placed_as_hooks,
    hooks_and_reads,
    register_edit,
    run_with_hook,
)

SERVED = ("qwen4_exp_text", "qwen4_exp")  # the types these tests prove (the census checks they are all served)


def qwen4_truth(blocks):
    def at(i):
        block = blocks[i]
        attention = getattr(block, "self_attn", None) is not None
        values = {
            "layer_input": ("", "in"), "attention_norm_output": ("attn_hyper_connection", "out"),
            "attention_premix": ("self_attn.o_proj", "in") if attention else None,
            "attention_output": ("self_attn", "out") if attention else None,
            "mixer_output": ("self_attn" if attention else "linear_attn", "out"),
            "layer_mid": ("mlp_hyper_connection", "in"), "mlp_norm_output": ("mlp_hyper_connection", "out"),
            "mlp_input": ("mlp", "in"), "mlp_activation": None, "mlp_neurons": None, "mlp_output": ("mlp", "out"),
            "layer_output": ("", "out"),
            # the injection weights, and the n-gram branch where the block has one
            "attn_w": ("attn_hyper_connection", "out2"), "mlp_w": ("mlp_hyper_connection", "out2"),
        }
        if block.ple is not None:
            values["P"] = ("ple", "out")
        return values
    return at


def inject(stream, branch, weights):
    return stream + (branch.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


def make(dtype=torch.float32):
    hf = build_tiny(BY_MODEL_TYPE["qwen4_exp_text"].tiny_config(), dtype)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())  # proven on a miniature at load
    return model, hf, qwen4_truth(hf.model.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qwen4_exp_values_equal_hooks_and_identity_holds(dtype):
    model, hf, at = make(dtype)
    hf.base_model_blocks = hf.model.layers
    kinds = [getattr(block, "self_attn", None) is not None for block in hf.model.layers]
    assert True in kinds and False in kinds and any(block.ple is not None for block in hf.model.layers)
    expected, saved, logits = hooks_and_reads(model, hf, at, IDS)
    assert_placed_as_hooks(saved, expected, at, model.num_layers)
    for i in range(model.num_layers):
        x, a, mid, m, y = (saved[(i, n)] for n in ("layer_input", "mixer_output", "layer_mid", "mlp_output",
                                                    "layer_output"))
        assert x.shape == (*IDS.shape, model.hidden_size * hf.config.hc_count)
        stream = x + expected[(i, "P")] if (i, "P") in expected else x
        assert torch.equal(mid, inject(stream, a, expected[(i, "attn_w")]))
        assert torch.equal(y, inject(mid, m, expected[(i, "mlp_w")]))
        if kinds[i]:
            assert torch.equal(saved[(i, "attention_output")], a)
    assert all(result.exact for result in check_identity(model, IDS))
    # the head reads the last block's output through the hyper-connection mixer: the lens there is the logits
    assert torch.equal(model.project_on_vocab(saved[(model.num_layers - 1, "layer_output")]), logits)


def test_qwen4_exp_edits_reach_the_logits_as_hooks_do():
    model, hf, at = make()
    blocks = hf.model.layers
    linear = [getattr(block, "self_attn", None) is None for block in blocks].index(True)
    attention = [getattr(block, "self_attn", None) is not None for block in blocks].index(True)

    def zero_last(t):
        t = t.clone()
        t[:, -1] = 0
        return t

    with torch.no_grad(), model.trace(IDS):
        model.layers[linear].mixer_output[:, -1] = 0  # in place
        model.layers[attention].self_attn.attention_output = model.layers[attention].self_attn.attention_output * 2
        model.layers[attention].mlp.mlp_output = model.layers[attention].mlp.mlp_output * 0.5
        edited = model.logits.save()
    handles = [register_edit(hf, blocks[linear].linear_attn, "out", zero_last),
               register_edit(hf, blocks[attention].self_attn, "out", lambda t: t * 2)]
    try:
        expected = run_with_hook(hf, blocks[attention].mlp, "out", lambda t: t * 0.5)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(edited, expected)
    # the stream between the sublayers, assigned: the gated residual goes on with it
    with torch.no_grad(), model.trace(IDS):
        model.layers[linear].layer_mid = model.layers[linear].layer_mid * 2
        doubled = model.logits.save()
    assert torch.equal(doubled, run_with_hook(hf, blocks[linear].mlp_hyper_connection, "in", lambda t: t * 2))


def test_qwen4_exp_availability_and_tools():
    model, hf, _ = make()
    linear = [getattr(block, "self_attn", None) is None for block in hf.model.layers].index(True)
    assert "Gated DeltaNet" in model.availability(linear)["self_attn.attention_output"].reason
    with pytest.raises(ValueUnavailable), torch.no_grad(), model.trace(IDS):
        model.layers[linear].self_attn.attention_output.save()
    probabilities = logit_lens(model, "the cat sat")
    assert probabilities.shape[:2] == (1, model.num_layers)
    with torch.no_grad():  # the lens of the last block is the model's own next-token distribution
        own = hf(**model.tokenizer("the cat sat", return_tensors="pt")).logits[:, -1].softmax(-1)
    assert torch.allclose(probabilities[:, -1], own, atol=1e-6)


def test_qwen4_exp_default_config_miniature_and_image_text_config():
    """The default config (with the token selector's sizes checkpoints set, and one n-gram branch), shrunk; and the
    image-text config of Qwen4-Exp checkpoints, whose causal LM is the text model."""
    config = CONFIG_MAPPING["qwen4_exp_text"](
        num_hidden_layers=4, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=2048,
        indexer_compress_ratio=4, ple_layer_ids=[1], eos_token_id=2)
    torch.manual_seed(0)
    model = StandardizedTransformer(perturb(AutoModelForCausalLM.from_config(miniature_config(config))).eval(),
                                    tokenizer=tiny_tokenizer(256))
    assert all(result.exact for result in check_identity(model, IDS))
    model.enable_attention_values()  # proven on the attention blocks of the miniature
    image_text = CONFIG_MAPPING["qwen4_exp"](text_config=BY_MODEL_TYPE["qwen4_exp_text"].tiny_config().to_dict())
    hf = build_tiny(image_text)
    assert type(hf).__name__ == "Qwen4ExpForCausalLM"
    wrapped = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    assert wrapped.family is BY_MODEL_TYPE["qwen4_exp_text"]
    assert all(result.exact for result in check_identity(wrapped, IDS))
