"""StandardizedVLLM on two tensor-parallel workers (vLLM's CPU build, one core per rank) against transformers' plain
hooks: tests/vllm/check_parallel.py measures, in the vLLM venv; the assertions are here. Without that venv the tests
skip, saying why."""

from __future__ import annotations

import pytest

from .test_vllm import FLOAT32, MARKER, VENV, run_family

SCRIPT = __import__("pathlib").Path(__file__).with_name("check_parallel.py")
KERNEL = ("self_attn.queries", "self_attn.keys", "self_attn.values", "self_attn.attention_scores",
          "self_attn.attention_probabilities")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def measured(request):
    if not MARKER.exists():
        pytest.skip(f"no vLLM venv at {VENV} (bash tests/vllm/setup.sh makes it)")
    return run_family(request.param, SCRIPT)


def test_every_value_at_a_module_boundary_is_whole_and_the_hooks_value(measured):
    """The stream (all-reduced on each rank) and the pieces nnsight gathers at the parallel linear layers (the heads'
    output before the output projection, the MLP's neurons): each the full width and transformers' value."""
    assert len(measured["value_diffs"]) == 3 * len(measured["available"])
    assert {"attention_premix", "mlp_neurons", "layer_output"} <= set(measured["available"])
    for key, (shape, diff) in measured["value_diffs"].items():
        assert diff < FLOAT32 * 10, (key, diff)
        mine, theirs = measured["widths"][key]
        assert shape[-1] * (shape[-2] if "premix" in key else 1) == theirs[-1], (key, mine, theirs)
    assert measured["logits"] < 1e-4


def test_the_attention_kernels_inputs_are_refused_as_one_ranks_heads(measured):
    for key in KERNEL:
        assert "tensor parallelism" in measured["reasons"][key], measured["reasons"]
    assert measured["queries"] is not None and "ValueUnavailable" in measured["queries"]
    assert "one rank's heads" in measured["queries"]


def test_steered_generation_on_two_workers_is_the_hooked_loop(measured):
    assert measured["steered"] == measured["expected_steered"]
    assert measured["steered"] != measured["unsteered"], "the steering changes nothing, so it proves nothing"
