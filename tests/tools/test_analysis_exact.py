"""The analysis layer's numbers are what they say, or refused with the true reason.

Ground truth: the stream's decomposition (``decompose_resid``, whose rows the family matrix checks against hooks and
which adds up to the cached stream bit for bit), each sublayer's projection weights and bias read off the unwrapped
module, the norms' own arithmetic (``sqrt(mean(x^2) + eps)``), and passes made non-finite or steered on purpose.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from nnterp import StandardizedTransformer
from nnterp.analysis import AnalysisUnavailable, NonFiniteValues
from nnterp.documentation import tiny_cache
from nnterp.families import BY_MODEL_TYPE, FAMILIES
from nnterp.spec.errors import RunNotChosen

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import IDS, make
from ..families.test_opt_post_norm import config_of
from ..tools.test_analysis import run

STACKS = {"stack_head_results": ("attention_output", "attention_premix", "attn_out", "H"),
          "stack_neuron_results": ("mlp_output", "mlp_neurons", "mlp_out", "N")}


def _served(name: str, stack: str):
    model, cache = tiny_cache(name)
    if isinstance(cache, RunNotChosen):
        return None
    try:
        rows, labels = (cache.stack_head_results(return_labels=True) if stack == "stack_head_results" else
                        cache.stack_neuron_results(None, return_labels=True))
    except AnalysisUnavailable:
        return None
    return model, cache, rows, labels


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("name", [family.name for family in FAMILIES])
def test_a_layers_rows_and_its_projection_bias_sum_to_its_row_of_the_decomposition(name, stack):
    """On every family a stack serves: row ``{i}_attn_out`` (``{i}_mlp_out``) of ``decompose_resid`` is what block i
    adds to the stream, through every factor on the way; its heads' (neurons') rows and the projection's bias, times
    that same factor, are it."""
    served = _served(name, stack)
    if served is None:
        pytest.skip(f"{stack} is refused on {name} (the family page says why)")
    model, cache, rows, labels = served
    output, read, short, letter = STACKS[stack]
    if not labels:
        pytest.skip(f"{stack} gives {name} no rows (no block has the sublayer)")
    try:
        decomposition = dict(zip(*cache.decompose_resid(return_labels=True)[::-1]))
    except AnalysisUnavailable:  # the model changes the last block's output before its final norm: up to that block
        decomposition = dict(zip(*cache.decompose_resid(layer=model.num_layers - 1, return_labels=True)[::-1]))
    checked = 0
    for i in range(model.num_layers):
        mine = [k for k, label in enumerate(labels) if label.startswith(f"L{i}{letter}")]
        if not mine or f"{i}_{short}" not in decomposition:
            continue
        row, value = decomposition[f"{i}_{short}"].float(), cache[output, i].float()
        factor = (row * value).sum() / (value * value).sum()  # the factor the block adds its output with
        torch.testing.assert_close(row, value * factor, rtol=1e-4, atol=1e-5)
        module = model.layers[i]._module.get_submodule(model.location(i, read).path)
        bias = 0 if getattr(module, "bias", None) is None else module.bias.detach().float() * factor
        torch.testing.assert_close(rows[mine].sum(0) + bias, row, rtol=1e-4, atol=1e-4)
        checked += 1
    if not checked:  # no attention (Mamba), experts' neurons (their biases and a shared expert are the remainder)
        pytest.skip(f"{stack} gives {name} no rows of a sublayer that has a row of its own in decompose_resid")


def test_granites_heads_and_neurons_carry_the_residual_multiplier():
    r = run("granite")
    multiplier = r.hf.config.residual_multiplier
    assert multiplier != 1
    heads = r.cache.stack_head_results()
    projection = r.hf.model.layers[0].self_attn.o_proj
    premix = r.cache["attention_premix", 0].flatten(-2)
    alone = premix.view(*premix.shape[:-1], r.model.num_heads, -1).clone()
    alone[..., 1:, :] = 0  # head 0 alone
    torch.testing.assert_close(heads[0], torch.nn.functional.linear(alone.flatten(-2), projection.weight) * multiplier,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call", ["stack_head_results", "stack_neuron_results", "logit_attrs of heads"])
def test_post_norm_blocks_refuse_per_head_and_per_neuron_rows(call):
    """Post-norm OPT norms the stream after each add: no head or neuron adds a fixed row to the stream."""
    hf_model = build_tiny(config_of({"do_layer_norm_before": False}))
    _, cache = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer()).run_with_cache(IDS)
    calls = {"stack_head_results": lambda: cache.stack_head_results(),
             "stack_neuron_results": lambda: cache.stack_neuron_results(None),
             "logit_attrs of heads": lambda: cache.logit_attrs(cache.stack_head_results(), IDS)}
    with pytest.raises(AnalysisUnavailable, match=r"OPT.*: block 0's identity, .*layer_norm.*, is not the stream it "
                                                  r"receives plus contributions"):
        calls[call]()


def test_doges_heads_are_refused_as_its_decomposition_is():
    hf_model = build_tiny(BY_MODEL_TYPE["doge"].tiny_config())
    _, cache = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer()).run_with_cache(IDS)
    with pytest.raises(AnalysisUnavailable, match=r"Doge: block 0's identity, .*post_attention_residual"):
        cache.stack_head_results()


def _nan_at(case: str, prompt: int, position: int):
    """A cache of a pass whose embedding is NaN at one prompt's position (as an input or an edit can make it)."""
    model = make(case, torch.float32)[0]
    hf_model = model._module
    embed = hf_model.get_input_embeddings()
    saved = embed.weight.data[IDS[prompt, position]].clone()
    embed.weight.data[IDS[prompt, position]] = float("nan")
    try:
        return model.run_with_cache(IDS)[1]
    finally:
        embed.weight.data[IDS[prompt, position]] = saved


