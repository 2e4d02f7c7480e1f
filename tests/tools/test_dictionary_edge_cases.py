"""Dictionaries where their math has no answer: a normalizing dictionary on a zero vector (a left-padded batch's
pad positions, whose attention output is exactly zero), a non-finite input.

Ground truth is independent of nnterp: the logits and values of a plain forward of the unwrapped HF model on the
same ``input_ids``, ``attention_mask`` and ``position_ids`` (each prompt's tokens at their own positions, as
nnsight places a left-padded batch's), edited by plain forward hooks; the features and the decoder's change
are SAELens's math, written out in test_dictionaries.
"""

from __future__ import annotations

import math

import nnsight
import pytest
import torch

from nnterp.dictionaries import Dictionary, load_dictionary
from nnterp.dictionaries.splicing import splice

from ..tools.test_dictionaries import D_SAE, hooked, model_of, rand, saelens_features, saelens_folder

PADDED = ["the cat sat on the mat", "Paris is"]  # the second is left-padded
# values that are exactly zero at the pad positions (SDPA attention with no key to attend to): Llama's attention
# has no output bias, GPT-2's has one, so its per-head outputs before the projection
SITES = [("llama", "attention_output", "hook_attn_out"), ("gpt2", "attention_premix", "attn.hook_z")]
NORMALIZING = ["constant_norm_rescale", "layer_norm"]


def padded(model):
    """The batch, left-padded, each prompt's tokens at their own positions: given as they are to the unwrapped
    model and to the trace."""
    inputs = dict(model.tokenizer(PADDED, return_tensors="pt", padding=True, padding_side="left"))
    return {**inputs, "position_ids": (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)}


def decoder_scale(normalize, x):
    """What SAELens's decoder multiplies by to undo the input's normalization (run_time_activation_norm_fn_out)."""
    if normalize == "constant_norm_rescale":
        return x.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
    return (x - x.mean(-1, keepdim=True)).std(-1, keepdim=True)


def run(model, inputs, dictionary, edit=None, keep_error=True):
    """A trace splicing ``dictionary``, ``edit(features)`` inside: (features, unencoded, logits)."""
    with torch.no_grad(), model.trace(inputs):
        spliced = splice(model, dictionary, keep_error=keep_error)
        with spliced as features:
            seen = nnsight.save(features.clone())
            if edit is not None:
                edit(features)
        unencoded = nnsight.save(spliced.unencoded)
        logits = nnsight.save(model.logits)
    return seen, unencoded, logits


@pytest.mark.parametrize(("case", "value", "hook"), SITES)
@pytest.mark.parametrize("normalize", NORMALIZING)
def test_a_normalizing_dictionary_spliced_on_a_padded_batch_keeps_the_pad_positions(case, value, hook, normalize,
                                                                                    tmp_path):
    model, *_ = model_of(case)
    inputs = padded(model)
    site = (1, value)
    captured, plain = hooked(case, [site], inputs=inputs)
    x = captured[site].flatten(2)
    pads = x.norm(dim=-1) == 0
    assert torch.equal(pads, inputs["attention_mask"] == 0)  # the premise: the value is exactly zero there
    folder, cfg, weights = saelens_folder(tmp_path, "standard", x.shape[-1], f"blocks.1.{hook}", normalize=normalize)
    dictionary = load_dictionary(folder)
    expected = saelens_features(cfg, weights, x)

    assert_unedited_changes_nothing(model, inputs, dictionary, plain, pads, expected)

    # a clamp at every position adds its change at the real ones, times the decoder's scale, and none at the pads
    feature = int(expected[~pads].gt(0).sum(0).argmax())
    change = (2.0 - expected[..., feature:feature + 1]) * weights["W_dec"][feature] * decoder_scale(normalize, x)
    change = torch.where(pads[..., None], 0.0, change)
    _, edited = hooked(case, [site], edits={site: lambda t: t + change.view(t.shape)}, inputs=inputs)
    _, _, logits = run(model, inputs, dictionary, edit=lambda f: f[..., feature].fill_(2.0))
    assert logits.isfinite().all()
    torch.testing.assert_close(logits, edited, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, plain, atol=1e-4)


