"""Gemma-3n (text) against plain hooks: AltUp streams stacked as [streams, batch, seq, hidden], LAuReL, per-layer inputs.

Ground truth: module boundaries written from transformers' decoder-layer code, captured with forward hooks on the
unwrapped model; the identity is the block's own AltUp methods (``altup.predict``, ``altup.correct``) run on the
hooks' tensors; the readout of a middle block is the model's own logits with the later blocks made identities by
hooks.
"""

from __future__ import annotations

import math

import nnsight
import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer, logit_lens
from nnterp.core.edits import skip_layers
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.families.gemma3n import Gemma3nError
from nnterp.proof.miniature import miniature_config
from nnterp.spec.attention import set_implementation

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import IDS, assert_placed_as_hooks, hooks_and_reads, register_edit, run_with_hook

CASES = {"gemma3n_text": ("gemma3n_text", lambda: BY_MODEL_TYPE["gemma3n_text"].tiny_config())}


def truth(blocks):
    def at(i):
        reused = blocks[i].self_attn.is_kv_shared_layer
        return {
            "stream_in": ("", "in"), "stream_out": ("", "out"),  # [streams, batch, seq, hidden]
            "attention_norm_output": ("input_layernorm", "out"), "attention_premix": ("self_attn.o_proj", "in"),
            "attention_output": ("post_attention_layernorm", "out"), "mixer_output": ("post_attention_layernorm", "out"),
            "layer_mid": ("pre_feedforward_layernorm", "in"), "mlp_norm_output": ("pre_feedforward_layernorm", "out"),
            "mlp_input": ("mlp", "in"), "mlp_activation": ("mlp.act_fn", "out"), "mlp_neurons": ("mlp.down_proj", "in"),
            "mlp_output": ("post_feedforward_layernorm", "out"),
            "laurel": ("laurel", "out"), "per_layer": ("post_per_layer_input_norm", "out"),
            **({"keys": None, "values": None} if reused else {}),
        }
    return at


