"""What a new user meets first: misspelled or misplaced names, inputs the model cannot run, hooks of their own on the
model, loading mistakes. Each says what is wrong and what to do in one line, and loses nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import GPT2Config

from nnterp import StandardizedTransformer
from nnterp.core.inputs import BadInput

from ..conftest import build_tiny, tiny_tokenizer


@pytest.fixture
def gpt2():
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=16)
    return StandardizedTransformer(build_tiny(config), tokenizer=tiny_tokenizer())


MISNAMED = [  # (what the user wrote, under model., what the error suggests)
    ("layers[1].layer_ouput", "layers[1].layer_output"),
    ("layers[1].mlp_output", "layers[1].mlp.mlp_output"),
    ("layers[1].attention_output", "layers[1].self_attn.attention_output"),
    ("layers[1].self_attn.mlp_output", "layers[1].mlp.mlp_output"),
    ("layers[1].mlp.attention_premix", "layers[1].self_attn.attention_premix"),
    ("layers[1].resid_post", "layers[1].layer_output"),  # TransformerLens's name
]


def _get(model, path: str):
    target = model
    for part in path.replace("[", ".[").split("."):
        target = target[int(part[1:-1])] if part.startswith("[") else getattr(target, part)
    return target


@pytest.mark.parametrize("written, meant", MISNAMED)
def test_a_misnamed_value_says_its_right_spelling(gpt2, written, meant):
    with pytest.raises(AttributeError, match=f"Did you mean `model.{meant}`".replace("[", r"\[").replace("]", r"\]")):
        _get(gpt2, written)
    with gpt2.trace("the cat sat"):
        with pytest.raises(AttributeError, match="Did you mean"):
            _get(gpt2, written)
        _get(gpt2, meant).save()  # the suggestion is a value that exists
    assert not hasattr(_get(gpt2, written.rpartition(".")[0]), written.rpartition(".")[2])


def test_an_unrelated_name_gets_nnsights_own_error(gpt2):
    with pytest.raises(AttributeError) as error:
        _ = gpt2.layers[1].zzz_nothing
    assert "Did you mean" not in str(error.value)


@pytest.mark.parametrize("name", ["resid_post", "blocks.1.hook_resid_post", "hook_resid_post", "layer_outptu"])
def test_run_with_cache_suggests_the_standard_name(gpt2, name):
    with pytest.raises(ValueError, match="Did you mean 'layer_output'"):
        gpt2.run_with_cache("the cat", names=[name])


def _logits_equal_plain_forward(model, text="the cat sat"):
    ids = model.tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model._module(ids).logits
        with model.trace(ids):
            logits = model.logits.save()
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("prompt, message", [
    ("", "A prompt is empty"),
    ([], "The prompt list .* is empty"),
    (torch.tensor([[5, 128]]), "Token id 128 is outside the model's vocabulary of 128 ids"),
    (torch.tensor([[5, -3]]), "Token id -3 is outside the model's vocabulary"),
    ("the cat " * 12, "The input has 24 tokens, more than the 16 positions"),
])
def test_an_input_the_model_cannot_run_is_refused_in_one_line(gpt2, prompt, message):
    with pytest.raises(BadInput, match=message) as error:
        with gpt2.trace(prompt):
            gpt2.logits.save()
    assert "\n" not in str(error.value)
    _logits_equal_plain_forward(gpt2)  # nothing lost: the model runs as before


def test_a_prompt_as_long_as_the_position_table_runs(gpt2):
    _logits_equal_plain_forward(gpt2, "the cat " * 8)  # 16 tokens, the table's 16 positions


def test_a_model_moved_to_meta_says_its_weights_are_gone(gpt2):
    gpt2._module.to("meta")
    with pytest.raises(BadInput, match="meta device"):
        with gpt2.trace("the cat"):
            gpt2.logits.save()


def test_a_foreign_hook_on_the_model_is_warned_about_once(gpt2):
    block = gpt2._module.transformer.h[0]
    handle = block.register_forward_hook(lambda module, args, output: output * 2)  # GPT-2's block returns a tensor
    try:
        with pytest.warns(UserWarning, match=r"transformer\.h\.0 carries a forward hook"):
            with torch.no_grad(), gpt2.trace("the cat sat"):
                out = gpt2.layers[0].layer_output.save()
                nxt = gpt2.layers[1].layer_input.save()
        assert not torch.equal(out, nxt) and torch.equal(out * 2, nxt)  # what the warning says is so
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per hook
            with gpt2.trace("the cat sat"):
                gpt2.logits.save()
    finally:
        handle.remove()


def test_no_warning_without_foreign_hooks(gpt2):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with gpt2.trace("the cat sat"):
            gpt2.layers[0].layer_output.save()


def test_a_missing_folder_is_reported_as_a_path(tmp_path):
    for name in (str(tmp_path / "nowhere"), "./no/such/folder"):
        with pytest.raises(OSError, match="No model folder at .*no such path"):
            StandardizedTransformer(name)


def test_a_compiled_model_points_to_the_model_it_compiled(gpt2):
    compiled = torch.compile(gpt2._module)
    with pytest.raises(TypeError, match="_orig_mod"):
        StandardizedTransformer(compiled, tokenizer=gpt2.tokenizer)


def test_availability_prints_every_reason_whole(gpt2):
    table = gpt2.availability(0)
    printed = " ".join(repr(table).split())
    for entry in table.values():
        assert " ".join(str(entry).split()) in printed
