"""Blocks of another topology (two MLP modules summed, a per-layer temporal block, Mamba and attention side by side,
an attention bias added in the residual add) against plain hooks.

Ground truth: module boundaries written from transformers' decoder-layer code, captured with forward hooks on the
unwrapped model; a contribution no module returns (a sum, a product by a multiplier) is the block's own arithmetic on
the hooked tensors. Which block has which token mixer is read from the HF model's modules.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GraniteMoeSWAConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof.miniature import miniature_config

from ..conftest import build_tiny, perturb, tiny_tokenizer
from ..families.test_families import IDS, hook_capture, hooks_and_reads, read_all, register_edit, run_with_hook

# -- where each value is, by the block's code ---------------------------------------------------
# truth(block) -> {name: (module path, "in" | "out") | None}; names outside the catalog are hooked tensors the block's
# arithmetic needs (derived below)


def granite_shared_truth(block):
    """Granite-MoE-shared: the block adds its sublayers' outputs times its residual multiplier; mlp_output =
    (block_sparse_moe(h) + shared_mlp(h)) * r, summed in the block (no module returns it)."""
    r = "residual_multiplier"
    return {
        "layer_input": ("", "in"), "attention_norm_output": ("input_layernorm", "out"),
        "attention_premix": ("self_attn.o_proj", "in"), "attention_output": ("self_attn", "out", r),
        "mixer_output": ("self_attn", "out", r), "layer_mid": ("post_attention_layernorm", "in"),
        "mlp_norm_output": ("post_attention_layernorm", "out"), "mlp_input": ("block_sparse_moe", "in"),
        "mlp_activation": None, "mlp_neurons": None, "layer_output": ("", "out"),
        "moe": ("block_sparse_moe", "out"), "shared": ("shared_mlp", "out"), "shared_input": ("shared_mlp", "in"),
    }


def granite_shared_derived(got, block):
    assert torch.equal(got["shared_input"], got["mlp_input"])  # both modules are called with the norm's output
    return {"mlp_output": (got["moe"] + got["shared"]) * block.residual_multiplier}


def griffin_truth(block):
    """RecurrentGemma: the temporal block is local attention (it has o_proj) or an RG-LRU recurrent block."""
    attention = hasattr(block.temporal_block, "o_proj")
    return {
        "layer_input": ("", "in"), "attention_norm_output": ("temporal_pre_norm", "out"),
        "attention_premix": ("temporal_block.o_proj", "in") if attention else None,
        "attention_output": ("temporal_block", "out") if attention else None,
        "mixer_output": ("temporal_block", "out"), "layer_mid": ("channel_pre_norm", "in"),
        "mlp_norm_output": ("channel_pre_norm", "out"), "mlp_input": ("mlp_block", "in"),
        "mlp_activation": ("mlp_block.act_fn", "out"), "mlp_neurons": ("mlp_block.down_proj", "in"),
        "mlp_output": ("mlp_block", "out"), "layer_output": ("", "out"),
    }


def falcon_h1_truth(block):
    """Falcon-H1: mamba(h) * ssm_out_multiplier + self_attn(h * attention_in_multiplier) * attention_out_multiplier."""
    return {
        "layer_input": ("", "in"), "attention_norm_output": ("input_layernorm", "out"),
        "attention_premix": ("self_attn.o_proj", "in"), "layer_mid": ("pre_ff_layernorm", "in"),
        "mlp_norm_output": ("pre_ff_layernorm", "out"), "mlp_input": ("feed_forward", "in"),
        "mlp_activation": ("feed_forward.act_fn", "out"), "mlp_neurons": ("feed_forward.down_proj", "in"),
        "mlp_output": ("feed_forward", "out"), "layer_output": ("", "out"),
        "mamba": ("mamba", "out"), "attention": ("self_attn", "out"), "attention_input": ("self_attn", "in"),
    }


def falcon_h1_derived(got, block):
    assert torch.equal(got["attention_input"], got["attention_norm_output"] * block.attention_in_multiplier)
    attention = got["attention"] * block.attn_out_multiplier
    return {"attention_output": attention, "mixer_output": got["mamba"] * block.ssm_out_multiplier + attention}


def neox_japanese_truth(block):
    """GPT-NeoX-Japanese: the last block's attention returns its output projection's bias apart (element 2), added to
    its output (element 0) inside the block's residual add."""
    values = {
        "layer_input": ("", "in"), "attention_norm_output": ("input_layernorm", "out"),
        "attention_premix": ("attention.dense", "in"), "layer_mid": ("post_attention_layernorm", "in"),
        "mlp_norm_output": ("post_attention_layernorm", "out"), "mlp_input": ("mlp", "in"),
        "mlp_activation": ("mlp.act", "out"), "mlp_neurons": ("mlp.dense_4h_to_h", "in"), "mlp_output": ("mlp", "out"),
        "layer_output": ("", "out"), "attention": ("attention", "out"),
    }
    return {**values, "bias": ("attention", "out2")} if block.attention.dense_bias is not None else values


