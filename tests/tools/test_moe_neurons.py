"""Per-expert neuron results of routed mixtures of experts (``stack_neuron_results``), against plain PyTorch hooks on
the unwrapped HF model and the model's own computation with one neuron's down-projection column zeroed.

Families: Mixtral (no shared expert), Qwen2-MoE (a sigmoid-gated shared expert, and a dense block among the routed
ones), DeepSeek-V3 (an ungated shared expert, a dense first block), GPT-OSS (biased, transposed experts with their
own clamped gate). The truth for a routed block: its rows, plus the experts' down-projection biases weighted by the
hooked router's weights, plus the hooked shared expert (gated as the model gates it), are the hooked MLP output.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from nnterp import StandardizedTransformer
from nnterp.analysis import AnalysisUnavailable
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer
from ..hooks import first_calls

IDS = torch.tensor([[5, 9, 17, 3, 44, 8, 21], [60, 12, 7, 99, 4, 31, 15]])
CASES = ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"]
MATRIX = [(case, dtype) for case in CASES for dtype in (torch.float32, torch.bfloat16)]


def far(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the largest magnitude."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def tolerance(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 3e-2


@functools.cache
def build(case: str, dtype=torch.float32):
    hf = build_tiny(BY_MODEL_TYPE[case].tiny_config(), dtype)
    return hf, StandardizedTransformer(hf, tokenizer=tiny_tokenizer())


def routed_layers(hf) -> list[int]:
    return [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]


def hooked_mlp(hf, layer: int) -> dict[str, torch.Tensor]:
    """A plain forward with hooks on block ``layer``'s MLP and its parts: the MLP's output ``[batch, seq, hidden]``,
    the router's weights and indices as the experts received them ``[tokens, k]``, and the shared expert's
    contribution as the model adds it (zero where there is none)."""
    mlp = hf.model.layers[layer].mlp
    parts = {name: getattr(mlp, name) for name in ("shared_expert", "shared_expert_gate", "shared_experts")
             if hasattr(mlp, name)}
    calls = first_calls(hf, {"mlp": mlp, "experts": mlp.experts, **parts}, IDS)
    (_, output), (args, _) = calls["mlp"], calls["experts"]
    got = {"mlp_output": output[0] if isinstance(output, tuple) else output, "indices": args[1], "weights": args[2],
           **{name: calls[name][1] for name in parts}}
    shape = got["mlp_output"].shape
    if "shared_expert" in got:  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x), on flattened tokens
        shared = torch.sigmoid(got["shared_expert_gate"].float()) * got["shared_expert"].float()
    elif "shared_experts" in got:  # DeepSeek-V3: added as it is
        shared = got["shared_experts"].float()
    else:
        shared = torch.zeros(shape)
    got["shared"] = shared.reshape(shape)
    return got


def rows_of(cache, layer: int, **kwargs):
    """Block ``layer``'s rows of ``stack_neuron_results`` and their labels."""
    stack, labels = cache.stack_neuron_results(layer + 1, return_labels=True, **kwargs)
    mine = [k for k, label in enumerate(labels) if label.startswith(f"L{layer}")]
    return stack[mine], [labels[k] for k in mine]


@pytest.mark.parametrize("case, dtype", MATRIX, ids=str)
def test_expert_neurons_with_biases_and_shared_expert_sum_to_the_hooked_mlp_output(case, dtype):
    hf, model = build(case, dtype)
    _, cache = model.run_with_cache(IDS)
    routed = routed_layers(hf)
    assert routed
    for layer in routed:
        truth = hooked_mlp(hf, layer)
        rows, labels = rows_of(cache, layer)
        experts = hf.model.layers[layer].mlp.experts
        count = experts.down_proj.shape[0]
        neurons = experts.down_proj.shape[2 if not experts.is_transposed else 1]
        assert labels == [f"L{layer}E{e}N{n}" for e in range(count) for n in range(neurons)]
        total = rows.sum(0) + truth["shared"]
        if getattr(experts, "down_proj_bias", None) is not None:  # each chosen expert's bias, weighted by the router
            bias = experts.down_proj_bias.float()[truth["indices"]] * truth["weights"].float()[..., None]
            total = total + bias.sum(1).view(total.shape)
        assert far(total, truth["mlp_output"]) <= tolerance(dtype), (layer, far(total, truth["mlp_output"]))


