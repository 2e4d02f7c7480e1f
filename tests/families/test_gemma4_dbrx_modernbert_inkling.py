"""Types served after the census (Gemma-4's other classes, DBRX, ModernBERT-decoder, Inkling) against plain hooks,
and the miniatures of default configs whose layers differ (per-layer configs, head lists, nested sub-configs).

Ground truth: module boundaries written from transformers' decoder-layer code, captured with forward hooks on the
unwrapped model; the identities are the blocks' own arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof.miniature import miniature_config

from ..conftest import build_tiny, perturb, tiny_tokenizer
from ..families.test_families import IDS, PRE_NORM, SANDWICH, hooks_and_reads, read_all, run_with_hook

GEMMA4_PLE = {**SANDWICH, "mlp_activation": None, "mlp_neurons": None, "P": ("post_per_layer_input_norm", "out")}
DBRX = {**PRE_NORM("norm_attn_norm.norm_1", "norm_attn_norm.attn", "norm_attn_norm.attn.out_proj",
                   "norm_attn_norm.norm_2", "ffn", None, None),
        "mlp_activation": None, "mlp_neurons": None,
        # what norm_attn_norm returns: (the stream after the attention's add, the normed stream)
        "R": ("norm_attn_norm", "out"), "N": ("norm_attn_norm", "out1")}
MODERNBERT = PRE_NORM("attn_norm", "attn", "attn.Wo", "mlp_norm", "mlp", "mlp.act", "mlp.Wo")
INKLING = {**PRE_NORM("input_layernorm", "attn_sconv", "self_attn.o_proj", "post_attention_layernorm", "mlp",
                      "mlp.act_fn", "mlp.down_proj"), "mlp_output": ("mlp_sconv", "out")}


LLAMA = PRE_NORM("input_layernorm", "self_attn", "self_attn.o_proj", "post_attention_layernorm", "mlp", "mlp.act_fn",
                 "mlp.down_proj")


def routed(truth):
    return {**truth, "mlp_activation": None, "mlp_neurons": None}


def by_experts(truth):
    """The truth of block i: routed where the block's MLP has experts (read from the HF modules)."""
    return lambda blocks: lambda i: routed(truth) if any("expert" in n for n, _ in blocks[i].mlp.named_modules()) \
        else truth


def kda(blocks):
    """Kimi-Linear / Bailing-Hybrid: the block's self_attn is a linear attention (by its class) or a latent one;
    either way what it returns is the token mixer's contribution."""
    experts = by_experts(LLAMA)(blocks)

    def at(i):
        values = {**experts(i), "mixer_output": ("self_attn", "out")}
        if "DeltaAttention" in type(blocks[i].self_attn).__name__:
            values.update(attention_premix=None, attention_output=None)
        return values
    return at


def scaled(x, a, m, e):
    return ((x + a) + m) * e["block"].layer_scalar


def ple_scaled(x, a, m, e):
    return (((x + a) + m) + e["P"]) * e["block"].layer_scalar


# case -> (model type, truth(blocks) -> truth(i), identity(x, a, m, extras), layer_mid(x, a))
CASES = {
    "gemma4_image_text": ("gemma4", lambda blocks: lambda i: GEMMA4_PLE, ple_scaled, lambda x, a: x + a),
    "gemma4_unified_text": ("gemma4_unified_text", lambda blocks: lambda i: SANDWICH, scaled, lambda x, a: x + a),
    "gemma4_unified": ("gemma4_unified", lambda blocks: lambda i: SANDWICH, scaled, lambda x, a: x + a),
    "dbrx": ("dbrx", lambda blocks: lambda i: DBRX, lambda x, a, m, e: (a + x) + m, lambda x, a: a + x),
    "modernbert_decoder": ("modernbert-decoder",
                           lambda blocks: lambda i: {**MODERNBERT, "attention_norm_output": None} if i == 0 else MODERNBERT,
                           lambda x, a, m, e: (x + a) + m, lambda x, a: x + a),
    "inkling_text": ("inkling_text", by_experts(INKLING), lambda x, a, m, e: (x + a) + m, lambda x, a: x + a),
    "kimi_linear": ("kimi_linear", kda, lambda x, a, m, e: (x + a) + m, lambda x, a: x + a),
    "bailing_hybrid": ("bailing_hybrid", kda, lambda x, a, m, e: (x + a) + m, lambda x, a: x + a),
}


