"""A spec inferred from the module tree: where it places each value, against the survey's tables and hooks."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, MambaConfig

from nnterp import StandardizedTransformer, UnknownArchitecture, infer_family, register_family, unregister_family
from nnterp.families import BY_MODEL_TYPE
from nnterp.spec.locations import At, Unavailable

from ..conftest import perturb, tiny_tokenizer
from ..custom_decoder import CustomConfig, CustomForCausalLM
from ..families.test_families import CASES, IDS, hook_capture, read_all
from ..unit.test_registry import TRUTH


def placed(block, name):
    location = block.resolve(name)
    if isinstance(location, Unavailable):
        return None
    assert isinstance(location, At)
    return (location.path, "in" if location.side == "input" else "out")


@pytest.mark.parametrize("case", ["llama", "gpt2", "glm4", "olmo2", "gptj", "starcoder2", "mixtral"])
def test_the_inferred_spec_places_each_value_where_the_survey_does(case):
    config_factory, truth, *_ = CASES[case]
    truth = truth if isinstance(truth, dict) else truth(0)
    family = infer_family(config_factory())
    block = family.block(config_factory(), 0)
    for name, where in truth.items():
        assert placed(block, name) == where, name  # None: unavailable on both
    assert family.layers == BY_MODEL_TYPE[config_factory().model_type].layers


def test_an_inferred_spec_of_a_custom_decoder_serves_the_hooks_values():
    family = infer_family(CustomConfig(), CustomForCausalLM)
    register_family(family, architecture=CustomForCausalLM)
    try:
        torch.manual_seed(0)
        hf = perturb(CustomForCausalLM(CustomConfig())).eval()
        model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
        hf.base_model_blocks = hf.model.layers
        expected, expected_logits = hook_capture(hf, lambda i: TRUTH, IDS)
        saved, logits = read_all(model, IDS)
    finally:
        unregister_family(CustomConfig.model_type)
    assert torch.equal(logits, expected_logits)
    assert all(torch.equal(saved[key], want.reshape(saved[key].shape)) for key, want in expected.items())
    assert len(expected) == len(TRUTH) * model.num_layers


@pytest.mark.parametrize("config, message", [
    (BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=128,
                is_decoder=True), r"could not locate .*one final norm among bert.encoder's children"),
    (MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=128, state_size=4),
     r"could not locate an attention module in MambaBlock \(its children: norm \(MambaRMSNorm\), mixer"),
])
def test_what_cannot_be_located_is_named(config, message):
    with pytest.raises(UnknownArchitecture, match=message):
        infer_family(config)


def test_names_that_fit_but_a_block_that_does_not_are_refused_with_the_proof_failure():
    """Granite scales each contribution before the add: the plain pre-norm candidate places every module right, but
    its identity does not hold, so no spec is returned."""
    with pytest.raises(UnknownArchitecture, match=r"(?s)no block shape holds.*sequential pre-norm: layer 0: the identity"):
        infer_family(BY_MODEL_TYPE["granite"].tiny_config())