def assert_unedited_changes_nothing(model, inputs, dictionary, plain, pads, expected):
    """Unedited: the logits bit for bit; the pad positions reported, their features zero, the others the producer's."""
    features, unencoded, logits = run(model, inputs, dictionary)
    assert torch.equal(logits, plain)
    assert torch.equal(unencoded, pads) and torch.equal(features[pads], torch.zeros(int(pads.sum()), D_SAE))
    torch.testing.assert_close(features[~pads], expected[~pads], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalize", NORMALIZING)
def test_a_normalizing_transcoder_spliced_on_a_padded_batch_keeps_the_pad_positions(normalize, tmp_path):
    """SAELens's transcoder normalizes its input and does not undo it: its prediction is of another site."""
    model, *_ = model_of("llama")
    inputs = padded(model)
    sites = [(1, "attention_output"), (1, "mlp_output")]
    captured, plain = hooked("llama", sites, inputs=inputs)
    x, pads = captured[sites[0]], inputs["attention_mask"] == 0
    folder, cfg, weights = saelens_folder(tmp_path, "transcoder", 64, "blocks.1.hook_attn_out", normalize=normalize,
                                          apply_b_dec=False, hook_out="blocks.1.hook_mlp_out")
    dictionary = load_dictionary(folder)
    assert (dictionary.site, dictionary.out_site) == tuple(sites)
    expected = saelens_features(cfg, weights, x)

    assert_unedited_changes_nothing(model, inputs, dictionary, plain, pads, expected)

    feature = int(expected[~pads].gt(0).sum(0).argmax())
    change = torch.where(pads[..., None], 0.0, (2.0 - expected[..., feature:feature + 1]) * weights["W_dec"][feature])
    _, edited = hooked("llama", sites, edits={sites[1]: lambda t: t + change}, inputs=inputs)
    _, _, logits = run(model, inputs, dictionary, edit=lambda f: f[..., feature].fill_(2.0))
    torch.testing.assert_close(logits, edited, rtol=1e-5, atol=1e-5)

    # without the error: the prediction at the real positions, the MLP's own output at the pads
    predicted = torch.where(pads[..., None], 0.0, expected) @ weights["W_dec"] + weights["b_dec"]
    _, replaced = hooked("llama", sites, edits={sites[1]: lambda t: torch.where(pads[..., None], t, predicted)},
                         inputs=inputs)
    _, _, logits = run(model, inputs, dictionary, keep_error=False)
    torch.testing.assert_close(logits, replaced, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalize", ["none", *NORMALIZING])
def test_what_a_dictionary_cannot_encode_has_zero_features(normalize):
    """A zero (or constant) vector has no direction to normalize; a non-finite one has no features at all."""
    W_enc, W_dec, b_enc, b_dec = rand(16, 40, seed=2), rand(40, 16, seed=3), rand(40, seed=4), rand(16, seed=5)
    dictionary = Dictionary(W_enc, b_enc, W_dec, b_dec, normalize=normalize, center=b_dec)
    x = rand(5, 16, seed=1, scale=2.0)
    x[1], x[3, 0] = 0.0, float("nan")
    cannot = torch.tensor([False, normalize != "none", False, True, False])
    features = dictionary.encode(x)
    normalized = x
    if normalize == "constant_norm_rescale":
        normalized = x * math.sqrt(16) / x.norm(dim=-1, keepdim=True)
    elif normalize == "layer_norm":
        normalized = (x - x.mean(-1, keepdim=True)) / (decoder_scale(normalize, x) + 1e-5)
    torch.testing.assert_close(features[~cannot], torch.relu((normalized - b_dec) @ W_enc + b_enc)[~cannot])
    assert torch.equal(features[cannot], torch.zeros(int(cannot.sum()), 40))
