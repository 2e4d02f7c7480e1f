"""A block's identity is declared once: the formula shown is written from the tree the proof recomputes with, the
arithmetic follows the tree's order, and the stream between the adds that the proof checks comes from the same tree."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from nnterp import StandardizedTransformer, proof
from nnterp.families import BY_MODEL_TYPE, FAMILIES, for_config, output
from nnterp.spec.catalog import IDENTITY_TERMS
from nnterp.spec.identity import SEQUENTIAL, A, Custom, M, Name, Plus, PostNorm, Scaled, Sum, X, addends

from ..conftest import tiny_tokenizer

# three float16 numbers whose sum depends on the order of the adds: 2048 + 1 rounds back to 2048
BIG, ONE = torch.tensor([2048.0], dtype=torch.float16), torch.tensor([1.0], dtype=torch.float16)
TERMS = {"layer_input": BIG, "attention_output": ONE, "mlp_output": ONE}


def test_a_sum_adds_in_the_order_of_its_tree_and_shows_that_order():
    assert SEQUENTIAL.formula == "layer_output = (layer_input + attention_output) + mlp_output"
    assert torch.equal(SEQUENTIAL.combine(TERMS, None), (BIG + ONE) + ONE) and SEQUENTIAL.combine(TERMS, None) == 2048
    other = Sum(X + (A + M))
    assert other.formula == "layer_output = layer_input + (attention_output + mlp_output)"
    assert other.combine(TERMS, None) == 2050  # the other association, another float16 result


def test_a_scaled_term_reads_its_factor_off_the_block_and_shows_its_name():
    block = torch.nn.Module()
    block.residual_multiplier = 0.5
    identity = Sum((X + A * "residual_multiplier") + M / 4.0)
    terms = {name: torch.full((2,), value) for name, value in
             (("layer_input", 1.0), ("attention_output", 2.0), ("mlp_output", 8.0))}
    assert identity.formula == "layer_output = (layer_input + attention_output * residual_multiplier) + mlp_output / 4.0"
    assert torch.equal(identity.combine(terms, block), torch.full((2,), 1.0 + 2.0 * 0.5 + 8.0 / 4.0))
    assert str("gate" * (X + A)) == "gate * (layer_input + attention_output)"
    with pytest.raises(ValueError, match="Scaled.how"):
        Scaled(X, 2.0, "value ** factor")


def test_layer_mid_is_the_stream_the_mlp_output_is_added_to():
    assert SEQUENTIAL.layer_mid() == X + A
    assert Sum(M + (A + X)).layer_mid() == A + X  # either side of the last add
    # Doge: the stream is scaled as the MLP's output is added, so the stream before the MLP is inside the scale
    assert Sum("post_attention_residual" * ("input_residual" * X + A) + M).layer_mid() == "input_residual" * X + A
    assert Sum((X + A * "r") + M * "r").layer_mid() == X + A * "r"  # Granite: the MLP's output scaled
    assert Sum((A + M) + X).layer_mid() is None  # a parallel block: no stream between the sublayers
    assert Sum(((X + A) + M) * "layer_scalar").layer_mid() is None  # the last step scales the sum
    assert PostNorm("ln_1", "ln_2").layer_mid() is None and Custom("layer_output = f(x)", lambda t, b: t).mid is None


def test_the_addends_of_a_tree_are_what_its_additions_add_in_its_order():
    assert addends(Sum((X + A * "r") + M / 4.0).tree) == [X, A * "r", M / 4.0]
    assert addends(Sum(M + (A + X)).tree) == [M, A, X]
    assert addends(((X + A) + M) * "layer_scalar") == [((X + A) + M) * "layer_scalar"]  # a scaled sum adds one thing


def test_renaming_changes_the_formula_and_the_arithmetic_together():
    mixer = SEQUENTIAL.renamed({"attention_output": "mixer_output"})
    assert mixer == Sum((X + Name("mixer_output")) + M)
    assert mixer.formula == "layer_output = (layer_input + mixer_output) + mlp_output"
    custom = Custom("layer_output = layer_input + attention_output", lambda t, _: t["layer_input"] + t["attention_output"])
    renamed = custom.renamed({"attention_output": "mixer_output"})
    assert renamed.formula == "layer_output = layer_input + mixer_output"
    assert torch.equal(renamed.combine({"layer_input": BIG, "mixer_output": ONE}, None), BIG + ONE)
    assert Sum(X + M, note="(a note)").noted("(and another)").formula == \
        "layer_output = layer_input + mlp_output (a note) (and another)"


def test_a_custom_formula_names_exactly_the_terms_its_code_reads():
    """A Custom declares the terms its code reads: the formula must name those, and the code is given those alone
    and must read each, so neither the formula nor the declaration drifts from the code unseen."""

    def code(t, _):
        return t["layer_input"] + t["attention_output"]

    faithful = Custom("layer_output = layer_input + attention_output", code,
                      reads=("layer_input", "attention_output"))
    assert faithful.drift(TERMS) == "" and torch.equal(faithful.combine(TERMS, None), BIG + ONE)
    # drifted: the formula names a value the code does not use, or omits one it does
    names_more = Custom("layer_output = (layer_input + attention_output) + mlp_output", code,
                        reads=("layer_input", "attention_output"))
    assert names_more.drift(TERMS) == "the formula names ['mlp_output'], which its code does not read"
    omits = Custom("layer_output = layer_input + mlp_output", code, reads=("layer_input", "attention_output"))
    assert omits.drift(TERMS) == ("the formula names ['mlp_output'], which its code does not read; "
                                  "the formula omits ['attention_output'], which its code reads")
    # drifted: the declaration says more or less than the code reads, which the recomputation refuses
    with pytest.raises(ValueError, match=r"declares \['mlp_output'\] in reads=, which its code does not read"):
        Custom("layer_output = (layer_input + attention_output) + mlp_output", code,
               reads=("layer_input", "attention_output", "mlp_output")).combine(TERMS, None)
    with pytest.raises(KeyError, match="reads 'attention_output', which its reads= does not declare"):
        Custom("layer_output = layer_input", code, reads=("layer_input",)).combine(TERMS, None)
    # renamed, the formula, the declaration and the terms the code is given change together
    mixer = faithful.renamed({"attention_output": "mixer_output"})
    assert mixer.reads == ("layer_input", "mixer_output") and mixer.drift({"layer_input", "mixer_output"}) == ""
    assert torch.equal(mixer.combine({"layer_input": BIG, "mixer_output": ONE}, None), BIG + ONE)


def test_every_custom_identity_of_a_family_names_the_terms_its_code_reads():
    """Over every family's blocks (each configuration its page documents): the terms a block gives its identity are
    the identity's values and its extra tensors, and a Custom's formula names exactly those its code reads."""
    checked = 0
    for family in FAMILIES:
        for _, changes in family.variants or (("test config", {}),):
            config = family.tiny_config()
            for key, value in changes.items():
                setattr(config, key, value)
            spec, text = for_config(family, config), config.get_text_config()
            for i in range(text.num_hidden_layers):
                block = spec.block(text, i)
                if isinstance(block.identity, Custom):
                    terms = {*IDENTITY_TERMS, *block.extra} - {"layer_output"}
                    assert block.identity.drift(terms) == "", f"{family.name} block {i}: {block.identity.drift(terms)}"
                    checked += 1
    assert checked > 0


def test_the_tree_is_data_that_compares_and_hashes():
    assert Sum((X + A) + M) == SEQUENTIAL and hash(Sum((X + A) + M)) == hash(SEQUENTIAL)
    assert Sum((A + X) + M) != SEQUENTIAL and isinstance(SEQUENTIAL.tree, Plus)
    assert repr(SEQUENTIAL) == repr(Sum((X + A) + M))  # no address in it


def test_every_spec_is_hashable_data_that_prints_the_same_in_another_process():
    for family in FAMILIES:
        config = family.tiny_config().get_text_config()
        blocks = [family.block(config, i) for i in range(config.num_hidden_layers)]
        assert hash(family) == hash(dataclasses.replace(family)) and len({*blocks}) >= 1
        assert " at 0x" not in repr(family) + repr(blocks), family.name
    with pytest.raises(TypeError, match="does not change"):
        blocks[0].values["layer_input"] = blocks[0].values["layer_output"]
    # MiniMax: a Custom identity, its code and mid functions, and a variant-free family with a config check
    code = ("from nnterp.families import BY_MODEL_TYPE as B; f = B['minimax']; c = f.tiny_config(); "
            "print(repr(f)); print(repr(f.block(c, 1)))")
    family = BY_MODEL_TYPE["minimax"]
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert printed == f"{family!r}\n{family.block(family.tiny_config(), 1)!r}\n"


@pytest.mark.parametrize("model_type", ["granite", "doge", "falcon_h1"])
def test_the_proof_checks_layer_mid_against_the_tree_where_the_terms_are_scaled(model_type):
    """Where the formula is a sum with scaled terms (which a formula string's first add did not say), a layer_mid
    placed at another tensor of its shape is caught."""
    family = BY_MODEL_TYPE[model_type]
    config = family.tiny_config()
    architecture = AutoModelForCausalLM._model_mapping[type(config)]

    def misplaced(config, i):
        block = family.block(config, i)
        return dataclasses.replace(block, values={**block.values, "layer_mid": output("input_layernorm")})

    problems, _ = proof.prove(config, architecture, tiny_tokenizer(), StandardizedTransformer, family=family)
    assert problems == []
    problems, _ = proof.prove(config, architecture, tiny_tokenizer(), StandardizedTransformer,
                              family=dataclasses.replace(family, block=misplaced))
    assert any("'layer_mid' is not" in problem and "the stream the identity adds the MLP's output to" in problem
               for problem in problems), problems