def make(case, dtype=torch.float32):
    model_type, truth, identity, mid = CASES[case]
    hf = build_tiny(BY_MODEL_TYPE[model_type].tiny_config(), dtype)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())  # proven on a miniature at load
    hf.base_model_blocks = model.layers._module
    return model, hf, truth(hf.base_model_blocks), identity, mid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_values_equal_hooks_and_identity_holds(case, dtype):
    model, hf, truth, identity, mid = make(case, dtype)
    expected, saved, logits = hooks_and_reads(model, hf, truth, IDS)
    for i in range(model.num_layers):
        extras = {"block": hf.base_model_blocks[i]}
        listed = {key.rpartition(".")[2] for key in model.order(i)}
        for name, where in truth(i).items():
            if len(name) == 1:  # an extra place some identity needs
                extras[name] = expected[(i, name)]
            elif where is None:
                assert name not in listed, f"layer {i}: {name} should be unavailable"
            else:
                got, want = saved[(i, name)], expected[(i, name)]
                assert torch.equal(got, want.reshape(got.shape)), f"layer {i} {name}"
                if name == "attention_premix":  # viewed per head by the block's own attention's count
                    attention = hf.base_model_blocks[i].get_submodule(where[0].rpartition(".")[0])
                    heads = getattr(attention, "num_heads", model.num_heads)
                    assert got.shape[2] == heads == model.num_heads_of(i), f"layer {i}: heads"
        x, a, m, y = (saved[(i, n)] for n in ("layer_input", "mixer_output", "mlp_output", "layer_output"))
        if (i, "attention_output") in saved:  # the token mixer of an attention block is its attention
            assert torch.equal(saved[(i, "attention_output")], a)
        assert torch.equal(identity(x, a, m, extras), y), f"layer {i}: identity"
        assert torch.equal(saved[(i, "layer_mid")], mid(x, a))
        if "R" in extras:  # DBRX: norm_attn_norm hands the block layer_mid and mlp_norm_output
            assert torch.equal(extras["R"], saved[(i, "layer_mid")])
            assert torch.equal(extras["N"], saved[(i, "mlp_norm_output")])
        if i + 1 < model.num_layers:
            assert torch.equal(y, expected[(i + 1, "layer_input")])
    assert all(result.exact for result in check_identity(model, IDS))
    with torch.no_grad(), model.trace(IDS):  # the readout of the last block's output is the model's own logits
        readout = model.project_on_vocab(model.layers[-1].layer_output).save()
        own = model.logits.save()
    assert torch.equal(readout, own)


@pytest.mark.parametrize("case", CASES)
def test_edits_reach_the_logits_as_hooks_do(case):
    model, hf, truth, *_ = make(case)
    block = 1
    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(IDS):
        model.layers[block].mlp.mlp_output = model.layers[block].mlp.mlp_output * 0.5
        edited = model.logits.save()
    path, _ = truth(block)["mlp_output"]
    expected = run_with_hook(hf, hf.base_model_blocks[block].get_submodule(path), "out", lambda t: t * 0.5)
    assert torch.equal(edited, expected) and not torch.equal(edited, clean)
    with torch.no_grad(), model.trace(IDS):
        model.layers[block].layer_mid[:, -1] = 0  # in place: the stream the MLP's norm reads and the residual
        zeroed = model.logits.save()

    def zero_last_in_place(t):  # the stream itself, wherever the block uses it
        t[:, -1] = 0
        return t

    path, _ = truth(block)["layer_mid"]
    assert torch.equal(zeroed, run_with_hook(hf, hf.base_model_blocks[block].get_submodule(path), "in",
                                             zero_last_in_place))