@pytest.mark.parametrize("case", CASES)
def test_an_expert_neuron_row_is_what_zeroing_its_down_column_removes(case):
    hf, model = build(case)
    _, cache = model.run_with_cache(IDS)
    layer = routed_layers(hf)[-1]
    experts = hf.model.layers[layer].mlp.experts
    truth = hooked_mlp(hf, layer)
    rows, labels = rows_of(cache, layer)
    hits = torch.bincount(truth["indices"].flatten(), minlength=experts.down_proj.shape[0])
    for expert in (int(hits.argmax()), int(hits.argmin())):
        label = next(label for label in labels if label.startswith(f"L{layer}E{expert}N3"))
        row = rows[labels.index(label)]
        routed = (truth["indices"] == expert).any(-1).view(IDS.shape)
        assert torch.all(row[~routed] == 0)  # tokens not routed to the expert: no contribution
        column = experts.down_proj.data[expert][3] if experts.is_transposed else experts.down_proj.data[expert][:, 3]
        saved = column.clone()
        column.zero_()
        try:
            ablated = hooked_mlp(hf, layer)["mlp_output"]
        finally:
            column.copy_(saved)
        torch.testing.assert_close(truth["mlp_output"] - ablated, row, rtol=1e-4, atol=1e-6)


def test_neuron_slice_numbers_neurons_expert_by_expert():
    hf, model = build("mixtral")
    _, cache = model.run_with_cache(IDS)
    full, labels = rows_of(cache, 0)
    neurons = hf.model.layers[0].mlp.experts.down_proj.shape[2]
    picked = [3, neurons + 5, 3 * neurons]  # expert 0's neuron 3, expert 1's neuron 5, expert 3's neuron 0
    rows, picked_labels = rows_of(cache, 0, neuron_slice=picked)
    assert picked_labels == ["L0E0N3", "L0E1N5", "L0E3N0"]
    assert torch.equal(rows, full[picked])


def test_dense_blocks_among_routed_ones_keep_their_plain_neurons():
    hf, model = build("qwen2_moe")
    _, cache = model.run_with_cache(IDS)
    dense = next(i for i in range(model.num_layers) if i not in routed_layers(hf))
    _, labels = rows_of(cache, dense)
    assert labels == [f"L{dense}N{n}" for n in range(hf.model.layers[dense].mlp.down_proj.in_features)]


def test_experts_whose_output_the_block_norms_are_refused_with_the_reason():
    """Gemma-4's routed experts' output passes post_feedforward_layernorm_2 and the block's norm after the MLP."""
    family = BY_MODEL_TYPE["gemma4_text"]
    config = family.tiny_config()
    config.enable_moe_block, config.num_experts, config.top_k_experts = True, 4, 2
    config.moe_intermediate_size = 32
    hf = build_tiny(config)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    _, cache = model.run_with_cache(IDS)
    assert cache["expert_weights", 0].shape == (*IDS.shape, 2)  # the router's choice is served all the same
    with pytest.raises(AnalysisUnavailable, match="is not what the module that calls its experts"):
        cache.stack_neuron_results(None)


def test_experts_of_another_form_are_refused_with_the_reason():
    """Llama 4's experts are not transformers' standard experts module (no declared layout, no router arguments)."""
    hf, model = build("llama4_text")
    _, cache = model.run_with_cache(IDS)
    layer = next(i for i, block in enumerate(hf.model.layers) if hasattr(block.feed_forward, "experts"))
    with pytest.raises(AnalysisUnavailable, match=re.escape("not transformers' standard experts module")):
        cache.stack_neuron_results(layer + 1)
