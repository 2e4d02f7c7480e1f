"""Inkling-2 (attention residuals over blocks of layers) against plain hooks.

Ground truth: module boundaries written from transformers' decoder-layer code (``Inkling2SlidingDecoderLayer``,
``Inkling2FullDecoderLayer``), captured with forward hooks on the unwrapped model; the identity is the layer's own
arithmetic on the hooked tensors, in its order and casts. Which layer starts a block and which attention it runs are
read from the HF modules (``is_block_boundary``, the layer's class), not from the spec.
"""

from __future__ import annotations

import dataclasses

import nnsight
import pytest
import torch
from transformers import AutoModelForCausalLM, Inkling2ForConditionalGeneration
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer, logit_lens
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof import problems_of
from nnterp.proof.miniature import miniature_config
from nnterp.spec.errors import ReadoutUnavailable, UnknownArchitecture

from ..conftest import perturb, tiny_tokenizer
from ..families.test_families import IDS, assert_placed_as_hooks, hooks_and_reads, register_edit, run_with_hook

CASES = {"inkling2_text": ("inkling2_text",), "inkling2": ("inkling2",)}  # the image-text type: loaded by name


def truth(blocks):
    def at(i):
        block = blocks[i]
        sliding = hasattr(block, "input_layernorm")  # a full-attention layer norms three mixes instead
        return {
            "layer_input": ("", "in"),
            "attention_norm_output": ("input_layernorm", "out") if sliding else None,
            "attention_premix": ("self_attn.o_proj", "in"),
            "attention_output": ("post_attention_convolution", "out"),
            "mixer_output": ("post_attention_convolution", "out"),
            "mlp_norm_output": ("post_attention_layernorm", "out"),
            "mlp_input": ("mlp", "in"),
            "mlp_activation": None, "mlp_neurons": None,  # a routed mixture on every layer
            "mlp_output": ("post_mlp_convolution", "out"),
            "layer_output": ("", "out"),
        }
    return at


def make(dtype=torch.float32):
    """Built in ``dtype`` as a checkpoint loads: the modules the class keeps in float32 (its router, convolutions and
    mixes) stay so; cast whole, its router would not run."""
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(BY_MODEL_TYPE["inkling2_text"].tiny_config(), dtype=dtype)).eval()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())  # proven on a miniature at load
    hf.base_model_blocks = hf.model.layers
    return model, hf