def test_inkling_contributions_are_the_short_convolutions_of_the_sublayers_outputs():
    """attn_sconv / mlp_sconv: the sublayer's output plus its causal depthwise convolution, in float32, cast back."""
    model, hf, *_ = make("inkling_text")
    blocks = hf.base_model_blocks
    captured, handles = {}, []
    for i, block in enumerate(blocks):
        for name in ("self_attn", "mlp"):
            handles.append(block.get_submodule(name).register_forward_hook(  # reads, returns None
                lambda m, a, o, key=(i, name): captured.update({key: (o[0] if isinstance(o, tuple) else o).clone()})))
    try:
        saved, _ = read_all(model, IDS)
    finally:
        for handle in handles:
            handle.remove()
    for i, block in enumerate(blocks):
        for name, value, conv in (("self_attn", "attention_output", block.attn_sconv), ("mlp", "mlp_output",
                                                                                          block.mlp_sconv)):
            branch = captured[(i, name)].float()
            mixed = torch.nn.functional.conv1d(branch.transpose(1, 2), conv.conv1d.weight.float(),
                                               padding=conv.conv_kernel_size - 1, groups=branch.shape[-1])
            expected = (mixed[..., : branch.shape[1]].transpose(1, 2) + branch).to(saved[(i, value)].dtype)
            assert torch.allclose(saved[(i, value)], expected, atol=1e-6), f"layer {i} {value}"
            assert not torch.allclose(saved[(i, value)], captured[(i, name)], atol=1e-3)


@pytest.mark.parametrize("case", ["kimi_linear", "bailing_hybrid"])
def test_a_linear_attention_block_says_why_it_has_no_attention_values(case):
    model, hf, *_ = make(case)
    linear = [i for i, b in enumerate(hf.base_model_blocks) if "DeltaAttention" in type(b.self_attn).__name__]
    attention = [i for i in range(model.num_layers) if i not in linear]
    assert linear and attention
    model.enable_attention_values()  # proven on the latent-attention blocks
    with torch.no_grad(), model.trace(IDS):
        probabilities = model.layers[attention[0]].self_attn.attention_probabilities.save()
    assert torch.allclose(probabilities.sum(-1), torch.ones(()))
    for name in ("attention_output", "attention_premix", "queries"):
        with pytest.raises(ValueUnavailable, match=f"block {linear[0]} mixes tokens with Kimi Delta Attention"):
            with model.trace(IDS):
                getattr(model.layers[linear[0]].self_attn, name).save()


def test_inkling_attention_values_follow_each_layers_own_heads():
    """Its sliding-window layers have 2 heads, the others 4 (the tiny config): each is read by its own count."""
    model, hf, *_ = make("inkling_text")
    model.enable_attention_values()  # proven on the miniature: probabilities · values compose to attention_premix
    read = []
    with torch.no_grad(), model.trace(IDS):
        for i in range(model.num_layers):
            read.append((model.layers[i].self_attn.queries.save(), model.layers[i].self_attn.attention_probabilities.save()))
    for i, (queries, probabilities) in enumerate(read):
        heads = hf.base_model_blocks[i].self_attn.num_heads
        assert queries.shape[2] == probabilities.shape[1] == heads == model.num_heads_of(i)
        assert torch.allclose(probabilities.sum(-1), torch.ones(()))
    assert len({model.num_heads_of(i) for i in range(model.num_layers)}) == 2


def test_modernbert_decoder_block_0_has_no_attention_norm():
    model, *_ = make("modernbert_decoder")
    assert "Identity" in model.availability(0)["attention_norm_output"].reason
    with pytest.raises(ValueUnavailable, match="no norm before its attention"):
        with model.trace(IDS):
            model.layers[0].attention_norm_output.save()


# -- default configs whose layers differ ------------------------------------------------------------------------------

