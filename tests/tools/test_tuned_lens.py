"""Tuned lenses: tuned-lens's files read by nnterp, applied in logit_lens.

Ground truth is independent of nnterp: the folder is written as tuned-lens's ``TunedLens.save`` writes it (the
state dict of a ``ModuleList`` of ``nn.Linear(d_model, d_model)`` as params.pt, ``TunedLensConfig.to_dict()`` as
config.json, its ``unembed_hash`` computed as ``Unembed.unembedding_hash`` does); the streams are captured by
plain PyTorch forward hooks on the unwrapped HF model, and the lens is tuned-lens's math on them:
``unembed(h + translator_i(h))`` with translator ``i`` reading ``hidden_states[i]``, the input of block ``i``
(tuned-lens's train and eval loops: ``zip(range(L), output.hidden_states[:-1])``), through the model's final norm
and head.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from nnterp import StandardizedTransformer, logit_lens
from nnterp.dictionaries import DictionaryError
from nnterp.families import BY_MODEL_TYPE
from nnterp.tools.tuned_lens import load_tuned_lens

from ..conftest import build_tiny, tiny_tokenizer

PROMPTS = ["the cat sat on the mat", "Paris is in the city of"]
MODELS: dict = {}


def model_of(case, seed=0):
    if (case, seed) not in MODELS:
        MODELS[(case, seed)] = StandardizedTransformer(build_tiny(BY_MODEL_TYPE[case].tiny_config(), seed=seed),
                                                       tokenizer=tiny_tokenizer())
    return MODELS[(case, seed)]


def save_tuned_lens(folder, model, bias=True, seed=0, **config):
    """tuned-lens's ``TunedLens.save``, with random translators (tuned-lens's start at zero: the logit lens)."""
    d, layers = model.hidden_size, model.num_layers
    generator = torch.Generator().manual_seed(seed)
    translators = torch.nn.ModuleList([torch.nn.Linear(d, d, bias=bias) for _ in range(layers)])
    with torch.no_grad():
        for translator in translators:
            translator.weight.copy_(torch.randn(d, d, generator=generator) * 0.2)
            if bias:
                translator.bias.copy_(torch.randn(d, generator=generator) * 0.2)
    weight = model._module.get_output_embeddings().weight
    unembed_hash = hashlib.sha256(str.encode(np.array_str(weight.detach().cpu().float().numpy(), precision=1)))
    folder.mkdir(parents=True)
    torch.save(translators.state_dict(), folder / "params.pt")
    (folder / "config.json").write_text(json.dumps({
        "base_model_name_or_path": "tiny", "d_model": d, "num_hidden_layers": layers, "bias": bias,
        "base_model_revision": None, "unembed_hash": unembed_hash.hexdigest(), "lens_type": "linear_tuned_lens",
        **config}))
    return folder, translators


def tuned_lens_by_hand(model, prompt, translators):
    """``[layers, vocab]`` at the prompt's last token: each block's output through tuned-lens's translator of the
    stream it is (``hidden_states[i + 1]``, the next block's input; the last block's output untranslated), then the
    final norm and head, from plain forward hooks."""
    hf = model._module
    base = hf.base_model
    blocks, norm = (base.h, base.ln_f) if hasattr(base, "h") else (base.layers, base.norm)
    outputs = []
    handles = [block.register_forward_hook(lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple) else o))
               for block in blocks]
    try:
        with torch.no_grad():
            hf(input_ids=model.tokenizer(prompt, return_tensors="pt").input_ids)
    finally:
        for handle in handles:
            handle.remove()
    rows = []
    with torch.no_grad():
        for layer, output in enumerate(outputs):
            h = output[0, -1]
            if layer + 1 < len(blocks):
                h = h + translators[layer + 1](h)
            rows.append(hf.get_output_embeddings()(norm(h)).softmax(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("case", ["gpt2", "llama"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_tuned_lens_is_each_streams_translator_then_the_readout(case, bias, tmp_path):
    model = model_of(case)
    folder, translators = save_tuned_lens(tmp_path / "lens", model, bias=bias)
    lens = load_tuned_lens(folder)
    probs = logit_lens(model, PROMPTS, lens=lens)
    expected = torch.stack([tuned_lens_by_hand(model, prompt, translators) for prompt in PROMPTS])
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4)
    plain = logit_lens(model, PROMPTS)  # the last layer's output has no translator: the model's own distribution
    torch.testing.assert_close(probs[:, -1], plain[:, -1], atol=1e-6, rtol=0)
    assert not torch.allclose(probs[:, 0], plain[:, 0], atol=1e-3)


def test_the_tuned_lens_of_a_blocks_input_is_its_own_translator(tmp_path):
    model = model_of("gpt2")
    folder, translators = save_tuned_lens(tmp_path / "lens", model)
    probs = logit_lens(model, PROMPTS[0], value="layer_input", position=None, lens=load_tuned_lens(folder))
    inputs = []
    hf = model._module
    handles = [block.register_forward_pre_hook(lambda m, a, k: inputs.append(a[0] if a else k["hidden_states"]),
                                               with_kwargs=True) for block in hf.transformer.h]
    try:
        with torch.no_grad():
            hf(input_ids=model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids)
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        expected = torch.stack([hf.lm_head(hf.transformer.ln_f(h[0] + translators[i](h[0]))).softmax(-1)
                                for i, h in enumerate(inputs)])
    torch.testing.assert_close(probs[0], expected, atol=1e-5, rtol=1e-4)


def test_a_tuned_lens_is_refused_where_it_was_not_trained(tmp_path):
    model = model_of("gpt2")
    folder, _ = save_tuned_lens(tmp_path / "lens", model)
    lens = load_tuned_lens(folder)
    with pytest.raises(DictionaryError, match="between blocks"):
        logit_lens(model, PROMPTS, value="mlp_output", lens=lens)
    other = model_of("gpt2", seed=1)  # the same shapes, another unembedding
    with pytest.raises(DictionaryError, match="another unembedding"):
        logit_lens(other, PROMPTS, lens=lens)
    lens.unembed_hash = None  # the user's choice, said in the error
    assert logit_lens(other, PROMPTS, lens=lens).shape == (2, other.num_layers, other.vocab_size)
    llama = model_of("llama")
    folder, _ = save_tuned_lens(tmp_path / "other", llama, num_hidden_layers=llama.num_layers)
    shorter = load_tuned_lens(folder)
    shorter.unembed_hash = None
    shorter.weight, shorter.bias = shorter.weight[:-1], shorter.bias[:-1]
    with pytest.raises(DictionaryError, match=f"{llama.num_layers - 1} layers"):
        logit_lens(llama, PROMPTS, lens=shorter)


def test_what_is_not_a_tuned_lens_is_refused(tmp_path):
    model = model_of("gpt2")
    with pytest.raises(DictionaryError, match="holds no tuned lens"):
        load_tuned_lens(tmp_path)
    folder, _ = save_tuned_lens(tmp_path / "lens", model, lens_type="something_else")
    with pytest.raises(DictionaryError, match="something_else"):
        load_tuned_lens(folder)
    folder, _ = save_tuned_lens(tmp_path / "more", model, num_hidden_layers=model.num_layers + 1)
    with pytest.raises(DictionaryError, match="layer_translators"):
        load_tuned_lens(folder)
    with pytest.raises(TypeError, match="TunedLens"):
        logit_lens(model, PROMPTS, lens=object())