def layer_inputs(hf, module_of, ids=IDS):
    """{layer: (args, kwargs)} each layer's ``module_of(block)`` is called with (clones), by a plain pre-hook."""
    seen, handles = {}, []
    for i, block in enumerate(hf.model.layers):
        def hook(module, args, kwargs, i=i):
            seen.setdefault(i, (tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args), kwargs))
        handles.append(module_of(block).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            hf(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inkling2_values_equal_hooks_and_the_layers_arithmetic_holds(dtype):
    model, hf = make(dtype)
    assert hf.model.layers[0].post_mlp_convolution.conv1d.weight.dtype == torch.float32
    assert hf.model.layers[0].self_attn.o_proj.linear.weight.dtype == dtype
    blocks = hf.model.layers
    shapes = {(block.is_block_boundary, type(block).__name__) for block in blocks}
    assert len(shapes) == 4  # boundary and not, sliding and full attention: every block shape is in the case
    at = truth(blocks)
    expected, saved, _ = hooks_and_reads(model, hf, at, IDS)
    assert_placed_as_hooks(saved, expected, at, model.num_layers)
    # what the MLP's mix reads: the partial sum after the attention's add (its second argument), then block_states
    mixes = layer_inputs(hf, lambda block: block.mlp_input)
    for i, block in enumerate(blocks):
        x, a, m, y = (expected[(i, n)] for n in ("layer_input", "attention_output", "mlp_output", "layer_output"))
        block_states, partial = mixes[i][0]
        assert a.dtype == m.dtype == x.dtype == dtype
        if block.is_block_boundary:  # the stream restarts; the incoming partial sum is the ended block's summary
            assert torch.equal(partial, a.float())
            assert torch.equal(y, (a.float() + m).to(x.dtype))
            assert torch.equal(block_states[..., -1, :], x)
        else:
            assert torch.equal(partial, x.float() + a.float())
            assert torch.equal(y, ((x.float() + a.float()) + m).to(x.dtype))
        assert torch.equal(saved[(i, "layer_mid")], partial)
        assert torch.equal(expected[(i, "mlp_input")], expected[(i, "mlp_norm_output")].to(dtype))
        if i + 1 < len(blocks):
            assert torch.equal(y, expected[(i + 1, "layer_input")])
    assert all(result.exact for result in check_identity(model, IDS))


def test_inkling2_edits_reach_the_logits_as_hooks_do():
    model, hf = make()
    blocks = hf.model.layers
    boundary = [i for i, block in enumerate(blocks) if block.is_block_boundary and i > 0][0]
    inner = [i for i, block in enumerate(blocks) if not block.is_block_boundary][0]

    def zero_last(t):
        t = t.clone()
        t[:, -1] = 0
        return t

    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(IDS):
        model.layers[inner].self_attn.attention_output[:, -1] = 0  # in place
        model.layers[boundary].mlp.mlp_output = model.layers[boundary].mlp.mlp_output * 0.5
        edited = model.logits.save()
    handle = register_edit(hf, blocks[inner].post_attention_convolution, "out", zero_last)
    try:
        expected = run_with_hook(hf, blocks[boundary].post_mlp_convolution, "out", lambda t: t * 0.5)
    finally:
        handle.remove()
    assert torch.equal(edited, expected) and not torch.equal(edited, clean)

    def doubled_in_place(arg):  # a plain pre-hook that doubles one input in place: the model goes on with that tensor
        def hook(module, args):
            args[arg].mul_(2)
        return hook

    for layer in (boundary, inner):
        # the partial sum between the adds: the MLP's mix and the last add both go on with the assigned stream
        with torch.no_grad(), model.trace(IDS):
            model.layers[layer].layer_mid = model.layers[layer].layer_mid * 2
            mid = model.logits.save()
        handle = blocks[layer].mlp_input.register_forward_pre_hook(doubled_in_place(1))
        try:
            with torch.no_grad():
                assert torch.equal(mid, hf(input_ids=IDS).logits), f"layer {layer}"
        finally:
            handle.remove()
    # the stream entering a boundary layer: the model keeps it after the layer as the ended block's summary, so an
    # assignment replaces that summary too (every later mix and the readout read it), as an edit in place does
    with torch.no_grad(), model.trace(IDS):
        model.layers[boundary].layer_input = model.layers[boundary].layer_input * 2
        stream = model.logits.save()
    handle = blocks[boundary].register_forward_pre_hook(doubled_in_place(0))
    try:
        with torch.no_grad():
            assert torch.equal(stream, hf(input_ids=IDS).logits)
    finally:
        handle.remove()
    # (swapping the layer's argument alone would reach this layer's mixes but not the summary the model keeps)
    swapped = run_with_hook(hf, blocks[boundary], "in", lambda t: t * 2)
    assert not torch.equal(stream, swapped)


def test_inkling2_attention_values_follow_the_layers_heads_sinks_and_mask():
    model, hf = make()
    model.enable_attention_values()  # proven on the miniature (probabilities · values == premix)
    blocks = hf.model.layers
    captured, handles = {}, []
    for i, block in enumerate(blocks):
        for name in ("q_proj", "k_proj", "v_proj", "sink_proj"):
            handles.append(getattr(block.self_attn, name).register_forward_hook(
                lambda m, a, o, key=(i, name): captured.setdefault(key, o.detach().clone())))
    try:
        with torch.no_grad(), model.trace(IDS):
            read = nnsight.save([{name: getattr(model.layers[i].self_attn, name)
                                  for name in ("queries", "keys", "values", "attention_scores", "attention_probabilities")}
                                 for i in range(model.num_layers)])
    finally:
        for handle in handles:
            handle.remove()
    for i, block in enumerate(blocks):
        heads = block.self_attn.num_heads
        assert heads == model.num_heads_of(i)
        got = read[i]
        assert got["queries"].shape[2] == heads
        for name, module in (("queries", "q_proj"), ("keys", "k_proj"), ("values", "v_proj")):
            assert torch.equal(got[name], captured[(i, module)].transpose(1, 2)), f"layer {i} {name}"
        # the pattern is the softmax over the masked scores and the sink logit, the sink's column dropped
        sinks = captured[(i, "sink_proj")].transpose(1, 2).unsqueeze(-1)
        pattern = torch.softmax(torch.cat([got["attention_scores"], sinks], dim=-1).float(), dim=-1)[..., :-1]
        assert torch.equal(pattern, got["attention_probabilities"])
        # masked: the first position sees no later one
        assert (got["attention_scores"][:, :, 0, 1:] < torch.finfo(torch.float32).min / 2).all()
    assert {model.num_heads_of(i) for i in range(model.num_layers)} == {2, 4}


def test_inkling2_readout_is_refused_and_the_native_mix_is_reachable():
    model, hf = make()
    with pytest.raises(ReadoutUnavailable, match="final_input"):
        logit_lens(model, "the cat sat")
    with pytest.raises(ReadoutUnavailable, match="final_input"), torch.no_grad(), model.trace(IDS):
        model.project_on_vocab(model.layers[-1].layer_output)
    # the block's module named like the standard value is under nnsight's prefix; the value is what the MLP reads
    assert model.layers[1].E_mlp_input._module is hf.model.layers[1].mlp_input
    with torch.no_grad(), model.trace(IDS):
        mix = model.layers[1].E_mlp_input.output[0].save()
        normed = model.layers[1].mlp_norm_output.save()
    assert torch.equal(normed, hf.model.layers[1].post_attention_layernorm(mix))
    assert "mix" in model.availability(1)["attention_norm_output"].reason


def test_inkling2_proof_catches_a_misplaced_stream_between_the_adds():
    model, _ = make()
    assert problems_of(model) == []
    boundary = [i for i in range(model.num_layers) if model.block_spec(i).formula.startswith(
        "layer_output = (attention_output")][1]
    inner = model.block_spec(boundary + 1)
    # a restarting block told it adds to the incoming stream: the proof's check of layer_mid fails
    told = dataclasses.replace(model.block_spec(boundary).identity, mid=inner.mid)
    model._nnterp_blocks = tuple(block if i != boundary else dataclasses.replace(block, identity=told)
                                 for i, block in enumerate(model._nnterp_blocks))
    assert any(f"layer {boundary}: 'layer_mid'" in problem for problem in problems_of(model))


def test_inkling2_default_config_miniature():
    """The default layout, shrunk: blocks of six layers, a full-attention layer every sixth (inside a block)."""
    config = miniature_config(CONFIG_MAPPING["inkling2_text"](num_hidden_layers=7))
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(config)).eval()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))  # proven at load
    assert [i for i, block in enumerate(hf.model.layers) if block.is_block_boundary] == [0, 6]
    assert type(hf.model.layers[5]).__name__ == "Inkling2FullDecoderLayer"
    assert all(result.exact for result in check_identity(model, IDS))