def default_config(model_type):
    """The type's default config, made whole where checkpoints always set what the default leaves out (DBRX's
    attention reads attn_config.rope_theta; its clamp needs clip_qkv)."""
    config = CONFIG_MAPPING[model_type]()
    if model_type == "dbrx":
        config.attn_config.rope_theta = config.rope_parameters["rope_theta"]
        config.attn_config.clip_qkv = 8.0
    return config


def head_dims(hf):
    return [block.self_attn.head_dim for block in StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256)).layers._module]


DEFAULTS = ["gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified", "dots3_note", "dbrx", "laguna",
            "modernbert-decoder", "inkling_text", "kimi_linear", "bailing_hybrid"]


@pytest.mark.parametrize("model_type", DEFAULTS)
def test_the_default_config_miniature_builds_and_is_proven(model_type):
    config = default_config(model_type)
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(miniature_config(config))).eval()
    assert sum(p.numel() for p in hf.parameters()) < 2_000_000
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))  # proven at load
    ids = IDS % model.vocab_size
    assert all(result.exact for result in check_identity(model, ids))


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4_unified"])
def test_a_per_layer_head_size_stays_per_layer(model_type):
    """Gemma-4's full-attention layers have twice the head size of the others: so do the miniature's."""
    config = default_config(model_type)
    text = config.get_text_config()
    text.allow_global_per_layer_attribute_access = True
    full = [i for i, kind in enumerate(text.layer_types) if kind == "full_attention"]
    mini = miniature_config(config).get_text_config()
    assert mini.is_heterogeneous
    sizes = [mini.per_layer_config[i].head_dim for i in range(mini.num_hidden_layers)]
    assert {sizes[i] for i in full} == {2 * sizes[0]} and sizes[0] == mini.head_dim
    hf = AutoModelForCausalLM.from_config(miniature_config(config))
    blocks = hf.get_submodule(BY_MODEL_TYPE[model_type].layers)
    assert [block.self_attn.head_dim for block in blocks] == sizes


def test_per_layer_head_counts_keep_their_ratios_and_views_split_by_them():
    """dots3: some layers have half the query heads, with one key-value head per query head; each block's
    attention_premix is viewed per head by its own count."""
    config = default_config("dots3_note")
    text = config.get_text_config()
    overrides = text._heterogeneity_spec.per_layer_overrides
    layer = next(iter(overrides))
    text.allow_global_per_layer_attribute_access = True
    ratio = text.num_attention_heads // overrides[layer]["num_attention_heads"]
    mini = miniature_config(config).get_text_config()
    mini.allow_global_per_layer_attribute_access = True
    own = mini.per_layer_config[layer]
    assert own.num_attention_heads * ratio == mini.num_attention_heads
    assert own.num_key_value_heads == own.num_attention_heads  # as the real layer: as many as query heads
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(miniature_config(config))).eval()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))
    captured = {}
    handle = hf.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(
        lambda m, args: captured.setdefault("premix", args[0].clone()))
    try:
        with torch.no_grad(), model.trace(IDS % 256):
            premix = model.layers[layer].self_attn.attention_premix.save()
    finally:
        handle.remove()
    assert premix.shape[2] == own.num_attention_heads == model.num_heads_of(layer) != model.num_heads_of(0)
    assert torch.equal(premix.flatten(2), captured["premix"])


