"""CPM-Ant (learned prompt positions prepended to the stream inside the model) against plain hooks.

Ground truth: module boundaries written from transformers' CpmAnt block code (``self_att`` and ``ffn`` sub-blocks),
captured with forward hooks on the unwrapped model, on the model's own ``[batch, prompt_length + seq, ...]`` tensors;
the tokens are the positions after the first ``config.prompt_length`` (the model drops those after its final norm).
Edits by hooks change those positions of the model's tensors and leave the prompt positions as they are.
"""

from __future__ import annotations

import nnsight
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof.miniature import miniature_config
from nnterp.spec.errors import BadAssignment

from ..conftest import build_tiny, perturb, tiny_tokenizer
from ..families.test_families import IDS, hooks_and_reads, register_edit, run_with_hook

CASES = {"cpmant": ("cpmant",)}

TRUTH = {
    "layer_input": ("", "in"), "attention_norm_output": ("self_att.layernorm_before_attention", "out"),
    "attention_premix": ("self_att.self_attention.attention_out", "in"),
    "attention_output": ("self_att.self_attention", "out"), "mixer_output": ("self_att.self_attention", "out"),
    "layer_mid": ("ffn", "in"),
    "mlp_norm_output": ("ffn.layernorm_before_ffn", "out"), "mlp_input": ("ffn.ffn", "in"),
    "mlp_activation": ("ffn.ffn.w_in.act", "out"), "mlp_neurons": ("ffn.ffn.w_out", "in"),
    "mlp_output": ("ffn.ffn", "out"), "layer_output": ("", "out"),
}
LAYER = 1


def make(dtype=torch.float32):
    hf = build_tiny(BY_MODEL_TYPE["cpmant"].tiny_config(), dtype)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())  # proven on a miniature at load
    hf.base_model_blocks = model.layers._module
    return model, hf, hf.config.prompt_length