def test_inkling2_image_text_checkpoint_loads_as_its_text_model(tmp_path):
    """A checkpoint of the image-text type, for which transformers has no causal LM class: loaded by name (at once, or
    lazily), the text model with the checkpoint's weights, whose logits on text are the image-text model's; the
    image-text class itself is refused with what to do."""
    text = BY_MODEL_TYPE["inkling2_text"].tiny_config()
    config = CONFIG_MAPPING["inkling2"](text_config=text.to_dict(), image_token_id=127, vision_config=dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, text_hidden_size=text.hidden_size,
        projection_hidden_dim=32, patch_size=4, posemb_grid_size=4))
    torch.manual_seed(0)
    image_text = perturb(Inkling2ForConditionalGeneration(config)).eval()
    image_text.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model = StandardizedTransformer(str(tmp_path))  # proven on a miniature of the image-text config
    assert type(model._module).__name__ == "Inkling2ForCausalLM" and model.family is BY_MODEL_TYPE["inkling2"]
    with torch.no_grad():
        image_text_logits = image_text(input_ids=IDS).logits
        expected = model._module(input_ids=IDS).logits  # the loaded text model, run plainly
    # the checkpoint's weights: the two classes agree up to float32 rounding (their kernels may differ by an ulp on
    # some CPUs); what nnterp answers for, its trace of the loaded model, is exact
    torch.testing.assert_close(expected, image_text_logits)
    with torch.no_grad(), model.trace(IDS):
        logits = model.logits.save()
    assert torch.equal(logits, expected)
    assert all(result.exact for result in check_identity(model, IDS))
    lazy = StandardizedTransformer(str(tmp_path), dispatch=False)  # built without weights, loaded at the first trace
    with torch.no_grad(), lazy.trace(IDS):
        lazy_logits = lazy.logits.save()
    assert type(lazy._module).__name__ == "Inkling2ForCausalLM" and torch.equal(lazy_logits, expected)
    with pytest.raises(UnknownArchitecture, match="by name"):
        StandardizedTransformer(image_text, tokenizer=tiny_tokenizer())
