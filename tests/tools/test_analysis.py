"""TransformerLens's analyses over a cache (``nnterp.analysis``), against plain PyTorch hooks on the unwrapped HF model.

Ground truth is the family matrix's (tests/families/test_families.py): the hooked block inputs and contributions, each
family's own order of addition (its formula), what the hooked head reads and the plain forward's logits, the
heads' slices of the hooked output projection's input through the projection's own weight. The decomposition
must add up to the hooked stream bit for bit (float32 and bfloat16: the identities are exact in both), the
frozen norms and the attributions within rounding of the dtype.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from nnterp import StandardizedTransformer
from nnterp.analysis import AnalysisUnavailable
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import IDS, hook_capture, make

# sequential, parallel in each order of addition, residual adds inside the modules (BLOOM, MPT), a flattened
# MLP (OPT), GQA and MQA, biased projections and norms, Gemma's 1 + weight, OLMo's parameter-free norm, Granite's
# scaled contributions, norms after the sublayers (Gemma-2), a routed MLP (Mixtral), scaled logits (Cohere)
CASES = ["gpt2", "gpt_bigcode", "gptj", "gpt_neox_parallel", "gpt_neox_sequential", "bloom", "mpt",
         "falcon_7b_parallel", "falcon_40b_two_norms", "opt", "phi", "llama", "qwen2", "gemma", "olmo", "gemma2",
         "granite", "mixtral", "cohere", "phi3"]
MATRIX = [(case, torch.float32) for case in CASES] + [("llama", torch.bfloat16), ("gpt2", torch.bfloat16)]
# Granite's block adds its projections' outputs times residual_multiplier: its contributions (the hooks' truth
# too) are those products, and a head's or neuron's row is its projection's share times it
FACTOR = {"granite": 0.22}
SOFTCAPPED = {"gemma2"}
NO_HEADS = {"gemma2"}  # the contributions are the outputs of norms after the sublayers
NO_NEURONS = {"gemma2", "mixtral"}


def close(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@functools.cache
def run(case: str, dtype: torch.dtype = torch.float32):
    """The wrapped model's cache of ``IDS``, and the plain model's hooks of the same pass (the head's input and
    output too)."""
    model, hf_model, truth, formula, _ = make(case, dtype)
    head = {}

    def hook(module, args, output):
        head.update(input=args[0].detach().clone(), output=output.detach().clone())

    handle = hf_model.get_output_embeddings().register_forward_hook(hook)
    try:
        hooked, logits = hook_capture(hf_model, truth, IDS)
    finally:
        handle.remove()
    _, cache = model.run_with_cache(IDS)
    return SimpleNamespace(model=model, hf=hf_model, truth=truth, formula=formula, hooked=hooked, logits=logits,
                           head=head, cache=cache, n=model.num_layers)


def hooked(r, layer: int, name: str) -> torch.Tensor:
    tensor = r.hooked[(layer, name)]
    return tensor.view(*IDS.shape, -1) if tensor.dim() == 2 else tensor  # OPT's flattened MLP tensors


def final_stream(r) -> torch.Tensor:
    return hooked(r, r.n - 1, "layer_output")


def linear_weight(module: nn.Module) -> torch.Tensor:
    """``[out, in]``: an nn.Linear's weight, or GPT-2's Conv1D's (stored ``[in, out]``)."""
    return module.weight if isinstance(module, nn.Linear) else module.weight.t()


@pytest.mark.parametrize("case, dtype", MATRIX, ids=str)
def test_accumulated_rows_are_the_hooked_block_inputs(case, dtype):
    r = run(case, dtype)
    rows, labels = r.cache.accumulated_resid(return_labels=True)
    assert labels == [f"{i}_pre" for i in range(r.n)] + ["final_post"]
    for i in range(r.n):
        assert torch.equal(rows[i], hooked(r, i, "layer_input")), f"layer {i}"
    assert torch.equal(rows[r.n], final_stream(r))
    if r.truth(1)["layer_mid"] is not None:
        rows, labels = r.cache.accumulated_resid(layer=2, incl_mid=True, return_labels=True)
        assert labels == ["0_pre", "0_mid", "1_pre", "1_mid", "2_pre"]
        assert torch.equal(rows[3], hooked(r, 1, "layer_mid"))
    # the logit lens: the last row through the final norm is what the head reads
    normed = r.cache.accumulated_resid(apply_ln=True, pos_slice=-1)
    torch.testing.assert_close(normed[-1], r.head["input"][:, -1].float(), **close(dtype))