def edited(hf, module, side, edit):
    """The logits with ``edit`` applied to the token positions of the module's tensor by a hook."""
    prompt = hf.config.prompt_length

    def on_tokens(t):
        t = t.clone()
        t[:, prompt:] = edit(t[:, prompt:])
        return t
    return run_with_hook(hf, module, side, on_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_values_are_the_token_positions_of_the_hooked_tensors(dtype):
    model, hf, prompt = make(dtype)
    assert prompt > 0
    expected, saved, logits = hooks_and_reads(model, hf, lambda i: TRUTH, IDS)
    for i in range(model.num_layers):
        assert {name for layer, name in saved if layer == i} == set(TRUTH)
        for name in TRUTH:
            got, full = saved[(i, name)], expected[(i, name)]
            assert full.shape[1] == prompt + IDS.shape[1] and got.shape[:2] == IDS.shape, f"layer {i} {name}"
            assert torch.equal(got, full[:, prompt:].reshape(got.shape)), f"layer {i} {name}"
        h = {name: expected[(i, name)] for name in TRUTH}
        assert torch.equal(h["layer_mid"], h["layer_input"] + h["attention_output"])  # self_att's own add
        assert torch.equal(h["layer_output"], h["layer_mid"] + h["mlp_output"])  # ffn's own add
    results = check_identity(model, IDS)
    assert all(result.exact for result in results), [str(r) for r in results]
    with torch.no_grad(), model.trace(IDS):  # the logit lens of the last block is the model's logits
        readout = model.project_on_vocab(model.layers[-1].layer_output).save()
    assert torch.equal(readout, logits)


def test_in_place_edits_reach_the_token_positions_as_hooks_do():
    model, hf, prompt = make()
    block = hf.base_model_blocks[LAYER]
    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(IDS):
        model.layers[LAYER].layer_mid[:, 0] = 0  # token 0: the model's position prompt_length
        edited_logits = model.logits.save()

    def zero_first(t):
        t = t.clone()
        t[:, 0] = 0
        return t
    expected = edited(hf, block.ffn, "in", zero_first)
    assert torch.equal(edited_logits, expected) and not torch.equal(edited_logits, clean)
    with torch.no_grad(), model.trace(IDS):
        model.layers[LAYER].mlp.mlp_activation[:, 1] *= 2
        doubled = model.logits.save()

    def double_second(t):
        t = t.clone()
        t[:, 1] *= 2
        return t
    assert torch.equal(doubled, edited(hf, block.ffn.ffn.w_in.act, "out", double_second))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_assignments_replace_the_token_positions_and_keep_the_prompt_positions(dtype):
    model, hf, prompt = make(dtype)
    block = hf.base_model_blocks[LAYER]
    with torch.no_grad(), model.trace(IDS):  # an output (the block's, in a tuple), and an input
        model.layers[LAYER].self_attn.attention_output = model.layers[LAYER].self_attn.attention_output * 0.5
        model.layers[LAYER].layer_mid = model.layers[LAYER].layer_mid * 2
        model.layers[LAYER].layer_output = torch.zeros_like(model.layers[LAYER].layer_output)
        logits = model.logits.save()
    handles = [register_edit(hf, block.self_att.self_attention, "out",
                             lambda t: torch.cat((t[:, :prompt], t[:, prompt:] * 0.5), dim=1)),
               register_edit(hf, block.ffn, "in", lambda t: torch.cat((t[:, :prompt], t[:, prompt:] * 2), dim=1))]
    try:
        expected = edited(hf, block, "out", torch.zeros_like)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(logits, expected)
    # the prompt positions matter downstream: zeroing them too gives other logits
    assert not torch.equal(expected, run_with_hook(hf, block, "out", torch.zeros_like))
    with torch.no_grad(), model.trace(IDS):  # a value viewed per head: the model's [batch, seq, heads * head_dim]
        model.layers[LAYER].self_attn.attention_premix = model.layers[LAYER].self_attn.attention_premix * 0.5
        halved = model.logits.save()
    assert torch.equal(halved, edited(hf, block.self_att.self_attention.attention_out, "in", lambda t: t * 0.5))
    with pytest.raises(BadAssignment, match="has shape"):  # the model's own length (prompt included) is refused
        with torch.no_grad(), model.trace(IDS):
            model.layers[LAYER].layer_output = torch.zeros(*IDS.shape[:1], prompt + IDS.shape[1], model.hidden_size)


def test_gradients_are_autograd_s_on_the_token_positions():
    model, hf, prompt = make()
    block = hf.base_model_blocks[LAYER]
    for name, module, side in (("layer_mid", block.ffn, "in"), ("mlp_output", block.ffn.ffn, "out")):
        captured = {}
        handle = register_edit(hf, module, side, lambda t, captured=captured: captured.setdefault("t", t))
        try:
            loss = hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits.square().mean()
            expected = torch.autograd.grad(loss, captured["t"])[0][:, prompt:]
        finally:
            handle.remove()
        with model.trace(IDS):
            envoy = model.layers[LAYER] if name == "layer_mid" else model.layers[LAYER].mlp
            value = getattr(envoy, name)
            loss = model.logits.square().mean()
            with loss.backward():
                grad = nnsight.save(value.grad)
        assert torch.equal(grad, expected), name


def test_skipping_a_block_hands_on_its_input_as_a_hook_does():
    from nnterp import skip_layers

    model, hf, prompt = make()
    with torch.no_grad(), model.trace(IDS):
        skip_layers(model, LAYER)
        logits = model.logits.save()
    handle = hf.base_model_blocks[LAYER].register_forward_hook(lambda m, args, out: (args[0], None))
    try:
        with torch.no_grad():
            expected = hf(input_ids=IDS).logits
    finally:
        handle.remove()
    assert torch.equal(logits, expected)
    with torch.no_grad(), model.trace(IDS):  # a stream on the tokens, given: the prompt positions stay the model's
        skip_layers(model, LAYER, stream=model.layers[0].layer_input * 2)
        given = model.logits.save()
    stream = {}
    handles = [hf.base_model_blocks[0].register_forward_pre_hook(lambda m, args: stream.update(x=args[0])),
               hf.base_model_blocks[LAYER].register_forward_hook(lambda m, args, out: (torch.cat(
                   (args[0][:, :prompt], stream["x"][:, prompt:] * 2), dim=1), None))]
    try:
        with torch.no_grad():
            expected = hf(input_ids=IDS).logits
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(given, expected) and not torch.equal(given, logits)


def test_attention_internals_unavailable_with_the_reason():
    model, *_ = make()
    assert "its own code" in model.availability(0)["self_attn.attention_probabilities"].reason
    with pytest.raises(ValueUnavailable, match="its own code"):
        model.enable_attention_values()


def test_the_default_config_miniature_is_proven():
    config = CONFIG_MAPPING["cpmant"](num_hidden_layers=2)
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(miniature_config(config))).eval()
    assert hf.config.prompt_length == config.prompt_length  # the default's 32 prompt positions kept
    assert hf.config.dim_ff < config.dim_ff and hf.config.dim_head < config.dim_head
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))  # proven at load
    assert model.family is BY_MODEL_TYPE["cpmant"]
    results = check_identity(model, IDS)
    assert all(result.exact for result in results), [str(r) for r in results]


def test_a_pass_given_a_filled_cache_is_refused():
    """With a cache the model runs the new tokens without the prompt positions, so a prefix view would drop tokens:
    such a trace is refused before it runs, whatever the number of new tokens."""
    model, hf, prompt = make()
    with torch.no_grad():
        cache = hf(input_ids=IDS[:, :3], use_cache=True).past_key_values
    assert cache.get_seq_length() > 0
    more = torch.arange(3, 3 + prompt + 2).repeat(2, 1) % model.vocab_size  # more new tokens than the prompt
    with pytest.raises(ValueError, match="without past_key_values"):
        with torch.no_grad(), model.trace(more, past_key_values=cache):
            model.layers[LAYER].layer_output.save()
    with torch.no_grad(), model.trace(IDS):  # without a cache, as before
        out = model.layers[LAYER].layer_output.save()
    assert out.shape[1] == IDS.shape[1]
