"""A tuned lens as a dictionary: each translator a ``Dictionary`` whose features are the translated stream.

Ground truth is independent of nnterp: the lens's folder is written as tuned-lens writes it (test_tuned_lens's
``save_tuned_lens``), the translators applied by hand are those ``nn.Linear`` modules (``h + translator(h)``), the
streams and the edited forward are plain PyTorch hooks on the unwrapped HF model, and the stream change that
moves the translated stream by ``change`` is solved for with ``torch.linalg.solve``: ``(I + W) delta = change``.
"""

from __future__ import annotations

import nnsight
import pytest
import torch

from nnterp import collect, load_dictionary
from nnterp.dictionaries import DictionaryError
from nnterp.dictionaries.splicing import splice
from nnterp.tools.tuned_lens import load_tuned_lens

from ..tools.test_tuned_lens import PROMPTS, model_of, save_tuned_lens


def block_inputs(model, prompt, edit=None):
    """``([input of block i, [seq, d]] for each block, logits)`` of one prompt alone, from pre-hooks on the HF
    model's blocks; ``edit = (layer, tensor)`` adds ``tensor`` to that block's input."""
    hf = model._module
    blocks = hf.base_model.h if hasattr(hf.base_model, "h") else hf.base_model.layers
    inputs = []

    def record(index):
        def pre(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if edit is not None and edit[0] == index:
                hidden = hidden + edit[1]
                args, kwargs = ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
            inputs.append(hidden[0].detach().clone())
            return args, kwargs
        return pre

    handles = [block.register_forward_pre_hook(record(i), with_kwargs=True) for i, block in enumerate(blocks)]
    try:
        with torch.no_grad():
            logits = hf(input_ids=model.tokenizer(prompt, return_tensors="pt").input_ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return inputs, logits


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_each_translator_is_a_dictionary_of_the_stream_it_translates(case, tmp_path):
    model = model_of(case)
    folder, translators = save_tuned_lens(tmp_path / "lens", model)
    lens = load_tuned_lens(folder)
    dictionaries = lens.dictionaries()
    assert [d.site for d in dictionaries] == [(i, "layer_input") for i in range(model.num_layers)]
    streams = [block_inputs(model, prompt)[0] for prompt in PROMPTS]
    for layer, dictionary in enumerate(dictionaries):
        assert dictionary.d_in == dictionary.d_sae == model.hidden_size
        h = torch.cat([inputs[layer] for inputs in streams])
        with torch.no_grad():
            translated = h + translators[layer](h)  # tuned-lens's transform_hidden
        torch.testing.assert_close(dictionary.encode(h), translated, atol=1e-5, rtol=1e-5)
        # the inverse, in float32: its rounding grows with the translator's condition number
        forward = torch.eye(h.shape[-1], dtype=torch.float64) + translators[layer].weight.detach().double()
        bound = torch.linalg.cond(forward).item() * torch.finfo(torch.float32).eps * translated.abs().max().item()
        torch.testing.assert_close(dictionary.decode(translated), h, atol=max(1e-4, bound), rtol=1e-4)
        # load_dictionary reads the same translator from the folder, its site naming which
        chosen = load_dictionary(folder, site=(layer, "layer_input"))
        torch.testing.assert_close(chosen.encode(h), translated, atol=1e-5, rtol=1e-5)
    # the translator of a block's output is the next block's
    with torch.no_grad():
        h = streams[0][1]
        torch.testing.assert_close(lens.dictionary(0, "layer_output").encode(h), h + translators[1](h))
    # collected: what each layer's lens reads, at every token
    collection = collect(model, PROMPTS, tmp_path / "c", values=[], positions="all", batch_size=1,
                         dictionaries=dictionaries, progress=False)
    for layer in range(model.num_layers):
        h = torch.cat([inputs[layer] for inputs in streams])
        with torch.no_grad():
            expected = h + translators[layer](h)
        torch.testing.assert_close(collection[f"features/layers.{layer}.layer_input"], expected, atol=1e-5, rtol=1e-5)


def test_an_edit_of_the_translated_stream_moves_the_stream_by_the_translators_inverse(tmp_path):
    model = model_of("gpt2")
    folder, translators = save_tuned_lens(tmp_path / "lens", model)
    layer, feature, amount = 2, 5, 1.5
    dictionary = load_tuned_lens(folder).dictionary(layer)
    change = torch.zeros(model.hidden_size)
    change[feature] = amount
    weight = translators[layer].weight.detach().double()
    delta = torch.linalg.solve(torch.eye(model.hidden_size, dtype=torch.float64) + weight, change.double()).float()
    prompt = PROMPTS[0]
    (plain, plain_logits), (edited, expected) = block_inputs(model, prompt), block_inputs(model, prompt, (layer, delta))
    with torch.no_grad():  # the math: the edited stream's translation is the original's plus the change
        moved = (edited[layer] + translators[layer](edited[layer])) - (plain[layer] + translators[layer](plain[layer]))
    torch.testing.assert_close(moved, change.expand_as(moved), atol=1e-4, rtol=0)
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad(), model.trace(ids):
        with splice(model, dictionary):
            pass
        unedited = nnsight.save(model.logits)
    with torch.no_grad(), model.trace(ids):
        with splice(model, dictionary) as features:
            features[..., feature] += amount
        logits = nnsight.save(model.logits)
    assert torch.equal(unedited, plain_logits)  # an unedited splice changes nothing
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits, plain_logits, atol=1e-3)


def test_a_lens_without_a_translator_or_site_is_refused_with_the_way_to_say_which(tmp_path):
    model = model_of("llama")
    folder, _ = save_tuned_lens(tmp_path / "lens", model, bias=False)
    lens = load_tuned_lens(folder)
    with pytest.raises(DictionaryError, match="last block's output"):
        lens.dictionary(model.num_layers - 1, "layer_output")
    with pytest.raises(DictionaryError, match="between blocks"):
        lens.dictionary(1, "mlp_output")
    with pytest.raises(DictionaryError, match=r"is a tuned lens.*site=\(layer, 'layer_input'\)"):
        load_dictionary(folder)
    lens.weight[1] = -torch.eye(model.hidden_size)  # identity + weight = 0: nothing to decode with
    with pytest.raises(DictionaryError, match="singular"):
        lens.dictionary(1)