def test_a_per_layer_list_of_head_counts_splits_each_block_by_its_own():
    """Laguna's num_attention_heads_per_layer: a layer with half the heads keeps half in the miniature, and its
    attention_premix is viewed per head by its own count."""
    config = default_config("laguna")
    config.num_attention_heads_per_layer = [config.num_attention_heads // (1 + i % 2) for i in
                                            range(config.num_hidden_layers)]
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(miniature_config(config))).eval()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))  # proven at load
    assert [model.num_heads_of(i) for i in range(2)] == [model.num_heads, model.num_heads // 2]
    captured = {}
    handle = hf.model.layers[1].self_attn.o_proj.register_forward_pre_hook(
        lambda m, args: captured.update(premix=args[0].clone()))
    try:
        with torch.no_grad(), model.trace(IDS % 256):
            premix = model.layers[1].self_attn.attention_premix.save()
    finally:
        handle.remove()
    assert premix.shape[2] == hf.model.layers[1].self_attn.num_heads == model.num_heads // 2
    assert torch.equal(premix.flatten(2), captured["premix"])


def test_per_layer_lists_secondary_heads_and_nested_configs_shrink():
    laguna = miniature_config(default_config("laguna"))
    assert laguna.num_attention_heads_per_layer == [laguna.num_attention_heads] * laguna.num_hidden_layers
    inkling = CONFIG_MAPPING["inkling_text"]()
    mini = miniature_config(inkling)
    assert mini.swa_num_attention_heads == mini.num_attention_heads  # as in the default: as many as the others
    assert mini.swa_num_attention_heads // mini.swa_num_key_value_heads == \
        inkling.swa_num_attention_heads // inkling.swa_num_key_value_heads
    assert mini.swa_head_dim == mini.head_dim
    dbrx = miniature_config(default_config("dbrx"))
    assert dbrx.ffn_config.hidden_size == dbrx.d_model == dbrx.hidden_size
    assert dbrx.attn_config.kv_n_heads == dbrx.num_key_value_heads == 1
    assert dbrx.ffn_config.ffn_hidden_size < 100 and dbrx.ffn_config.moe_num_experts <= 4


# -- DeepSeek-V4's compressed attention layers ------------------------------------------------------------------------

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


@pytest.mark.parametrize("layer_types", [None, KINDS], ids=["default", "each kind"])
def test_deepseek_v4_compressed_layers_keep_the_stream_and_refuse_what_has_no_token_axis(layer_types):
    """The default config's layers are all compressed: their keys carry the compressor's pooled entries after the
    window's positions. The miniature is proven, the stream values exact; there the values over the key axis are
    unavailable with the reason, the queries stay, and a sliding layer keeps them all."""
    changes = {} if layer_types is None else dict(num_hidden_layers=3, layer_types=layer_types,
                                                  mlp_layer_types=["hash_moe", "moe", "moe"])
    config = CONFIG_MAPPING["deepseek_v4"](**changes)
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(miniature_config(config))).eval()
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(256))  # proven at load
    ids = IDS % model.vocab_size
    assert all(result.exact for result in check_identity(model, ids))
    model.enable_attention_values()  # proven too, with the values over keys refused on the compressed layers
    kinds = config.layer_types
    compressed = [i for i, kind in enumerate(kinds) if kind != "sliding_attention"]
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    assert compressed
    # the raw keys really are longer than the sequence on a compressed layer (one entry per 4 tokens on a
    # compressed_sparse_attention one; per 128 on a heavily_compressed_attention one)
    layer = kinds.index("compressed_sparse_attention")
    captured = {}
    handle = hf.model.layers[layer].self_attn.compressor.register_forward_hook(
        lambda m, a, o: captured.update(pooled=o[0].shape[-2]))
    try:
        with torch.no_grad(), model.trace(ids):  # the sliding layer comes first in "each kind"
            keys = model.layers[sliding[0]].self_attn.keys.save() if sliding else None
            queries = model.layers[layer].self_attn.queries.save()
    finally:
        handle.remove()
    assert captured["pooled"] > 0 and queries.shape[:3] == (*ids.shape, model.num_heads)
    if sliding:
        assert keys.shape[:2] == ids.shape
        assert model.availability(sliding[0])["self_attn.attention_probabilities"].available
    for name in ("keys", "values", "attention_scores", "attention_probabilities"):
        assert "compressed attention layer" in model.availability(layer)[f"self_attn.{name}"].reason
        with pytest.raises(ValueUnavailable, match="compressor pools"):
            with model.trace(ids):
                getattr(model.layers[layer].self_attn, name).save()