@pytest.mark.parametrize("case, dtype", MATRIX, ids=str)
def test_decomposition_is_the_hooked_contributions_and_adds_up_to_the_stream(case, dtype):
    r = run(case, dtype)
    stack, labels = r.cache.decompose_resid(return_labels=True)
    assert labels == ["embed", *[f"{i}_{part}" for i in range(r.n) for part in ("attn_out", "mlp_out")]]
    assert torch.equal(stack[0], hooked(r, 0, "layer_input"))
    for i in range(r.n):
        a, m = hooked(r, i, "attention_output"), hooked(r, i, "mlp_output")
        assert torch.equal(stack[1 + 2 * i], a), f"layer {i} attention"
        assert torch.equal(stack[2 + 2 * i], m), f"layer {i} MLP"
    # added in the family's own order (the matrix's formula), the components are the hooked stream, bit for bit
    stream = stack[0]
    for i in range(r.n):
        stream = r.formula(stream, stack[1 + 2 * i], stack[2 + 2 * i], {})
    assert torch.equal(stream, final_stream(r))
    assert torch.equal(r.cache.recompose_resid(stack), final_stream(r))
    torch.testing.assert_close(stack.float().sum(0), final_stream(r).float(), **close(dtype))
    # the stream a block receives, and (sequential blocks) the one its MLP's norm reads
    part = r.cache.decompose_resid(layer=2)
    assert len(part) == 5 and torch.equal(r.cache.recompose_resid(part, layer=2), hooked(r, 2, "layer_input"))
    if r.truth(1)["layer_mid"] is not None:
        part, labels = r.cache.decompose_resid(layer=1, mlp_input=True, return_labels=True)
        assert labels == ["embed", "0_attn_out", "0_mlp_out", "1_attn_out"]
        assert torch.equal(r.cache.recompose_resid(part, layer=1, mlp_input=True), hooked(r, 1, "layer_mid"))
    assert r.cache.decompose_resid(mode="mlp", return_labels=True)[1] == ["embed"] + [f"{i}_mlp_out" for i in range(r.n)]
    attention = r.cache.decompose_resid(mode="attn", incl_embeds=False, pos_slice=-1)
    assert torch.equal(attention, stack[1::2, :, -1])


@pytest.mark.parametrize("case, dtype", [(c, d) for c, d in MATRIX if c not in SOFTCAPPED], ids=str)
def test_frozen_norms_and_logit_attributions_sum_to_what_the_model_computed(case, dtype):
    r = run(case, dtype)
    stack = r.cache.decompose_resid()
    ln_final = r.model.ln_final._module
    norm_bias = getattr(ln_final, "bias", None)
    norm_bias = 0 if norm_bias is None else norm_bias.detach().float()
    # through the final norm frozen at its scale of the pass, as many rows (TransformerLens's shape): what the head
    # reads less the norm's bias; with incl_bias, the bias is a row of its own
    normed = r.cache.apply_ln_to_stack(stack)
    assert normed.shape == stack.shape
    torch.testing.assert_close(normed.sum(0) + norm_bias, r.head["input"].float(), **close(dtype))
    normed, labels = r.cache.apply_ln_to_stack(stack, labels=[str(k) for k in range(len(stack))], incl_bias=True)
    has_bias = getattr(ln_final, "bias", None) is not None
    assert len(normed) == len(stack) + has_bias and labels[-1] == ("ln_final_bias" if has_bias else str(len(stack) - 1))
    torch.testing.assert_close(normed.sum(0), r.head["input"].float(), **close(dtype))
    # direct logit attribution sums to the plain forward's logits of the next tokens: with the biases' rows, or,
    # one value per row, plus the biases' term the docstring names (the norm's bias on the head's row, the head's
    # bias), both read off the unwrapped modules (times the logits' scale, Cohere's, fitted to the hooked logits)
    head = r.hf.get_output_embeddings()
    raw = r.head["output"].float()  # the head's output, before a scale of the logits
    scale = ((r.logits.float() * raw).sum() / (raw * raw).sum()).item()
    following = IDS.roll(-1, dims=1)
    logits = r.logits.float()
    expected = logits.gather(-1, following[..., None])[..., 0]
    attributions = r.cache.logit_attrs(stack, following, incl_bias=True)
    torch.testing.assert_close(attributions.sum(0), expected, **close(dtype))
    attributions = r.cache.logit_attrs(stack, following)
    assert attributions.shape == stack.shape[:-1]
    term = head.weight.detach().float()[following] @ (norm_bias if torch.is_tensor(norm_bias) else
                                                      torch.zeros(head.weight.shape[1]))
    term = term + (0 if head.bias is None else head.bias.detach().float()[following])
    torch.testing.assert_close(attributions.sum(0) + term * scale, expected, **close(dtype))
    torch.testing.assert_close(r.cache.logit_attrs(stack[:0], following, incl_bias=True).sum(0), term * scale,
                               **close(dtype))
    # a logit difference at the last position, as TransformerLens's users write it
    correct, wrong = IDS[:, 0], IDS[:, 1]
    difference = r.cache.logit_attrs(stack[:, :, -1], correct, incorrect_tokens=wrong, pos_slice=-1, incl_bias=True)
    rows = torch.arange(len(IDS))
    torch.testing.assert_close(difference.sum(0), logits[rows, -1, correct] - logits[rows, -1, wrong], **close(dtype))
    # a block's norms, frozen, on the decomposition of the stream each reads: as many rows, the bias left out
    for layer in (1, r.n - 1):
        block = r.hf.base_model_blocks[layer]
        part = r.cache.decompose_resid(layer=layer, apply_ln=True)
        assert len(part) == len(r.cache.decompose_resid(layer=layer))
        bias = getattr(block.get_submodule(r.truth(layer)["attention_norm_output"][0]), "bias", None)
        torch.testing.assert_close(part.sum(0) + (0 if bias is None else bias.float()),
                                   hooked(r, layer, "attention_norm_output").float(), **close(dtype))
        if r.truth(layer)["layer_mid"] is not None:
            part = r.cache.decompose_resid(layer=layer, mlp_input=True, apply_ln=True)
            bias = getattr(block.get_submodule(r.truth(layer)["mlp_norm_output"][0]), "bias", None)
            part = part.sum(0) + (0 if bias is None else bias.float())
            torch.testing.assert_close(part, hooked(r, layer, "mlp_norm_output").float(), **close(dtype))


