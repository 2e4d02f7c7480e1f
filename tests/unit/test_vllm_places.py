"""The vLLM placements (nnterp/vllm/places.py) against the family specs, without vLLM: each placed family is an
nnterp family, each value it places is one the family's transformers spec has (the same meaning exists), and each
value the spec has is placed on vLLM or says why not; the places are the core's locations (``At``), read through
the same views as the spec's (per head where the spec's is), but for the fused stream."""

from __future__ import annotations

import sys

import pytest

from nnterp.families import FAMILIES as SPECS
from nnterp.spec.catalog import ATTENTION_INTERNALS, CATALOG
from nnterp.spec.locations import At, Unavailable
from nnterp.spec.views import HeadsFirst, Times
from nnterp.vllm.backend import BACKEND_FAMILIES, CLASSES, REJECTED
from nnterp.vllm.places import FAMILIES, FUSED, KERNEL_VIEWS, FromKernel, FusedStream, family_for

BY_NAME = {spec.name: spec for spec in SPECS}
# the block's values (the attention internals are the attention's own: placed at vLLM's kernel, below)
NAMES = [value.name for value in CATALOG if value.owner in ("block", "self_attn", "mlp")
         and value.name not in ("mixer_output", *ATTENTION_INTERNALS)]


def test_importing_the_placements_imports_no_vllm():
    assert "vllm" not in sys.modules


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_placement_agrees_with_its_family_spec(name):
    placed = FAMILIES[name]
    spec = BY_NAME.get(name)
    assert spec is not None, f"{name} is placed on vLLM but is no nnterp family"
    assert family_for(spec.model_types[0]) is placed  # found from the spec's own model types
    assert placed.classes, f"{name} names no vLLM model class its places describe"
    config = spec.tiny_config()
    for key, value in placed.requires.items():  # the configs vLLM's code for the family computes
        setattr(config, key, value)
    text = config.get_text_config()
    blocks = [spec.block(text, i) for i in range(text.num_hidden_layers)]
    for value in NAMES:
        # the value where some block has it (a mixture's router is on its routed blocks only)
        location = next((block.resolve(value) for block in blocks
                         if not isinstance(block.resolve(value), Unavailable)), blocks[0].resolve(value))
        on_transformers = not isinstance(location, Unavailable)
        if value in placed.values:
            assert on_transformers, f"{name}: {value} placed on vLLM, but the family has no such value"
            place = placed.values[value]
            assert isinstance(place, (At, FusedStream)), f"{name}: {value} is placed as {place!r}, no core location"
            if isinstance(place, At) and isinstance(location, At):  # the value's layout is the spec's
                assert place.heads == location.heads, f"{name}: {value} per head on one engine only"
                assert not place.op, f"{name}: {value} at an operation: vLLM's blocks are read at module boundaries"
                # a product the block's code computes (Granite's contributions times its factor) on both engines
                assert [v for v in place.views if isinstance(v, Times)] == [
                    v for v in location.views if isinstance(v, Times)], (name, value)
        elif on_transformers:
            assert placed.unavailable.get(value), f"{name}: {value} neither placed on vLLM nor said unavailable"
    # the attention's internals at the kernel's inputs (vLLM's Attention(q, k, v)), the scores and probabilities
    # recomputed from them
    kernel = f"{placed.attention}.attn"
    order = KERNEL_VIEWS.get(name, ())  # Llama 4's halves, reordered by vLLM's loader, interleaved back
    assert [placed.values[v] for v in ("queries", "keys", "values")] == [
        At(kernel, "input", arg=0, heads=True, views=order), At(kernel, "input", arg=1, heads=True, views=order),
        At(kernel, "input", arg=2, heads=True)]
    assert all(placed.values[v] == FromKernel(kernel) for v in ("attention_scores", "attention_probabilities"))
    if placed.shape == FUSED:  # the stream is two tensors between blocks: read as their sum
        assert all(isinstance(placed.values[v], FusedStream) for v in ("layer_input", "layer_mid", "layer_output"))
    else:  # a plain block passes the stream as one tensor: no value is a sum
        assert not any(isinstance(place, FusedStream) for place in placed.values.values())


BACKEND_NAMES = sorted(BACKEND_FAMILIES)


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_a_transformers_backend_family_is_its_spec_at_the_same_modules(name):
    """vLLM's Transformers backend runs transformers' own modules: each value placed there is the spec's own location
    (read by the core's At), each the spec has is placed or says why not, the attention's internals are refused,
    and a gated MLP's activation (fused by vLLM's GLU fuser) too."""
    spec = BY_NAME[name]
    placed = family_for(spec.model_types[0])
    assert placed.batched and placed.shape == "plain" and placed.classes == CLASSES
    assert name not in FAMILIES  # vLLM has no model of its own for it
    assert placed.layers.startswith("model.") and placed.layers.rpartition(".")[2] == spec.layers.rpartition(".")[2]
    block = spec.block(spec.tiny_config().get_text_config(), 0)
    for value in NAMES:
        location = block.resolve(value)
        if value in placed.values:
            assert placed.values[value] == location, (value, placed.values[value], location)
            assert not location.op and not location.join
        elif value == "mlp_activation" and BACKEND_FAMILIES[name] and not isinstance(location, Unavailable):
            assert "act(gate) * up in one op" in placed.reason(value)
        elif value in ("mlp_pre_activation", "mlp_up_output") and BACKEND_FAMILIES[name] and not isinstance(
                location, Unavailable):
            assert "GLU fuser" in placed.reason(value)
        elif isinstance(location, At) and any(isinstance(view, HeadsFirst) for view in location.views):
            assert "whole step" in placed.reason(value)  # [1, heads, tokens, dim] for every request at once
        else:
            assert isinstance(location, Unavailable) or location.op, f"{name}: {value} dropped without a reason"
            assert placed.unavailable[value]
    for internal in ATTENTION_INTERNALS:
        assert internal not in placed.values and "attn.forward(q, k, v)" in placed.reason(internal)


def test_a_parallel_blocks_one_norm_is_read_before_its_attention():
    """Phi's one norm feeds both sublayers: mlp_norm_output (the same tensor) is read right after
    attention_norm_output, before the attention runs, the order a trace must read values in."""
    order = list(family_for("phi").values)
    assert order.index("mlp_norm_output") == order.index("attention_norm_output") + 1
    assert order.index("mlp_norm_output") < order.index("attention_premix")


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_a_family_vllm_runs_otherwise_is_refused_with_the_reason(name):
    with pytest.raises(NotImplementedError) as refused:
        family_for(BY_NAME[name].model_types[0])
    assert REJECTED[name] in str(refused.value) and "StandardizedTransformer" in str(refused.value)
