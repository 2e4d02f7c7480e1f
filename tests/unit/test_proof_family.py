"""A proof takes the family it proves: a candidate is proven without being put in the registry, and the validation
key follows what the proof reads of the spec, nothing else."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from transformers import AutoModelForCausalLM

from nnterp import StandardizedTransformer, UnknownArchitecture, proof
from nnterp.families import BY_MODEL_TYPE, family_of, output

from ..conftest import tiny_tokenizer
from ..custom_decoder import CustomConfig, CustomForCausalLM
from ..unit.test_registry import CUSTOM, custom_block


def _misplaced_mlp_norm(config, i):
    spec = custom_block(config, i)
    return dataclasses.replace(spec, values={**spec.values, "mlp_norm_output": output("norm1")})


def _served(config):
    try:
        return family_of(config)
    except UnknownArchitecture:
        return UnknownArchitecture


def test_a_candidate_is_proven_without_touching_the_registry():
    registry = dict(BY_MODEL_TYPE)
    seen = {}

    def wrap(model, **kwargs):
        seen["registry"] = dict(BY_MODEL_TYPE)
        seen["served"] = family_of(model.config)  # what the wrapper serves the miniature with
        other = threading.Thread(target=lambda: seen.setdefault("other thread", _served(model.config)))
        other.start()
        other.join()
        return StandardizedTransformer(model, **kwargs)

    problems, mini = proof.prove(CustomConfig(), CustomForCausalLM, tiny_tokenizer(), wrap, family=CUSTOM)
    assert problems == [] and mini.family is CUSTOM
    # served to this proof only: another thread, and anything after the proof, sees the registry
    assert seen["served"] is CUSTOM and seen["registry"] == registry and seen["other thread"] is UnknownArchitecture
    assert _served(CustomConfig()) is UnknownArchitecture
    assert dict(BY_MODEL_TYPE) == registry and CustomConfig.model_type not in BY_MODEL_TYPE


def test_the_proof_checks_the_family_it_is_given():
    broken = dataclasses.replace(CUSTOM, block=_misplaced_mlp_norm)
    problems, _ = proof.prove(CustomConfig(), CustomForCausalLM, tiny_tokenizer(), StandardizedTransformer,
                              family=broken)
    assert any("'mlp_norm_output' is not what the MLP is called with" in problem for problem in problems)
    # the built-in family of a type is proven by default, and a broken candidate for it leaves it served
    gpt2 = BY_MODEL_TYPE["gpt2"]
    config = gpt2.tiny_config()
    architecture = AutoModelForCausalLM._model_mapping[type(config)]
    moved = dataclasses.replace(gpt2, attention="mlp")  # the MLP where the attention is
    assert proof.prove(config, architecture, tiny_tokenizer(), StandardizedTransformer, family=moved)[0]
    assert proof.prove(config, architecture, tiny_tokenizer(), StandardizedTransformer)[0] == []
    assert BY_MODEL_TYPE["gpt2"] is gpt2


def test_a_family_that_does_not_list_the_configs_type_is_refused():
    with pytest.raises(ValueError, match="does not list the config's model_type 'gpt2'"):
        proof.prove(BY_MODEL_TYPE["gpt2"].tiny_config(), CustomForCausalLM, tiny_tokenizer(), StandardizedTransformer,
                    family=CUSTOM)


def test_the_key_follows_what_the_proof_reads_of_the_spec():
    gpt2 = BY_MODEL_TYPE["gpt2"]
    config = gpt2.tiny_config()
    architecture = AutoModelForCausalLM._model_mapping[type(config)]
    key = proof.validation_key(config, architecture)
    assert proof.validation_key(config, architecture, family=gpt2) == key
    # what no proof reads: the name, the types served, the readout after the last block
    unread = dataclasses.replace(gpt2, name="Mine", model_types=("gpt2", "mine"), logits_transform=lambda x, c: x)
    assert proof.validation_key(config, architecture, family=unread) == key
    # what it reads: the module paths, the blocks, the attention internals
    for read in (dataclasses.replace(gpt2, attention="mlp"), dataclasses.replace(gpt2, ln_final="transformer.h"),
                 dataclasses.replace(gpt2, block=lambda config, i: dataclasses.replace(
                     gpt2.block(config, i), identity=gpt2.block(config, i).identity.noted("(a note)"))),
                 dataclasses.replace(gpt2, attention_internals=lambda config: None)):
        assert proof.validation_key(config, architecture, family=read) != key
    assert proof.validation_key(config, architecture, True, gpt2) != key  # the attention values' proof
