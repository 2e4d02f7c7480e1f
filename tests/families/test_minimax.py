"""MiniMax: softmax or lightning attention at ``self_attn``, a routed mixture at ``mlp``, and adds from the normed
stream scaled by the config's alpha / beta factors, against plain hooks.

Ground truth: forward hooks on the unwrapped model at the boundaries of transformers' MiniMaxDecoderLayer (the
block, its two norms, ``self_attn``, ``mlp``). The identity is the block's own arithmetic, written here from its
code: ``mid = n1 * attn_alpha_factor + attn(n1) * attn_beta_factor`` with ``n1 = input_layernorm(x)``, then
``y = n2 * mlp_alpha_factor + mlp(n2) * mlp_beta_factor`` with ``n2 = post_attention_layernorm(mid)``, every
tensor there read by the hooks. The tiny config has both layer kinds and every factor off 1, each different.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer, ValueUnavailable, logit_lens
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof.miniature import miniature_config

from ..conftest import build_tiny, perturb, tiny_tokenizer
from ..hooks import capture_once, logits_with_edit, scaled_edit

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])  # 7 positions: two lightning blocks of 4
DTYPES = [torch.float32, torch.bfloat16]

# value key -> (module relative to the block, side): every block
# (a third element: the block attribute the block multiplies the tensor by as it adds it; the value is the product)
SHARED_AT = {"layer_input": ("", "in"), "attention_norm_output": ("input_layernorm", "out"),
             "layer_mid": ("post_attention_layernorm", "in"), "mlp_norm_output": ("post_attention_layernorm", "out"),
             "mlp_input": ("mlp", "in"), "mlp.mlp_output": ("mlp", "out", "mlp_beta_factor"), "layer_output": ("", "out")}
# softmax-attention blocks: the attention's output and the heads' outputs before o_proj
FULL_AT = {**SHARED_AT, "self_attn.attention_premix": ("self_attn.o_proj", "in"),
           "self_attn.attention_output": ("self_attn", "out", "attn_beta_factor")}
# lightning-attention blocks: its output is the token mixer's contribution
LINEAR_AT = {**SHARED_AT, "mixer_output": ("self_attn", "out", "attn_beta_factor")}

# name -> (model type, the truth's places by the block's layer type)
CASES = {"minimax": ("minimax", {"full_attention": FULL_AT, "linear_attention": LINEAR_AT})}


def make(dtype=torch.float32, attention_values=False):
    hf_model = build_tiny(BY_MODEL_TYPE["minimax"].tiny_config(), dtype)
    return StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer(), attention_values=attention_values), hf_model


def places(hf_model, i):
    return CASES["minimax"][1][hf_model.config.layer_types[i]]


def capture(hf_model, ids=IDS):
    """({(layer, key): tensor} at the truth's places, logits) from one plain forward pass."""
    blocks = hf_model.model.layers
    return capture_once(hf_model, blocks, lambda block: places(hf_model, list(blocks).index(block)), ids)


def block_adds(block, v, mixer):
    """MiniMax's block arithmetic, from the hooks' tensors (the contributions times their β already) and the block
    module's own factors."""
    mid = v["attention_norm_output"] * block.attn_alpha_factor + v[mixer]
    out = v["mlp_norm_output"] * block.mlp_alpha_factor + v["mlp.mlp_output"]
    return torch.equal(v["layer_mid"], mid) and torch.equal(v["layer_output"], out)


def test_the_tiny_config_has_both_layer_kinds_and_every_factor_off_one_and_distinct():
    config = BY_MODEL_TYPE["minimax"].tiny_config()
    assert set(config.layer_types) == {"full_attention", "linear_attention"}
    factors = [getattr(config, f"{kind}_{side}_factor") for kind in ("full_attn", "linear_attn", "mlp")
               for side in ("alpha", "beta")]
    assert 1 not in factors and len(set(factors)) == len(factors)
    assert config.block_size < IDS.shape[1]  # the lightning attention carries its state from one block to the next


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_value_equals_the_hooks_and_the_identity_holds(dtype):
    model, hf_model = make(dtype)
    expected, expected_logits = capture(hf_model)
    saved = {}
    with torch.no_grad(), model.trace(IDS):
        for i in range(model.num_layers):
            for key in model.order(i):  # in forward order
                owner, _, name = key.rpartition(".")
                at = getattr(model.layers[i], owner) if owner else model.layers[i]
                saved[(i, key)] = getattr(at, name).save()
        logits = model.logits.save()
    assert torch.equal(logits, expected_logits)
    for key, tensor in saved.items():
        assert torch.equal(tensor, expected[key].reshape(tensor.shape)), key
    for i, block in enumerate(hf_model.model.layers):
        assert set(model.order(i)) == set(places(hf_model, i))  # every value placed, nothing else
        mixer = "mixer_output" if "mixer_output" in model.order(i) else "self_attn.attention_output"
        assert block_adds(block, {key: expected[(i, key)] for key in places(hf_model, i)}, mixer), i
    assert all(result.exact for result in check_identity(model, IDS))


def test_the_lightning_blocks_have_no_attention_values_and_the_mlp_is_routed():
    model, hf_model = make()
    kind = "lightning attention (a linear attention)"
    for i, layer_type in enumerate(hf_model.config.layer_types):
        if layer_type == "linear_attention":
            with pytest.raises(ValueUnavailable, match=re.escape(f"block {i} mixes tokens with {kind}")):
                with model.trace(IDS):
                    model.layers[i].self_attn.attention_output.save()
        with pytest.raises(ValueUnavailable, match="routed mixture of experts"):
            with model.trace(IDS):
                model.layers[i].mlp.mlp_activation.save()


def test_the_attention_probabilities_of_a_softmax_block_are_the_attentions():
    """With attention values on, the eager attention's probabilities are what MiniMaxAttention returns second."""
    model, hf_model = make(attention_values=True)
    returned = []
    handle = hf_model.model.layers[2].self_attn.register_forward_hook(lambda m, a, o: returned.append(o[1].clone()))
    try:
        with torch.no_grad(), model.trace(IDS):
            probabilities = model.layers[2].self_attn.attention_probabilities.save()
    finally:
        handle.remove()
    assert torch.equal(probabilities, returned[0])
    with pytest.raises(ValueUnavailable, match="block 1 mixes tokens with lightning attention"):
        with model.trace(IDS):
            model.layers[1].self_attn.attention_probabilities.save()


# (block, value key): both layer kinds; the normed stream, which is also the residual of each add; the MLP's input
# alone (a copy: the residual of the MLP add keeps the norm's output)
EDITS = [(2, "layer_input"), (1, "attention_norm_output"), (2, "self_attn.attention_output"), (1, "mixer_output"),
         (3, "layer_mid"), (0, "mlp_norm_output"), (1, "mlp_input"), (2, "mlp.mlp_output"), (3, "layer_output")]


@pytest.mark.parametrize(("layer", "key"), EDITS)
def test_an_edit_reaches_the_model_as_the_same_edit_by_a_hook(layer, key):
    model, hf_model = make()
    path, side, *scale = places(hf_model, layer)[key]
    block = hf_model.model.layers[layer]
    edit = lambda t: t * 0.5 + 0.25  # noqa: E731
    expected = logits_with_edit(hf_model, block.get_submodule(path) if path else block, side,
                                scaled_edit(edit, getattr(block, scale[0])) if scale else edit, IDS)
    owner, _, name = key.rpartition(".")
    with torch.no_grad(), model.trace(IDS):  # in place
        at = getattr(model.layers[layer], owner) if owner else model.layers[layer]
        tensor = getattr(at, name)
        tensor[:] = tensor * 0.5 + 0.25
        in_place = model.logits.save()
    with torch.no_grad(), model.trace(IDS):  # an assignment
        at = getattr(model.layers[layer], owner) if owner else model.layers[layer]
        setattr(at, name, getattr(at, name) * 0.5 + 0.25)
        assigned = model.logits.save()
    assert torch.equal(in_place, expected) and torch.equal(assigned, expected)
    with torch.no_grad():
        assert not torch.equal(expected, hf_model(input_ids=IDS).logits)  # the edit changes the logits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_project_on_vocab_of_the_last_block_is_the_logits_and_the_lens_reads_it_out(dtype):
    model, hf_model = make(dtype)
    with torch.no_grad(), model.trace(IDS):
        last = model.layers[-1].layer_output.save()
        logits = model.logits.save()
    with torch.no_grad():
        assert torch.equal(model.project_on_vocab(last), logits)
        assert torch.equal(hf_model.lm_head(hf_model.model.norm(last)), logits)  # the model's readout: norm, head
        lens = logit_lens(model, "a b c d e f g")
        ids = model.tokenizer("a b c d e f g", return_tensors="pt").input_ids
        expected = hf_model(input_ids=ids).logits[:, -1].float().softmax(-1)
    assert lens.shape == (1, model.num_layers, 128) and torch.allclose(lens[:, -1], expected)


def test_the_default_config_miniature_is_proven():
    torch.manual_seed(0)
    config = miniature_config(CONFIG_MAPPING["minimax"]())
    model = StandardizedTransformer(perturb(AutoModelForCausalLM.from_config(config)).eval(),
                                    tokenizer=tiny_tokenizer(256))
    assert {"full_attention", "linear_attention"} <= set(config.layer_types)
    assert all(result.exact for result in check_identity(model, IDS))
