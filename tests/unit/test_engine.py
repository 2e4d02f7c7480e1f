"""The engine's read path: a value read goes from the envoy's descriptor to its bound value, then to nnsight.

The count of Python calls into nnterp's own code is structural (no timing): ``benchmarks/reads.py`` prints the
same count with the time per value against raw nnsight's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nnsight
import torch
import transformers as T

import nnterp
from nnterp import StandardizedTransformer

from ..conftest import tiny_tokenizer

NNTERP_FILES = str(Path(nnterp.__file__).parent)


def llama() -> T.PreTrainedModel:
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return T.LlamaForCausalLM(config).eval()


def calls_of_one_read(model: StandardizedTransformer, ids: torch.Tensor) -> list[str]:
    calls: list[str] = []

    def profile(frame, event, _):
        if event == "call" and frame.f_code.co_filename.startswith(NNTERP_FILES):
            calls.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")

    with model.trace(ids):
        model.layers[0].mlp.mlp_output  # noqa: B018 - a pass's first value
        sys.setprofile(profile)
        model.layers[1].mlp.mlp_output  # noqa: B018
        sys.setprofile(None)
    return calls


def test_a_cached_read_makes_at_most_five_calls_into_nnterp_and_gives_the_hooked_tensor():
    hf = llama()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    ids = torch.randint(0, 1000, (2, 6))
    calls_of_one_read(model, ids)  # binds the value
    calls = calls_of_one_read(model, ids)
    assert len(calls) <= 5, calls
    hooked = {}
    def keep(module, args, output):  # returns None: the output stays the model's
        hooked["mlp"] = output.detach().clone()

    handle = hf.model.layers[1].mlp.register_forward_hook(keep)
    try:
        hf(ids)
    finally:
        handle.remove()
    with model.trace(ids):
        read = model.layers[1].mlp.mlp_output.save()
    assert torch.equal(read, hooked["mlp"])


def test_bound_values_follow_the_attention_values_turned_on_and_off():
    """The values' places change with the attention implementation: bound values are bound again."""
    hf = llama()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    ids = torch.randint(0, 1000, (1, 5))
    assert not hasattr(model.layers[1].self_attn, "attention_probabilities")
    model.enable_attention_values()
    hooked = {}
    def keep(module, args, output):  # returns None: the output stays the model's
        hooked["p"] = output[1].detach().clone()

    handle = hf.model.layers[1].self_attn.register_forward_hook(keep)
    try:
        with model.trace(ids):
            probabilities = model.layers[1].self_attn.attention_probabilities.save()
    finally:
        handle.remove()
    assert torch.equal(probabilities, hooked["p"])
    model.disable_attention_values()
    assert not hasattr(model.layers[1].self_attn, "attention_probabilities")


def test_a_value_read_twice_before_it_is_handed_back_is_one_tensor_and_its_edit_reaches_the_model():
    """A per-head view read with gradients on goes back to the model through nnsight's eproperty write-back: a second
    read before the trace moves on is the same tensor, so an edit made through either is the one the model sees."""
    hf = llama()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    ids = torch.randint(0, 1000, (1, 5))
    with model.trace(ids):
        first = model.layers[1].self_attn.attention_premix
        second = model.layers[1].self_attn.attention_premix
        same = nnsight.save([first is second])
        second[:, :, 0] = 0
        edited = first.detach().clone().save()
        projected = model.layers[1].self_attn.o_proj.output.save()  # what the model made of its input
    assert same == [True]
    assert edited[:, :, 0].eq(0).all() and edited[:, :, 1:].ne(0).any()
    with torch.no_grad():  # the projection of the edited heads is what the model computed
        assert torch.allclose(hf.model.layers[1].self_attn.o_proj(edited.flatten(2)), projected, atol=1e-6)