def neox_japanese_derived(got, block):
    attention = got["attention"] + got["bias"].expand_as(got["attention"]) if "bias" in got else got["attention"]
    return {"attention_output": attention, "mixer_output": attention}


def granite_swa_config():
    config = BY_MODEL_TYPE["granitemoeshared"].tiny_config().to_dict()
    keep = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                   "vocab_size", "max_position_embeddings", "embedding_multiplier", "residual_multiplier",
                                   "attention_multiplier", "logits_scaling", "num_local_experts", "num_experts_per_tok",
                                   "shared_intermediate_size")}
    return GraniteMoeSWAConfig(**keep, num_hidden_layers=3, sliding_window=3,
                               layer_types=["full_attention", "sliding_attention", "sliding_attention"])


def tiny(model_type):
    return lambda: BY_MODEL_TYPE[model_type].tiny_config()


scaled = (lambda x, a, b: x + a, lambda mid, m, b: mid + m)  # the contributions are the products the block adds
# case -> (config, truth, derived values, the stream after the mixer's add, the block's output: both in the code's order)
CASES = {
    "granitemoeshared": (tiny("granitemoeshared"), granite_shared_truth, granite_shared_derived, *scaled),
    "granitemoe_swa": (granite_swa_config, granite_shared_truth, granite_shared_derived, *scaled),
    "recurrent_gemma": (tiny("recurrent_gemma"), griffin_truth, lambda got, block: {},
                        lambda x, a, b: a + x, lambda mid, m, b: m + mid),
    "falcon_h1": (tiny("falcon_h1"), falcon_h1_truth, falcon_h1_derived,
                  lambda x, a, b: x + a, lambda mid, m, b: mid + m),
    "gpt_neox_japanese": (tiny("gpt_neox_japanese"), neox_japanese_truth, neox_japanese_derived,
                          lambda x, a, b: x + a, lambda mid, m, b: mid + m),
}


def make(case, dtype=torch.float32):
    config, of, derived, first_add, second_add = CASES[case]
    hf = build_tiny(config(), dtype)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())  # proven on a miniature at load
    blocks = hf.base_model_blocks = model.layers._module
    return model, hf, lambda i: of(blocks[i]), derived, (first_add, second_add)


def expected_values(hf, at, derived, ids=IDS):
    """{(layer, value): tensor} by hooks and the blocks' arithmetic, and the logits."""
    captured, logits = hook_capture(hf, at, ids)
    for i, block in enumerate(hf.base_model_blocks):
        got = {name: captured[(i, name)] for name in at(i) if (i, name) in captured}
        captured.update({(i, name): value for name, value in derived(got, block).items()})
    return captured, logits


def catalog_names(at, i):
    from nnterp.spec.catalog import BY_NAME

    return {name: where for name, where in at(i).items() if name in BY_NAME}