@pytest.mark.parametrize("call", ["decompose_resid", "ln_final_scale", "apply_ln_to_stack"])
def test_a_nan_in_one_prompt_is_named_not_blamed_on_the_model(call):
    assert IDS[1].tolist().count(IDS[1, 2].item()) == 1 and IDS[1, 2] not in IDS[0]
    cache = _nan_at("llama", 1, 2)
    calls = {"decompose_resid": lambda: cache.decompose_resid(),
             "ln_final_scale": lambda: cache["ln_final_scale"],
             "apply_ln_to_stack": lambda: cache.apply_ln_to_stack(cache.decompose_resid(layer=1), layer=1)}
    # the stream the final norm reads holds it everywhere (attention spreads a NaN): there the prompt is named
    position = r"\d+" if call == "ln_final_scale" else "2"
    with pytest.raises(NonFiniteValues, match=rf"is nan at prompt 1, position {position}, .*not the model's "
                                              "structure") as error:
        calls[call]()
    assert "changes the stream" not in str(error.value) and "is not a LayerNorm" not in str(error.value)


def test_a_steered_cache_is_refused_for_its_steering():
    model = make("llama", torch.float32)[0]
    vector = torch.ones(model.hidden_size)
    _, cache = model.run_with_cache(IDS, steer={"layers": 0, "vector": vector, "value": "layer_output"})
    with pytest.raises(AnalysisUnavailable, match=r"its pass was steered at layers\[0\]\.layer_output") as error:
        cache.decompose_resid()
    assert "changes the stream between its blocks" not in str(error.value)


@pytest.mark.parametrize("case", ["llama", "gpt2", "olmo"])
def test_the_norm_scale_at_a_zero_input_is_the_norms_sqrt_eps(case):
    """A pad's stream can be exactly zero: the norm divided it by sqrt(0 + eps), which its scale must say."""
    model, hf_model = make(case, torch.float32)[:2]
    config = hf_model.config
    eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_epsilon", None) or 1e-5  # OLMo: 1e-5
    zeroed = {}

    def zero_position(module, args):  # block 0's input zero at prompt 0, position 1
        x = args[0].clone()
        x[0, 1] = 0
        zeroed["x"] = x
        return (x, *args[1:])

    handle = model._module.get_submodule(model.family.layers)[0].register_forward_pre_hook(zero_position)
    try:
        _, cache = model.run_with_cache(IDS)
    finally:
        handle.remove()
    x = zeroed["x"]
    centred = x - x.mean(-1, keepdim=True) if case != "llama" else x  # GPT-2's and OLMo's LayerNorms centre
    expected = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    scale = cache["attention_norm_scale", 0]
    assert scale[0, 1].item() == pytest.approx(eps ** 0.5, rel=1e-3)
    torch.testing.assert_close(scale, expected, rtol=1e-4, atol=0)


def test_a_pos_slice_that_lands_on_pads_warns_naming_the_padding_side():
    """A right-padded batch: column -1 is a pad of the short prompt, and what its rows there hold is a pad's."""
    model = make("llama", torch.float32)[0]
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    _, cache = model.run_with_cache({"input_ids": ids, "attention_mask": mask})
    assert cache.attention_mask.tolist() == mask.tolist()
    stack = cache.decompose_resid()
    for call in (lambda: cache.decompose_resid(pos_slice=-1), lambda: cache.stack_head_results(pos_slice=-1),
                 lambda: cache.accumulated_resid(pos_slice=-1), lambda: cache.logit_attrs(stack[:, :, -1], 5, pos_slice=-1)):
        with pytest.warns(UserWarning, match=r"padding for prompt\(s\) \[1\] of this batch, padded on the right"):
            call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.decompose_resid(pos_slice=1)  # a real token of every prompt: no warning


def test_logit_attrs_reads_the_token_given_and_refuses_what_is_no_token_id():
    r = run("llama")
    stack = r.cache.decompose_resid()
    logit = r.head["output"][..., 17]  # the plain forward's logit of token 17
    for given in (17, np.int64(17), torch.tensor(17), torch.tensor(17.0)):
        torch.testing.assert_close(r.cache.logit_attrs(stack, given).sum(0), logit, rtol=1e-5, atol=1e-5)
    for given, message in ((torch.tensor(-1), "outside the vocabulary"), (torch.tensor(17.9), "17.9"),
                           (True, "bool"), (-1, "outside the vocabulary")):
        with pytest.raises((ValueError, TypeError), match=message):
            r.cache.logit_attrs(stack, given)


def test_a_remainder_of_a_stream_with_more_positions_than_the_blocks_is_refused():
    """CPM-Ant's final norm reads the prompt's positions and the ones it adds: no remainder of the blocks' rows."""
    model, cache = tiny_cache("CPM-Ant")
    assert cache["ln_final_input"].shape[1] > cache["layer_input", 0].shape[1]  # the premise
    with pytest.raises(AnalysisUnavailable, match=r"CPM-Ant: the stream at layer \d+ has shape \[1, 8, 64\], the "
                                                  r"blocks' rows \[1, 5, 64\]"):
        cache.stack_head_results(incl_remainder=True)
