"""The specification page's examples, run as written on GPT-2's architecture.

GPT2Config defaults with random weights and GPT-2's real tokenizer, saved to a folder and
loaded by path, stand in for "openai-community/gpt2"; a tiny BLOOM folder stands in for
"bigscience/bloom-560m". Every printed line must come out as the page prints it (the edit
example's number depends on the pretrained weights, so only its being non-zero is checked).
"""

from __future__ import annotations

import pytest
import torch
from nnsight.intervention.interleaver import OutOfOrderError
from transformers import BloomConfig, GPT2Config, GPT2LMHeadModel

from nnterp import StandardizedTransformer

from ..conftest import build_tiny


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, gpt2_tokenizer_dir):
    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(folder)
    for f in gpt2_tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return str(folder)


@pytest.fixture(scope="module")
def model(gpt2_dir):
    return StandardizedTransformer(gpt2_dir)


def test_residual_stream(model, capsys):
    with model.trace("The Eiffel Tower is in"):
        x = model.layers[5].layer_input.save()
        attn = model.layers[5].self_attn.attention_output.save()
        mlp = model.layers[5].mlp.mlp_output.save()
        out = model.layers[5].layer_output.save()

    print(x.shape, attn.shape, mlp.shape, out.shape)
    print(torch.equal(x + attn + mlp, out))
    assert capsys.readouterr().out.splitlines() == [
        "torch.Size([1, 7, 768]) torch.Size([1, 7, 768]) torch.Size([1, 7, 768]) torch.Size([1, 7, 768])",
        "True",
    ]


def test_a_tensor_on_every_family(tmp_path, gpt2_tokenizer_dir, capsys):
    folder = tmp_path / "bloom"
    build_tiny(BloomConfig(n_layer=4, hidden_size=64, n_head=4, vocab_size=50257)).save_pretrained(folder)
    for f in gpt2_tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())

    bloom = StandardizedTransformer(str(folder))

    with bloom.trace("The Eiffel Tower is in"):
        raw = bloom.layers[2].output.save()
        out = bloom.layers[2].layer_output.save()

    print(type(raw), type(out), torch.equal(raw[0], out))
    assert capsys.readouterr().out == "<class 'tuple'> <class 'torch.Tensor'> True\n"


def test_between_the_sublayers(model, capsys):
    block = model.layers[5]
    with model.trace("The Eiffel Tower is in"):
        x = block.layer_input.save()
        normed = block.attention_norm_output.save()
        premix = block.self_attn.attention_premix.save()
        attn = block.self_attn.attention_output.save()
        mid = block.layer_mid.save()
        mlp_normed = block.mlp_norm_output.save()
        mlp_in = block.mlp_input.save()
        act = block.mlp.mlp_activation.save()
        neurons = block.mlp.mlp_neurons.save()

    print(premix.shape, act.shape, neurons.shape)
    print(torch.equal(mid, x + attn), torch.equal(mlp_normed, mlp_in), torch.equal(act, neurons))
    assert capsys.readouterr().out.splitlines() == [
        "torch.Size([1, 7, 12, 64]) torch.Size([1, 7, 3072]) torch.Size([1, 7, 3072])",
        "True True True",
    ]
    assert normed.shape == (1, 7, 768)


def test_reading_editing_assigning(model, capsys):
    with model.trace("The Eiffel Tower is in"):
        clean = model.logits.save()

    with model.trace("The Eiffel Tower is in"):
        model.layers[5].self_attn.attention_output[:, -1] = 0
        model.layers[5].mlp.mlp_output[:] = 0
        model.layers[7].layer_output = model.layers[7].layer_output * 2
        edited = model.logits.save()

    print((edited - clean).abs().max().item())
    assert float(capsys.readouterr().out) > 0


def test_order(model, capsys):
    print(model.order(5))
    assert capsys.readouterr().out == (
        "{'layer_input': 0, 'attention_norm_output': 1, 'self_attn.attention_premix': 2, "
        "'self_attn.attention_output': 3, 'layer_mid': 4, 'mlp_norm_output': 5, 'mlp_input': 6, "
        "'mlp.mlp_activation': 7, 'mlp.mlp_neurons': 8, 'mlp.mlp_output': 9, 'layer_output': 10}\n"
    )
    with pytest.raises(OutOfOrderError):
        with model.trace("The Eiffel Tower is in"):
            model.layers[5].mlp.mlp_output.save()
            model.layers[5].layer_input.save()