def is_attention(hf, i):
    block = hf.base_model_blocks[i]
    return hasattr(getattr(block, "temporal_block", block), "o_proj") or any(
        hasattr(block, name) for name in ("self_attn", "attention"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_values_equal_hooks_and_identity_holds_on_every_block(case, dtype):
    model, hf, at, derived, (first_add, second_add) = make(case, dtype)
    expected, expected_logits = expected_values(hf, at, derived)
    saved, logits = read_all(model, IDS)
    assert torch.equal(logits, expected_logits)
    for i in range(model.num_layers):
        values = catalog_names(at, i)
        for name in {*values, "attention_output", "mixer_output", "mlp_output"}:
            if values.get(name, name) is None or (i, name) not in expected:
                assert (i, name) not in saved, f"layer {i}: {name} should be unavailable"
                continue
            got, want = saved[(i, name)], expected[(i, name)]
            assert torch.equal(got, want.reshape(got.shape)), f"layer {i} {name}"
        x, a, mid, m, y = (saved[(i, n)] for n in ("layer_input", "mixer_output", "layer_mid", "mlp_output",
                                                    "layer_output"))
        block = hf.base_model_blocks[i]
        assert torch.equal(mid, first_add(x, a, block)) and torch.equal(second_add(mid, m, block), y), f"layer {i}"
        if i + 1 < model.num_layers:
            assert torch.equal(y, expected[(i + 1, "layer_input")])
    results = check_identity(model, IDS)
    assert all(result.exact for result in results), [str(r) for r in results]
    # the readout of the last block's output is the model's logits (softcapping, multipliers and scaling included)
    with torch.no_grad(), model.trace(IDS):
        readout = model.project_on_vocab(model.layers[-1].layer_output).save()
    assert torch.equal(readout, expected_logits)


@pytest.mark.parametrize("case", CASES)
def test_order_and_availability_per_block_type(case):
    model, hf, at, derived, _ = make(case)
    kinds = {is_attention(hf, i) for i in range(model.num_layers)}
    if case == "recurrent_gemma":
        assert kinds == {True, False}  # the test config has both temporal blocks
    for i in range(model.num_layers):
        order, table = model.order(i, aliases=True), model.availability(i)
        names = {key.rpartition(".")[2] for key in order}
        by_math = {name for name in ("attention_output", "mixer_output", "mlp_output") if name not in at(i)}
        assert names == {name for name, where in catalog_names(at, i).items() if where is not None} | by_math
        assert list(order.values()) == sorted(order.values())
        assert order["attention_norm_output"] < order["mixer_output"] < order["layer_mid"]
        if not is_attention(hf, i):
            for key in ("self_attn.attention_output", "self_attn.attention_premix", "self_attn.queries"):
                assert table[key].reason == (f"block {i} mixes tokens with an RG-LRU recurrent block, not attention: "
                                             "its contribution is mixer_output")
            assert not hasattr(model.layers[i], "self_attn")
            with pytest.raises(ValueUnavailable, match=f"block {i} mixes tokens with an RG-LRU"):
                with model.trace(IDS):
                    model.layers[i].self_attn.attention_output.save()
            continue
        if case == "falcon_h1":  # the attention's scaled output, then the sum of both mixers: two places
            assert order["self_attn.attention_premix"] < order["self_attn.attention_output"] < order["mixer_output"]
        else:
            assert order["mixer_output"] == order["self_attn.attention_output"]
    if case.startswith("granite"):
        for key in ("mlp.mlp_activation", "mlp.mlp_neurons"):
            assert "routed mixture of experts" in model.availability(0)[key].reason


def zero_last(t):
    t = t.clone()
    t[:, -1] = 0
    return t


@pytest.mark.parametrize("case", CASES)
def test_edits_reach_the_logits_as_hooks_do(case):
    """mixer_output zeroed at the last position in place, mlp_output halved by an assignment, on one block."""
    model, hf, at, *_ = make(case)
    block = next(i for i in range(model.num_layers) if not is_attention(hf, i)) if case == "recurrent_gemma" else 1
    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(IDS):
        model.layers[block].mixer_output[:, -1] = 0
        model.layers[block].mlp.mlp_output = model.layers[block].mlp.mlp_output * 0.5
        edited = model.logits.save()
    # the same edits by hooks: a sum is zeroed by zeroing its terms, halved by halving them (a power of two: exact)
    modules = hf.base_model_blocks[block]
    zeroed = {"falcon_h1": ["mamba", "self_attn"], "recurrent_gemma": ["temporal_block"],
              "gpt_neox_japanese": ["attention"]}.get(case, ["self_attn"])
    halved = {"falcon_h1": ["feed_forward"], "recurrent_gemma": ["mlp_block"],
              "gpt_neox_japanese": ["mlp"]}.get(case, ["block_sparse_moe", "shared_mlp"])
    handles = [register_edit(hf, modules.get_submodule(path), "out", zero_last) for path in zeroed]
    handles += [register_edit(hf, modules.get_submodule(path), "out", lambda t: t * 0.5) for path in halved[1:]]
    try:
        expected = run_with_hook(hf, modules.get_submodule(halved[0]), "out", lambda t: t * 0.5)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(edited, expected) and not torch.equal(edited, clean)
    # an assignment of the attention's contribution is the attention's output assigned (Falcon-H1: before its
    # multiplier, a power of two again)
    attention = next(i for i in range(model.num_layers) if is_attention(hf, i))
    with torch.no_grad(), model.trace(IDS):
        model.layers[attention].self_attn.attention_output = model.layers[attention].self_attn.attention_output * 2
        doubled = model.logits.save()
    path = {"recurrent_gemma": "temporal_block", "gpt_neox_japanese": "attention"}.get(case, "self_attn")
    want = run_with_hook(hf, hf.base_model_blocks[attention].get_submodule(path), "out", lambda t: t * 2)
    assert torch.equal(doubled, want) and not torch.equal(doubled, clean)


def test_neox_japanese_edits_of_the_attention_with_its_bias_reach_the_logits_as_hooks_do():
    """The last block's attention_output is the projection's output plus the bias: a hook edits both terms."""
    model, hf, *_ = make("gpt_neox_japanese")
    last = model.num_layers - 1
    attention = hf.base_model_blocks[last].attention
    with torch.no_grad(), model.trace(IDS):
        model.layers[last].self_attn.attention_output[:, -1] = 0
        zeroed = model.logits.save()
    with torch.no_grad(), model.trace(IDS):
        model.layers[last].self_attn.attention_output = model.layers[last].self_attn.attention_output * 2
        doubled = model.logits.save()

    def logits_with(edit):
        handle = attention.register_forward_hook(lambda m, args, out: edit(*out))
        try:
            with torch.no_grad():
                return hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
        finally:
            handle.remove()

    def cancel_last(out, weights, bias):  # (-bias) + bias is 0 exactly
        out = out.clone()
        out[:, -1] = -bias
        return out, weights, bias

    assert torch.equal(zeroed, logits_with(cancel_last))
    assert torch.equal(doubled, logits_with(lambda out, weights, bias: (out * 2, weights, bias * 2)))
    assert not torch.equal(zeroed, doubled)


def test_falcon_h1_skipping_a_block_against_hooks():
    """Its blocks return (hidden,) and the model reads [0]: a skipped block hands on the stream in a tuple."""
    from nnterp import skip_layers

    model, hf, *_ = make("falcon_h1")
    with torch.no_grad(), model.trace(IDS):
        skip_layers(model, 1)
        logits = model.logits.save()
    handle = hf.base_model_blocks[1].register_forward_hook(lambda m, args, out: (args[0],))
    try:
        with torch.no_grad():
            expected = hf(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
    finally:
        handle.remove()
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("case", ["granitemoeshared", "recurrent_gemma", "falcon_h1"])
def test_attention_values_are_proven_on_the_attention_blocks(case):
    """The eager attention's internals compose to attention_premix on the blocks that have attention."""
    model, hf, *_ = make(case)
    model.enable_attention_values()  # proven on the miniature, the premix check included
    block = next(i for i in range(model.num_layers) if is_attention(hf, i))
    with torch.no_grad(), model.trace(IDS):
        queries = model.layers[block].self_attn.queries.save()
        probabilities = model.layers[block].self_attn.attention_probabilities.save()
    assert queries.shape[:3] == (*IDS.shape, model.num_heads)
    assert torch.allclose(probabilities.sum(-1), torch.ones(()))
    for i in range(model.num_layers):  # they stay unavailable on the blocks without attention
        if not is_attention(hf, i):
            assert "RG-LRU" in model.availability(i)["self_attn.queries"].reason
            with pytest.raises(ValueUnavailable, match="RG-LRU"):
                with model.trace(IDS):
                    model.layers[i].self_attn.queries.save()


@pytest.mark.parametrize("case, reason", [("granitemoe_swa", "sink factor"), ("gpt_neox_japanese", "its own code")])
def test_attention_internals_unavailable_with_the_reason(case, reason):
    model, *_ = make(case)
    with pytest.raises(ValueUnavailable, match=reason):
        model.enable_attention_values()
    assert reason in model.availability(0)["self_attn.attention_probabilities"].reason


def test_granite_shared_without_a_shared_mlp_reads_the_mixture():
    """shared_intermediate_size=0 (the default): the MLP contribution is the mixture's output alone."""
    config = BY_MODEL_TYPE["granitemoeshared"].tiny_config()
    config.shared_intermediate_size = 0
    hf = build_tiny(config)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    hf.base_model_blocks = model.layers._module
    assert hf.base_model_blocks[0].shared_mlp is None
    at = lambda i: {**{k: v for k, v in granite_shared_truth(None).items() if k not in ("shared", "shared_input", "moe")},  # noqa: E731
                    "mlp_output": ("block_sparse_moe", "out", "residual_multiplier")}
    expected, saved, logits = hooks_and_reads(model, hf, at, IDS)
    for i in range(model.num_layers):
        for name, where in at(i).items():
            if where is None:
                assert (i, name) not in saved
                continue
            assert torch.equal(saved[(i, name)], expected[(i, name)].reshape(saved[(i, name)].shape)), f"{i} {name}"
    assert all(result.exact for result in check_identity(model, IDS))


# the type's default config, made to show what it hides: residual scalars at 1 moved off it, both block kinds present
DEFAULTS = {
    "granitemoeshared": [dict(num_hidden_layers=3, residual_multiplier=0.22, embedding_multiplier=12.0,
                              logits_scaling=8.0, attention_multiplier=0.0625),
                         dict(num_hidden_layers=3, residual_multiplier=0.22, shared_intermediate_size=1024)],
    "granitemoe_swa": [dict(num_hidden_layers=4, residual_multiplier=0.22, shared_intermediate_size=1024)],
    "recurrent_gemma": [dict(num_hidden_layers=3)],
    "falcon_h1": [dict(num_hidden_layers=3, embedding_multiplier=3.0, lm_head_multiplier=0.375,
                       attention_in_multiplier=0.7, attention_out_multiplier=0.3, ssm_out_multiplier=0.6,
                       ssm_in_multiplier=1.3, mlp_multipliers=[1.25, 0.55])],
    "gpt_neox_japanese": [dict(num_hidden_layers=3)],
}


@pytest.mark.parametrize("model_type, changes", [(t, c) for t, cs in DEFAULTS.items() for c in cs],
                         ids=[f"{t}-{n}" for t, cs in DEFAULTS.items() for n in range(len(cs))])
def test_the_default_config_miniature_is_proven(model_type, changes):
    config = CONFIG_MAPPING[model_type](**changes)
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(miniature_config(config))).eval()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))  # proven at load
    assert model.family is BY_MODEL_TYPE[model_type]
    if model_type == "recurrent_gemma":  # its default blocks: two recurrent, then local attention
        assert len({repr(model.order(i)) for i in range(model.num_layers)}) == 2
    results = check_identity(model, IDS)
    assert all(result.exact for result in results), [str(r) for r in results]
