"""LongCat-Flash (two attention-MLP pairs per block and a routed shortcut) against plain hooks.

Ground truth: the five contributions and the block's input and output, captured with forward hooks at the modules
transformers' decoder-layer code calls (self_attn[k], mlps[k], mlp); the identity is the code's own order of addition
on the hooked tensors, ``residual + hidden_states + shortcut_mlp_output`` last.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof.miniature import miniature_config
from nnterp.spec.catalog import ATTENTION_INTERNALS, CATALOG

from ..conftest import build_tiny, perturb, tiny_tokenizer
from ..families.test_families import IDS, hooks_and_reads, register_edit, run_with_hook

CASES = {"longcat_flash": ("longcat_flash",)}

TRUTH = {"layer_input": ("", "in"), "attn0": ("self_attn.0", "out"), "mlp0": ("mlps.0", "out"),
         "shortcut": ("mlp", "out"), "shortcut_input": ("mlp", "in"), "norm0": ("post_attention_layernorm.0", "out"),
         "attn1": ("self_attn.1", "out"), "mlp1": ("mlps.1", "out"), "layer_output": ("", "out")}


def make(dtype=torch.float32):
    hf = build_tiny(BY_MODEL_TYPE["longcat_flash"].tiny_config(), dtype)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())  # proven on a miniature at load
    hf.base_model_blocks = model.layers._module
    return model, hf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stream_equals_hooks_and_the_five_contributions_sum_in_the_code_order(dtype):
    model, hf = make(dtype)
    expected, saved, logits = hooks_and_reads(model, hf, lambda i: TRUTH, IDS)
    for i in range(model.num_layers):
        assert {name for layer, name in saved if layer == i} == {"layer_input", "layer_output"}
        for name in ("layer_input", "layer_output"):
            assert torch.equal(saved[(i, name)], expected[(i, name)]), f"layer {i} {name}"
        h = {name: expected[(i, name)] for name in TRUTH}
        assert torch.equal(h["shortcut_input"], h["norm0"])  # the shortcut reads the first pair's normed stream
        y = ((((h["layer_input"] + h["attn0"]) + h["mlp0"]) + h["attn1"]) + h["mlp1"]) + h["shortcut"]
        assert torch.equal(y, h["layer_output"]), f"layer {i}"
        if i + 1 < model.num_layers:
            assert torch.equal(h["layer_output"], expected[(i + 1, "layer_input")])
    results = check_identity(model, IDS)  # the spec's identity, over the extras read at the five modules
    assert all(result.exact for result in results), [str(r) for r in results]
    with torch.no_grad(), model.trace(IDS):  # the logit lens of the last block is the model's logits
        readout = model.project_on_vocab(model.layers[-1].layer_output).save()
    assert torch.equal(readout, logits)
    with torch.no_grad(), model.trace(IDS):  # where the reasons send the researcher: each pair, natively
        block = model.layers[1]
        attn0 = block.self_attn[0].output[0].save()
        shortcut = block.mlp.output.save()  # runs before mlps[0]
        mlp0 = block.mlps[0].output.save()
        attn1 = block.self_attn[1].output[0].save()
        mlp1 = block.mlps[1].output.save()
    native = {"attn0": attn0, "shortcut": shortcut, "mlp0": mlp0, "attn1": attn1, "mlp1": mlp1}
    for name, tensor in native.items():
        assert torch.equal(tensor, expected[(1, name)]), name


def test_every_value_between_the_stream_ends_is_unavailable_with_where_it_lives():
    model, hf = make()
    table = model.availability(1)
    available = {key for key, entry in table.items() if entry.available}
    assert available == {"layer_input", "layer_output"}
    assert len(table) == len(CATALOG)
    for key, entry in table.items():
        if key.rpartition(".")[2] in ATTENTION_INTERNALS:
            assert "each block holds two attentions (self_attn[0] and [1])" in entry.reason, key
        elif key not in available:
            assert "model.layers[i].self_attn[0] / [1], mlps[0] / [1]" in entry.reason, key
    assert "three MLPs add to the stream" in table["mlp.mlp_output"].reason
    # the standard sublayers are the native modules (the list of both attentions, the shortcut MoE): neither stands
    # for one pair, and their values say why
    assert isinstance(hf.base_model_blocks[0].self_attn, torch.nn.ModuleList)
    for read in (lambda: model.layers[0].self_attn.attention_output, lambda: model.layers[0].mlp.mlp_output,
                 lambda: model.layers[0].attention_norm_output, lambda: model.layers[0].layer_mid):
        with pytest.raises(ValueUnavailable, match="two attention-MLP pairs"):
            with model.trace(IDS):
                read().save()
    with pytest.raises(ValueUnavailable, match="two attentions"):
        model.enable_attention_values()


def test_stream_edits_reach_the_logits_as_hooks_do():
    """layer_output zeroed at the last position in place on block 0, layer_input halved by an assignment on block 1."""
    model, hf = make()
    blocks = hf.base_model_blocks
    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(IDS):
        model.layers[0].layer_output[:, -1] = 0
        model.layers[1].layer_input = model.layers[1].layer_input * 0.5
        edited = model.logits.save()

    def zero_last(t):
        t = t.clone()
        t[:, -1] = 0
        return t

    handle = register_edit(hf, blocks[0], "out", zero_last)
    try:
        expected = run_with_hook(hf, blocks[1], "in", lambda t: t * 0.5)
    finally:
        handle.remove()
    assert torch.equal(edited, expected) and not torch.equal(edited, clean)


def test_generation_indexes_the_cache_per_attention():
    """Two attentions per block (cache slots 2i and 2i+1): greedy generation matches the plain model's."""
    model, hf = make()
    prompt = IDS[:1]
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    with torch.no_grad(), model.generate(prompt, max_new_tokens=3, do_sample=False) as tracer:
        out = tracer.result.save()
    assert torch.equal(out, want)


def test_the_default_config_miniature_is_proven():
    """The default config's shape: MLA attention, zero-computation experts among the routed ones."""
    config = CONFIG_MAPPING["longcat_flash"](num_layers=2)
    assert config.zero_expert_num > 0
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(miniature_config(config))).eval()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))  # proven at load
    assert model.family is BY_MODEL_TYPE["longcat_flash"]
    assert hf.config.zero_expert_num > 0
    results = check_identity(model, IDS)
    assert all(result.exact for result in results), [str(r) for r in results]
