"""The public registry: a user's spec is served once proven on a miniature, and refused, naming why, when not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nnterp import (
    RegistrationError,
    StandardizedTransformer,
    UnknownArchitecture,
    register_family,
    unregister_family,
)
from nnterp.core.validation import ValidationError, check_identity
from nnterp.families import BY_MODEL_TYPE, OWN_ATTENTION, Family, family_of, output, pre_norm_block

from ..conftest import perturb, tiny_tokenizer
from ..custom_decoder import CustomConfig, CustomForCausalLM
from ..families.test_families import IDS, PRE_NORM, hooks_and_reads

TRUTH = {**PRE_NORM("norm1", "attn", "attn.out", "norm2", "ffn", "ffn.act", "ffn.down")}


def custom_block(config, i):
    return pre_norm_block(input_norm="norm1", attention="attn", o_proj="attn.out", post_norm="norm2", mlp="ffn",
                          act="ffn.act", down_proj="ffn.down")


CUSTOM = Family(name="Custom", model_types=(CustomConfig.model_type,), layers="model.layers",
                embed_tokens="model.embed_tokens", ln_final="model.norm", attention="attn", mlp="ffn",
                block=custom_block, tiny_config=CustomConfig, attention_internals=OWN_ATTENTION)


@pytest.fixture
def registered():
    register_family(CUSTOM, architecture=CustomForCausalLM)
    yield
    unregister_family(CustomConfig.model_type)


def test_a_registered_spec_serves_the_values_plain_hooks_see(registered):
    torch.manual_seed(0)
    hf = perturb(CustomForCausalLM(CustomConfig())).eval()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())  # validated at load, like any model
    hf.base_model_blocks = hf.model.layers
    expected, saved, logits = hooks_and_reads(model, hf, lambda i: TRUTH, IDS)
    for (i, name), want in expected.items():
        assert torch.equal(saved[(i, name)], want.reshape(saved[(i, name)].shape)), f"layer {i} {name}"
    assert len(expected) == len(TRUTH) * model.num_layers
    assert all(result.exact for result in check_identity(model, IDS))


def test_unregistering_stops_serving_the_type():
    register_family(CUSTOM, architecture=CustomForCausalLM)
    assert family_of(CustomConfig()) is CUSTOM
    unregister_family(CustomConfig.model_type)
    with pytest.raises(UnknownArchitecture, match="nnterp_test_decoder"):
        family_of(CustomConfig())
    with pytest.raises(RegistrationError, match="was not registered"):
        unregister_family(CustomConfig.model_type)


def misplaced(**values):
    def block(config, i):
        spec = custom_block(config, i)
        return dataclasses.replace(spec, values={**spec.values, **values})
    return dataclasses.replace(CUSTOM, block=block)


WRONG = {  # a spec that misplaces something -> what the refusal must say
    "MLP norm read at the attention's norm": (
        misplaced(mlp_norm_output=output("norm1")), r"'mlp_norm_output' is not what the MLP is called with"),
    "attention output read after the MLP's norm": (
        misplaced(attention_output=output("norm2")), r"the identity fails .*'self_attn.attention_output'"),
    "MLP output read at its hidden layer": (
        misplaced(mlp_output=output("ffn.up")), r"'mlp.mlp_output' has shape \[1, 5, 64\], expected \[1, 5, 32\]"),
    "attention at a path with no module": (
        dataclasses.replace(CUSTOM, attention="self_attn"),
        r"the attention 'model.layers.0.self_attn' is not a module .*model.layers.0.attn"),
    "blocks at a path with no module": (
        dataclasses.replace(CUSTOM, layers="model.blocks"), r"layers 'model.blocks' is not a module .*model.layers"),
}


@pytest.mark.parametrize("case", WRONG)
def test_a_spec_that_misplaces_a_value_is_refused_and_nothing_is_registered(case):
    family, message = WRONG[case]
    with pytest.raises(ValidationError, match=rf"(?s)Custom spec was not registered.*{message}"):
        register_family(family, architecture=CustomForCausalLM)
    assert CustomConfig.model_type not in BY_MODEL_TYPE


def test_taken_types_and_foreign_configs_are_refused_with_what_to_do():
    llama = BY_MODEL_TYPE["llama"]
    with pytest.raises(RegistrationError, match=r"Already served: 'llama' \(by Llama\).*replace=True"):
        register_family(dataclasses.replace(CUSTOM, model_types=("llama",)))
    with pytest.raises(ValidationError):  # replacing is proven too: Custom's paths are not Llama's modules
        register_family(dataclasses.replace(CUSTOM, model_types=("llama",)), llama.tiny_config(), replace=True)
    assert BY_MODEL_TYPE["llama"] is llama
    with pytest.raises(RegistrationError, match="model_type is 'llama', which the Custom spec does not list"):
        register_family(CUSTOM, llama.tiny_config())
    with pytest.raises(RegistrationError, match="pass the class to build"):
        register_family(CUSTOM)  # transformers maps no class to CustomConfig
    with pytest.raises(RegistrationError, match="takes a nnterp.families.Family"):
        register_family({"name": "Custom"})


def test_replacing_a_built_in_family_and_undoing_it():
    llama = BY_MODEL_TYPE["llama"]
    mine = register_family(dataclasses.replace(llama, name="My Llama"), replace=True)
    try:
        assert family_of(llama.tiny_config()) is mine
    finally:
        for model_type in mine.model_types:  # every type it took (Llama's own and those with Llama's blocks)
            unregister_family(model_type)
    assert BY_MODEL_TYPE["llama"] is llama and BY_MODEL_TYPE["arcee"] is llama