def make(dtype=torch.float32):
    hf = build_tiny(CASES["gemma3n_text"][1](), dtype)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())  # proven on a miniature at load
    hf.base_model_blocks = hf.model.layers
    return model, hf, truth(hf.model.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma3n_values_equal_hooks_and_identity_holds(dtype):
    model, hf, at = make(dtype)
    k = hf.config.altup_num_inputs
    expected, saved, logits = hooks_and_reads(model, hf, at, IDS)
    assert_placed_as_hooks(saved, expected, at, model.num_layers)
    for i, block in enumerate(hf.model.layers):
        x, y = saved[(i, "layer_input")], saved[(i, "layer_output")]
        assert x.shape == y.shape == (*IDS.shape, k, model.hidden_size)
        assert torch.equal(x, expected[(i, "stream_in")].movedim(0, 2))  # the stacked streams, batch first
        assert torch.equal(y, expected[(i, "stream_out")].movedim(0, 2))
        a, mid, m = (saved[(i, n)] for n in ("attention_output", "layer_mid", "mlp_output"))
        with torch.no_grad():  # the block's own AltUp steps, on the hooks' tensors
            predictions = block.altup.predict(expected[(i, "stream_in")])
            active = predictions[hf.config.altup_active_idx]
            assert torch.equal(mid, ((active + a) + expected[(i, "laurel")]) / math.sqrt(2))
            corrected = block.altup.correct(predictions, mid + m)
        corrected[1:] += expected[(i, "per_layer")]
        assert torch.equal(corrected, expected[(i, "stream_out")])
    assert all(result.exact for result in check_identity(model, IDS))
    # the head reads the last block's streams mapped back and averaged: the lens there is the model's logits
    assert torch.equal(model.project_on_vocab(saved[(model.num_layers - 1, "layer_output")]), logits)


def _identities_after(hf, layer):
    """Hooks that make every block after ``layer`` hand on its input: the model then reads out block ``layer``'s
    output."""
    return [block.register_forward_hook(lambda mod, args, kwargs, out: args[0], with_kwargs=True)
            for block in hf.model.layers[layer + 1:]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma3n_lens_is_the_models_readout_of_each_block(dtype):
    model, hf, _ = make(dtype)
    with torch.no_grad(), model.trace(IDS):
        streams = nnsight.save([])
        for i in range(model.num_layers):
            streams.append(model.layers[i].layer_output)
    for i, stream in enumerate(streams):
        handles = _identities_after(hf, i)
        try:
            with torch.no_grad():
                own = hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
        finally:
            for handle in handles:
                handle.remove()
        with torch.no_grad():
            assert torch.equal(model.project_on_vocab(stream), own), f"layer {i}"
    probabilities = logit_lens(model, "the cat sat")
    with torch.no_grad():
        ids = model.tokenizer("the cat sat", return_tensors="pt").input_ids
        own = hf(input_ids=ids).logits[:, -1].float().softmax(-1)
    assert torch.allclose(probabilities[:, -1], own, atol=1e-6)
    # one stream, or a contribution: the model never reads such a tensor out
    with torch.no_grad(), model.trace(IDS):
        contribution = model.layers[1].mlp.mlp_output.save()
    with pytest.raises(Gemma3nError, match="AltUp streams"):
        model.project_on_vocab(contribution)
    with pytest.raises(Gemma3nError, match="AltUp streams"):
        logit_lens(model, "the cat sat", value="mlp_output")


def test_gemma3n_edits_reach_the_logits_as_hooks_do():
    model, hf, _ = make()
    blocks = hf.model.layers

    def half_last(t):  # the model's [streams, batch, seq, hidden]: the last token of every stream
        t = t.clone()
        t[:, :, -1] *= 0.5
        return t

    with torch.no_grad(), model.trace(IDS):
        model.layers[1].layer_output[:, -1] *= 0.5  # in place, on the batch-first view
        model.layers[2].self_attn.attention_output = model.layers[2].self_attn.attention_output * 2
        model.layers[3].mlp.mlp_output[:, 0] = 0
        edited = model.logits.save()

    def zero_first(t):
        t = t.clone()
        t[:, 0] = 0
        return t

    handles = [register_edit(hf, blocks[1], "out", half_last),
               register_edit(hf, blocks[2].post_attention_layernorm, "out", lambda t: t * 2)]
    try:
        expected = run_with_hook(hf, blocks[3].post_feedforward_layernorm, "out", zero_first)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(edited, expected)
    assert not torch.equal(edited, run_with_hook(hf, blocks[0], "out", lambda t: t))
    # assigned streams: the block input (permuted back), and the active stream between the sublayers, which the
    # block adds the MLP's output to as well as feeding the norm (the hook doubles it in place)
    with torch.no_grad(), model.trace(IDS):
        model.layers[1].layer_mid = model.layers[1].layer_mid * 2
        model.layers[2].layer_input = model.layers[2].layer_input * 3
        assigned = model.logits.save()

    def double_in_place(mod, args):
        args[0].mul_(2)

    handles = [blocks[1].pre_feedforward_layernorm.register_forward_pre_hook(double_in_place)]
    try:
        expected = run_with_hook(hf, blocks[2], "in", lambda t: t * 3)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(assigned, expected)


def test_gemma3n_shared_keys_and_attention_values():
    model, hf, _ = make()
    modes, types = hf.config.kv_sharing_modes, hf.config.layer_types
    model.enable_attention_values()  # proven on the miniature: probabilities · values == the heads' outputs
    reused = [i for i, mode in enumerate(modes) if mode == "reuse"]
    # a reusing layer with a later one reusing the same tensor
    first = next(i for i in reused if any(j > i and types[j] == types[i] for j in reused))
    store = max(i for i in range(first) if modes[i] == "store" and types[i] == types[first])
    with torch.no_grad(), model.trace(IDS):
        read = nnsight.save([])
        for i in (store, first):
            read.append((model.layers[i].self_attn.keys, model.layers[i].self_attn.values))
    (stored, shared) = read
    assert stored[0].shape == (*IDS.shape, hf.config.num_key_value_heads, hf.config.head_dim)
    assert torch.equal(stored[0], shared[0]) and torch.equal(stored[1], shared[1])  # the layer reuses them
    # an edit of reused keys reaches that attention alone, as a hook handing it edited shared keys does; the later
    # layer that reuses the same tensor (and the storing layer's cache) keep the stored keys
    with torch.no_grad(), model.trace(IDS):
        model.layers[first].self_attn.keys[:, 0] = 0
        edited = model.logits.save()

    def edited_keys(mod, args, kwargs):
        keys, values = kwargs["shared_kv_states"][mod.layer_type]
        keys = keys.clone()
        keys[:, :, 0] = 0  # [batch, kv_heads, seq, head_dim]
        return args, {**kwargs, "shared_kv_states": {mod.layer_type: (keys, values)}}

    handle = hf.model.layers[first].self_attn.register_forward_pre_hook(edited_keys, with_kwargs=True)
    own = hf.config._attn_implementation
    set_implementation(hf, "eager")  # as the wrapper's traces run while the attention values are on
    try:
        with torch.no_grad():
            expected = hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
    finally:
        handle.remove()
        set_implementation(hf, own)
    assert torch.equal(edited, expected)


def test_gemma3n_default_config_miniature():
    """The default config (per-layer intermediate sizes, sparse activations on the first layers, KV sharing),
    shrunk: a list of sizes stays a list, one per layer."""
    config = miniature_config(CONFIG_MAPPING["gemma3n_text"]())
    assert isinstance(config.intermediate_size, list) and len(config.intermediate_size) == config.num_hidden_layers
    default = StandardizedTransformer(build_tiny(config), tokenizer=tiny_tokenizer(256))
    assert all(result.exact for result in check_identity(default, IDS))


def test_gemma3n_skipped_block_hands_on_the_streams():
    model, hf, _ = make()
    modes = hf.config.kv_sharing_modes
    layer = modes.index("reuse")
    with torch.no_grad(), model.trace(IDS):
        skip_layers(model, layer)
        skipped = model.logits.save()
    handle = hf.model.layers[layer].register_forward_hook(lambda mod, args, kwargs, out: args[0], with_kwargs=True)
    try:
        with torch.no_grad():
            expected = hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
    finally:
        handle.remove()
    assert torch.equal(skipped, expected)
    with pytest.raises(Gemma3nError, match="stores the keys and values"), torch.no_grad(), model.trace(IDS):
        skip_layers(model, modes.index("store"))