@pytest.mark.parametrize("case", [c for c in CASES if c not in NO_HEADS])
def test_head_results_are_the_heads_slices_and_sum_to_the_hooked_attention_output(case):
    r = run(case)
    heads, labels = r.cache.stack_head_results(return_labels=True)
    count = r.model.num_heads
    factor = FACTOR.get(case, 1.0)  # a head's share as it reaches the stream
    assert labels == [f"L{i}H{h}" for i in range(r.n) for h in range(count)]
    rows = dict(zip(*r.cache.decompose_resid(return_labels=True)[::-1]))
    for i in range(r.n):
        projection = r.hf.base_model_blocks[i].get_submodule(r.truth(i)["attention_premix"][0])
        weight, bias = linear_weight(projection), projection.bias
        premix = hooked(r, i, "attention_premix")  # the projection's input, [batch, seq, heads * head_dim]
        for h in range(count):  # one head: the projection of its slice alone, without the bias
            alone = premix.view(*premix.shape[:-1], count, -1).clone()
            alone[..., [k for k in range(count) if k != h], :] = 0
            expected = torch.nn.functional.linear(alone.flatten(-2), weight) * factor
            torch.testing.assert_close(heads[i * count + h], expected, rtol=1e-5, atol=1e-6)
        total = heads[i * count:(i + 1) * count].sum(0) + (0 if bias is None else bias * factor)
        torch.testing.assert_close(total, hooked(r, i, "attention_output"), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(total, rows[f"{i}_attn_out"], rtol=1e-5, atol=1e-5)  # the layer's own row
    with_rest = r.cache.stack_head_results(incl_remainder=True)
    torch.testing.assert_close(with_rest.sum(0), final_stream(r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [c for c in CASES if c not in NO_NEURONS])
def test_neuron_results_sum_to_the_hooked_mlp_output(case):
    r = run(case)
    neurons, labels = r.cache.stack_neuron_results(None, return_labels=True)
    width = hooked(r, 0, "mlp_neurons").shape[-1]
    factor = FACTOR.get(case, 1.0)
    assert labels == [f"L{i}N{n}" for i in range(r.n) for n in range(width)]
    rows = dict(zip(*r.cache.decompose_resid(return_labels=True)[::-1]))
    for i in range(r.n):
        projection = r.hf.base_model_blocks[i].get_submodule(r.truth(i)["mlp_neurons"][0])
        weight, bias = linear_weight(projection), projection.bias
        activations = hooked(r, i, "mlp_neurons")
        torch.testing.assert_close(neurons[i * width + 3], activations[..., 3, None] * weight[:, 3] * factor)
        total = neurons[i * width:(i + 1) * width].sum(0) + (0 if bias is None else bias * factor)
        torch.testing.assert_close(total, hooked(r, i, "mlp_output"), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(total, rows[f"{i}_mlp_out"], rtol=1e-5, atol=1e-5)
    some, labels = r.cache.stack_neuron_results(2, neuron_slice=[0, 5], pos_slice=-1, return_labels=True)
    assert labels == ["L0N0", "L0N5", "L1N0", "L1N5"] and some.shape == (4, len(IDS), r.model.hidden_size)
    assert torch.equal(some[3], neurons[width + 5][:, -1])


@pytest.mark.parametrize("case", ["llama", "gpt2", "gemma"])
def test_the_norm_scales_of_the_pass_are_the_norms_own(case):
    r = run(case)
    config = r.hf.config
    eps = getattr(config, "rms_norm_eps", None) or config.layer_norm_epsilon
    x = final_stream(r)
    centred = x - x.mean(-1, keepdim=True) if case == "gpt2" else x  # GPT-2's LayerNorm centres; the RMSNorms not
    expected = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    torch.testing.assert_close(r.cache["ln_final_scale"], expected, rtol=1e-5, atol=0)
    assert r.cache["attention_norm_scale"].shape == (r.n, *IDS.shape, 1)


def test_a_contribution_outside_the_standard_values_is_a_component():
    """Falcon-H1's Mamba half joins the attention's output inside the block, times ssm_out_multiplier: an identity
    extra, hooked at the Mamba module, and the stream adds up with it bit for bit."""
    hf_model = build_tiny(BY_MODEL_TYPE["falcon_h1"].tiny_config())
    model = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer())
    captured = {}
    handles = [block.mamba.register_forward_hook(
        lambda module, args, output, i=i: captured.setdefault(i, output[0] if isinstance(output, tuple) else output))
        for i, block in enumerate(hf_model.model.layers)]
    handles.append(hf_model.model.final_layernorm.register_forward_pre_hook(
        lambda module, args: captured.setdefault("final", args[0])))
    try:
        with torch.no_grad():
            hf_model(input_ids=IDS)
    finally:
        for handle in handles:
            handle.remove()
    _, cache = model.run_with_cache(IDS)
    stack, labels = cache.decompose_resid(return_labels=True)
    assert labels[:4] == ["embed", "0_mamba", "0_attn_out", "0_mlp_out"]
    assert torch.equal(stack[1], captured[0] * hf_model.config.ssm_out_multiplier)
    assert torch.equal(cache.recompose_resid(stack), captured["final"])


def test_a_softcapped_model_is_attributed_before_the_cap_only_when_asked():
    r = run("gemma2")
    stack = r.cache.decompose_resid()
    with pytest.raises(AnalysisUnavailable, match="Gemma-2.*softcaps its logits"):
        r.cache.logit_attrs(stack, IDS)
    before = r.cache.logit_attrs(stack, IDS, before_logits_transform=True)
    torch.testing.assert_close(before.sum(0), r.head["output"].gather(-1, IDS[..., None])[..., 0], rtol=1e-5, atol=1e-5)


REFUSED = {
    "a per-block scalar on the stream": ("gemma4_dense", lambda c: c.decompose_resid(),
                                         r"Gemma-4: block 0's identity, .* \* layer_scalar, .*scales a sum"),
    "a gate on the carried stream": ("doge", lambda c: c.decompose_resid(), r"Doge: block 0's identity, .*post_attention_residual"),
    "a norm after the attention": ("gemma2", lambda c: c.stack_head_results(),
                                   r"Gemma-2: block 0's attention_output is not its projection self_attn.o_proj's output"),
    "no norm before the attention": ("olmo2", lambda c: c.apply_ln_to_stack(c.decompose_resid(layer=1), layer=1),
                                     r"OLMo-2: block 1 has no attention norm to freeze \(no norm before the attention"),
    "no stream before a parallel MLP": ("gptj", lambda c: c.decompose_resid(layer=1, mlp_input=True),
                                        r"GPT-J: block 1 has no stream before its MLP's add: a parallel block"),
}


@pytest.mark.parametrize("why", REFUSED)
def test_what_would_not_be_exact_is_refused_with_the_reason(why):
    case, call, message = REFUSED[why]
    with pytest.raises(AnalysisUnavailable, match=message):
        call(run(case).cache)


def test_a_norm_that_does_not_read_the_stream_is_not_frozen():
    """Zamba's hybrid blocks norm the stream plus their shared transformer's output: no scale of layer_input."""
    hf_model = build_tiny(BY_MODEL_TYPE["zamba"].tiny_config())
    _, cache = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer()).run_with_cache(IDS)
    cache.apply_ln_to_stack(cache.decompose_resid(layer=0), layer=0)  # a Mamba block: its norm reads the stream
    with pytest.raises(AnalysisUnavailable, match="Zamba: 1_attention_norm .* is not, in this pass, block 1's "
                                                  "layer_input normed at one scale per position"):
        cache.apply_ln_to_stack(cache.decompose_resid(layer=1), layer=1)


def test_a_stream_changed_between_blocks_is_refused():
    _, cache = make("llama", torch.float32)[0].run_with_cache(IDS)
    cache["layer_input", 2][0, 0, 0] += 1  # as if the model changed the stream between blocks 1 and 2
    with pytest.raises(AnalysisUnavailable, match="the stream block 2 receives is not block 1's identity"):
        cache.decompose_resid()
