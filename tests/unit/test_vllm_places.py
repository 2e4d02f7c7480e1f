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
from nnterp.spec.views import Times
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
    block = spec.block(config, 0)
    for value in NAMES:
        location = block.resolve(value)
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
