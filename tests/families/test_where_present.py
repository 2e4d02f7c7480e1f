"""The values placed where a family has them: the attention's query/key norms, the router's logits, the activation's
input, and a sandwich block's contributions before the norms after its sublayers.

Ground truth is independent of nnterp: plain PyTorch hooks on the unwrapped HF model, at module paths written here
from transformers' code, with the per-head layout computed in the test (a ``[b, s, h * d]`` tensor viewed per head, a
``[b, h, s, d]`` one transposed), and the math (the rotary embedding is the identity at position 0; the router is a
linear map; the activation module maps its input to ``mlp_activation``; the post-norm maps its input to the
contribution).
"""

from __future__ import annotations

import nnsight
import pytest
import torch
import torch.nn.functional as F
import transformers
from nnsight.intervention.interleaver import OutOfOrderError

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, edited_logits, tiny_tokenizer
from ..hooks import first_calls, logits_with_edit

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])
QK = ("query_norm_input", "query_norm_output", "key_norm_input", "key_norm_output")


# types filed under a family whose tiny config is another type's: their own tiny config
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=128, max_position_embeddings=64, num_experts=4, num_local_experts=4,
              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
OWN_CONFIGS = {
    **{model_type: (lambda model_type=model_type: transformers.AutoConfig.for_model(model_type, **_SMALL))
       for model_type in ("flint", "hy_v3", "laguna", "mellum", "minimax_m2", "minimax_m3_vl_text", "exaone_moe")},
    "exaone4": lambda: transformers.Exaone4Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}


def make(model_type, dtype=torch.float32, changes=None, **options):
    config = (OWN_CONFIGS.get(model_type) or BY_MODEL_TYPE[model_type].tiny_config)()
    assert config.model_type == model_type
    for key, value in (changes or {}).items():
        setattr(config, key, value)
    hf = build_tiny(config, dtype)
    text = config.get_text_config()
    return StandardizedTransformer(hf, tokenizer=tiny_tokenizer(text.vocab_size), **options), hf, text


def blocks(hf, model_type):
    return hf.get_submodule(BY_MODEL_TYPE[model_type].layers)


def width(text):
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


# model type -> (query norm, key norm, the layout the norms read, from transformers' code): "heads" [b, s, h, d],
# "first" [b, h, s, d], "whole" [b, s, h * d]
QK_NORMS = {
    "qwen3": ("q_norm", "k_norm", "heads"),
    "qwen3_moe": ("q_norm", "k_norm", "heads"),
    "olmoe": ("q_norm", "k_norm", "whole"),
    "gemma3_text": ("q_norm", "k_norm", "first"),
    "gemma3": ("q_norm", "k_norm", "first"),
    "olmo2": ("q_norm", "k_norm", "whole"),
    "olmo3": ("q_norm", "k_norm", "whole"),
    "exaone4": ("q_norm", "k_norm", "first"),
    "flex_olmo": ("q_norm", "k_norm", "whole"),
    "kolibri1": ("q_norm", "k_norm", "first"),
    "afmoe": ("q_norm", "k_norm", "heads"),
    "apertus": ("q_norm", "k_norm", "first"),
    "nanochat": ("q_norm", "k_norm", "first"),
    "persimmon": ("q_layernorm", "k_layernorm", "heads"),
    "beam": ("q_norm", "k_norm", "heads"),
    "doge": ("q_norm", "k_norm", "heads"),
    "inkling_text": ("q_norm", "k_norm", "heads"),
    "dory": ("q_norm", "k_norm", "heads"),
    "gemma3n_text": ("q_norm", "k_norm", "heads"),
    "gemma4_text": ("q_norm", "k_norm", "heads"),
    "gemma4": ("q_norm", "k_norm", "heads"),
    # hybrids: on their attention blocks
    "lfm2": ("q_layernorm", "k_layernorm", "heads"),
    "lfm2_moe": ("q_layernorm", "k_layernorm", "heads"),
    "lfm3": ("q_norm", "k_norm", "heads"),
    "lara_mini": ("q_norm", "k_norm", "heads"),
    "qwen3_5_text": ("q_norm", "k_norm", "heads"),
    "qwen3_5_moe_text": ("q_norm", "k_norm", "heads"),
    "qwen3_next": ("q_norm", "k_norm", "heads"),
    "olmo_hybrid": ("q_norm", "k_norm", "whole"),
    "qwen4_exp_text": ("q_norm", "k_norm", "heads"),
    # the blocks of another family in a multimodal class (Qwen3's, Persimmon's)
    "moss_transcribe_diarize": ("q_norm", "k_norm", "heads"),
    "fuyu": ("q_layernorm", "k_layernorm", "heads"),
    # types filed under Qwen2-MoE, Mixtral and DeepSeek-V3, on their own tiny configs
    "flint": ("q_norm", "k_norm", "heads"),
    "hy_v3": ("q_norm", "k_norm", "first"),
    "laguna": ("q_norm", "k_norm", "heads"),
    "mellum": ("q_norm", "k_norm", "heads"),
    "minimax_m2": ("q_norm", "k_norm", "whole"),
    "minimax_m3_vl_text": ("q_norm", "k_norm", "heads"),
    "exaone_moe": ("q_norm", "k_norm", "first"),
}


def per_head(tensor, layout, d):
    """The test's own per-head view ``[b, s, h, d]`` of a tensor in the layout its norm reads."""
    if layout == "first":
        return tensor.transpose(1, 2)
    if layout == "whole":
        return tensor.reshape(*tensor.shape[:2], -1, d)
    return tensor


def native(tensor, layout, like):
    """The inverse of ``per_head``: a per-head tensor back in the layout ``like`` has."""
    if layout == "first":
        return tensor.transpose(1, 2)
    if layout == "whole":
        return tensor.reshape(like.shape)
    return tensor


def read(model, layer, names):
    """``{owner.name: tensor}`` of block ``layer`` (of its first run, where it runs more than once: Dory's looped
    section, as a hook's first call), read in forward order in one trace."""
    order = model.order(layer, aliases=True, where_present=True)
    schedule = model.family.schedule
    calls = list(schedule(model._module.config.get_text_config())) if schedule else []
    run = 0 if calls.count(layer) > 1 else None

    def value(key):
        block = model.layers[layer] if run is None else model.layers[layer].run(run)
        owner, name = key.split(".") if "." in key else (None, key)
        return getattr(getattr(block, owner) if owner else block, name)

    with torch.no_grad(), model.trace(IDS):
        saved = nnsight.save({key: value(key) for key in sorted(names, key=lambda k: order[k])})
        logits = model.logits.save()
    return saved, logits


def attention_layers(model, hf, model_type, text):
    """The blocks that have an attention (a hybrid's others mix tokens otherwise: nnterp says so for their q/k
    norms' values)."""
    layers = []
    for layer, block in enumerate(blocks(hf, model_type)):
        if hasattr(block, "self_attn"):
            layers.append(layer)
        else:
            assert "not attention" in model.availability(layer)["self_attn.query_norm_output"].reason
    assert layers
    return layers


def hooked_norms(hf, model_type, layer):
    """The first call of block ``layer``'s query and key norms (``(args, output)``); the key norm left out where the
    attention has none (a layer reusing an earlier layer's keys: Gemma-3n, Gemma-4)."""
    q, k, _ = QK_NORMS[model_type]
    attention = blocks(hf, model_type)[layer].self_attn
    modules = {"query": attention.get_submodule(q), **({"key": getattr(attention, k)} if hasattr(attention, k) else {})}
    return first_calls(hf, modules, IDS)


# -- 1. the q/k norms' inputs and outputs --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("model_type", list(QK_NORMS))
def test_qk_norms_are_the_norm_modules_inputs_and_outputs(model_type, dtype):
    model, hf, text = make(model_type, dtype)
    layout, d = QK_NORMS[model_type][2], width(text)
    for layer in attention_layers(model, hf, model_type, text):
        truth = hooked_norms(hf, model_type, layer)
        here = [name for name in QK if name.split("_")[0] in truth]
        if "key" not in truth:  # no key norm on this layer: nnterp says why
            for name in ("key_norm_input", "key_norm_output"):
                assert "reuses the keys of an earlier layer" in model.availability(layer)[f"self_attn.{name}"].reason
        saved, logits = read(model, layer, [f"self_attn.{name}" for name in here])
        for name in here:
            which, side = name.split("_norm_")
            args, out = truth[which]
            expected = per_head(args[0] if side == "input" else out, layout, d)
            got = saved[f"self_attn.{name}"]
            assert got.shape == (*IDS.shape, expected.shape[2], d), (name, got.shape)
            assert got.dtype == dtype
            assert torch.equal(got, expected), (layer, name)
        # the norm does something: its output is not its input
        assert not torch.equal(saved["self_attn.query_norm_input"], saved["self_attn.query_norm_output"])
    with torch.no_grad():
        assert torch.equal(logits, hf(input_ids=IDS).logits)


def rotary_after_norm(model_type, text, layer) -> bool:
    """Whether the attention turns the normed keys by the rotary embedding (from transformers' code): nanochat norms
    after the rotary embedding; Inkling has none (a learned relative position bias instead); AfMoE's, Beam's and
    Lara-Mini's full-attention layers have none (NoPE)."""
    if model_type in ("nanochat", "inkling_text"):
        return False
    if model_type in ("afmoe", "exaone4", "beam", "lara_mini"):  # EXAONE-4: none on its full-attention layers where it has sliding ones
        return text.layer_types[layer] == "sliding_attention"
    return True


# left out: the types whose keys nnterp does not read (the attention internals unavailable on their spec: Flint's
# eager attention has sinks where Qwen2-MoE's has none; Laguna gates each head's output, so the proof cannot check
# the probabilities against attention_premix)
NO_KEYS = ("flint", "laguna")


@pytest.mark.parametrize("model_type", [t for t in QK_NORMS if t not in NO_KEYS])
def test_keys_at_position_0_are_the_normed_keys(model_type):
    """At position 0 (cos 1, sin 0) the rotary embedding is the identity, so the keys the scores use are the key
    norm's output there; elsewhere they are turned, unless no rotary embedding follows the norm."""
    model, hf, text = make(model_type, attention_values=True)
    turned = 0
    for layer in attention_layers(model, hf, model_type, text):
        if not model.availability(layer)["self_attn.key_norm_output"].available:
            assert "key" not in hooked_norms(hf, model_type, layer)  # a layer reusing earlier keys
            continue
        saved, _ = read(model, layer, ["self_attn.key_norm_output", "self_attn.keys"])
        keys, normed = saved["self_attn.keys"], saved["self_attn.key_norm_output"]
        assert torch.equal(keys[:, 0], normed[:, 0]), layer
        if rotary_after_norm(model_type, text, layer):
            turned += 1
            assert not torch.equal(keys[:, 1:], normed[:, 1:]), layer
        else:  # no rotary embedding between the key norm and the scores: the keys are its output everywhere
            assert torch.equal(keys, normed), layer
    assert turned > 0 or model_type in ("nanochat", "inkling_text")


# -- 2. edits of the q/k norms' values reach the logits as a hook's edit does -------------------------------------


def head_scale(t):
    """An edit in the per-head layout: every head scaled by its own factor (head 0 left alone)."""
    factors = torch.arange(t.shape[-2], dtype=torch.float32) * 0.75 + 1.0
    return t * factors.to(t.dtype)[:, None]


@pytest.mark.parametrize("assign", [False, True], ids=["in_place", "assign"])
@pytest.mark.parametrize("name", ["query_norm_output", "key_norm_input"])
@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "olmo2"])
def test_qk_norm_edits_reach_the_logits_as_a_hook_edit(model_type, name, assign):
    model, hf, text = make(model_type)
    q, k, layout = QK_NORMS[model_type]
    d, layer = width(text), 1
    module = blocks(hf, model_type)[layer].self_attn.get_submodule(q if name.startswith("query") else k)

    def hook_edit(t):
        return native(head_scale(per_head(t, layout, d)), layout, t)

    expected = logits_with_edit(hf, module, "out" if name.endswith("output") else "in", hook_edit, IDS)
    with torch.no_grad():
        clean = hf(input_ids=IDS).logits
    assert not torch.allclose(expected, clean)
    got = edited_logits(model, IDS, layer, name, "self_attn", head_scale, assign)
    assert torch.equal(got, expected)


# -- 3. router logits -----------------------------------------------------------------------------------------------

# model type -> (the router module in a routed block, the element of its output that is the logits)
ROUTERS = {
    "mixtral": ("mlp.gate", 0), "qwen2_moe": ("mlp.gate", 0), "qwen3_moe": ("mlp.gate", 0), "olmoe": ("mlp.gate", 0),
    "gpt_oss": ("mlp.router", 0), "granitemoe": ("block_sparse_moe.router", 0),
    "granitemoeshared": ("block_sparse_moe.router", 0), "llama4_text": ("feed_forward.router", 1),
    "flex_olmo": ("mlp.gate", 0), "afmoe": ("mlp.router", 0),
    "deepseek_v3": ("mlp.gate", 0), "cohere2_moe": ("mlp.gate", 0), "minimax": ("mlp.gate", 0),
    "dbrx": ("ffn.router", None),  # returns the logits alone
    "beam": ("mlp.gate", 0), "qwen4_exp_text": ("mlp.gate", 0),
    # hybrids' routed blocks
    "jamba": ("feed_forward.router", 0), "granitemoehybrid": ("block_sparse_moe.router", 0),
    "qwen3_next": ("mlp.gate", 0), "qwen3_5_moe_text": ("mlp.gate", 0), "lara_mini": ("mlp.gate", 0),
    "lfm2_moe": ("feed_forward.gate", 0), "kimi_linear": ("mlp.gate", 0), "bailing_hybrid": ("mlp.gate", 0),
    "nemotron_h": ("mixer.gate", 0), "jetmoe": ("mlp.router", 4),
}


def linear_of(router):
    """The router's linear map: its own weight (and bias), or its ``gate`` Linear's (AfMoE), or its ``layer``
    Linear's (DBRX)."""
    linear = router if hasattr(router, "weight") else getattr(router, "gate", None) or router.layer
    return linear.weight, getattr(linear, "bias", None)


@pytest.mark.parametrize("model_type", list(ROUTERS))
def test_router_logits_are_the_router_output_and_its_linear_map(model_type):
    model, hf, text = make(model_type)
    path, index = ROUTERS[model_type]
    routed = 0
    for layer, block in enumerate(blocks(hf, model_type)):
        try:
            router = block.get_submodule(path)
        except AttributeError:
            router = None
        if router is None:  # a dense block of a routed family (or one with no MLP): nnterp says why
            with pytest.raises(ValueUnavailable, match="dense MLP: no router|has no MLP"):
                with model.trace(IDS):
                    model.layers[layer].mlp.router_logits.save()
            continue
        routed += 1
        saved, _ = read(model, layer, ["mlp.router_logits"])
        got = saved["mlp.router_logits"]
        args, out = first_calls(hf, {"router": router}, IDS)["router"]
        logits = out if index is None else out[index]
        experts = logits.shape[-1]
        assert got.shape == (*IDS.shape, experts)
        assert torch.equal(got, logits.reshape(*IDS.shape, experts)), layer
        weight, bias = linear_of(router)
        x = args[0]
        assert torch.allclose(got, F.linear(x, weight.to(x.dtype), bias).reshape(*IDS.shape, experts),
                              atol=1e-6, rtol=0), layer
    assert routed > 0


def test_router_logits_unavailable_where_no_one_place_holds_them():
    """Kolibri-1's router computes its logits on a path chosen by device, dtype and gradients."""
    model, _, _ = make("kolibri1")
    assert "one of two paths" in model.availability(0)["mlp.router_logits"].reason


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma2"])
def test_router_logits_unavailable_on_a_dense_family(model_type):
    model, _, _ = make(model_type)
    assert "no router" in model.availability(0)["mlp.router_logits"].reason
    with pytest.raises(ValueUnavailable, match=r"'mlp\.router_logits' is unavailable .*a dense MLP: no router"):
        with model.trace(IDS):
            model.layers[0].mlp.router_logits.save()


# -- 4. the activation's input -------------------------------------------------------------------------------------

# model type -> (the projection whose output the activation reads, the activation module, chunk of a fused gate_up)
PRE_ACTIVATION = {
    "llama": ("mlp.gate_proj", "mlp.act_fn", None),
    "gpt2": ("mlp.c_fc", "mlp.act", None),
    "gemma2": ("mlp.gate_proj", "mlp.act_fn", None),
    "phi3": ("mlp.gate_up_proj", "mlp.activation_fn", 0),  # gate, up = gate_up_proj(x).chunk(2, dim=-1)
    "gpt_neox": ("mlp.dense_h_to_4h", "mlp.act", None),
    "falcon": ("mlp.dense_h_to_4h", "mlp.act", None),
    "bloom": ("mlp.dense_h_to_4h", "mlp.gelu_impl", None),
    "opt": ("fc1", "activation_fn", None),
}


@pytest.mark.parametrize("model_type, changes", [(t, None) for t in PRE_ACTIVATION]
                         + [("opt", {"do_layer_norm_before": False})], ids=[*PRE_ACTIVATION, "opt_post_norm"])
def test_mlp_pre_activation_is_the_projection_feeding_the_activation(model_type, changes):
    model, hf, text = make(model_type, changes=changes)
    projection, activation, chunk = PRE_ACTIVATION[model_type]
    layer = 1
    block = blocks(hf, model_type)[layer]
    saved, _ = read(model, layer, ["mlp.mlp_pre_activation", "mlp.mlp_activation"])
    truth = first_calls(hf, {"projection": block.get_submodule(projection)}, IDS)
    expected = truth["projection"][1]
    if chunk is not None:
        expected = expected.chunk(2, dim=-1)[chunk]
    got = saved["mlp.mlp_pre_activation"]
    assert got.shape == (*IDS.shape, expected.shape[-1])
    assert torch.equal(got, expected.reshape(got.shape))
    with torch.no_grad():
        assert torch.equal(block.get_submodule(activation)(got), saved["mlp.mlp_activation"])


# -- 5. a sandwich block's contributions before its norms ----------------------------------------------------------

# model type -> (the attention's post-norm, the MLP's post-norm, the attention module, the MLP module, a block factor
# the block multiplies the normed contributions by), from transformers' code. The module None: what the norm reads is
# not one module's output (Gemma-4's routed blocks norm the sum of the dense MLP's and the experts' normed outputs).
SANDWICH = {
    "gemma2": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "gemma3_text": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "gemma3": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "glm4": ("post_self_attn_layernorm", "post_mlp_layernorm", "self_attn", "mlp", None),
    "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "olmo3": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "flex_olmo": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "kolibri1": ("post_self_attn_layernorm", "post_mlp_layernorm", "self_attn", "mlp", None),
    "afmoe": ("post_attention_layernorm", "post_mlp_layernorm", "self_attn", "mlp", None),
    "hyperclovax": ("post_norm1", "post_norm2", "self_attn", "mlp", "residual_multiplier"),
    "gemma3n_text": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "gemma4_text": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", None, None),
    "beam": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "dory": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "lfm3": ("post_operator_norm", "post_ffn_norm", "self_attn", "feed_forward", None),
    "olmo_hybrid": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "exaone4": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", "mlp", None),
    "gemma4": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", None, None),
    "gemma4_unified_text": ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn", None, None),
}


@pytest.mark.parametrize("model_type", list(SANDWICH))
def test_contributions_before_the_norms_are_the_sublayer_outputs(model_type):
    model, hf, text = make(model_type)
    attn_norm, mlp_norm, attn, mlp, factor = SANDWICH[model_type]
    names = ["self_attn.attention_output_before_norm", "self_attn.attention_output", "mlp.mlp_output_before_norm",
             "mlp.mlp_output"]
    checked = 0
    for layer, block in enumerate(blocks(hf, model_type)):
        info = model.availability(layer)
        here = [n for n in names if info[n].available]
        saved, _ = read(model, layer, here)
        modules = {f"{which}_{kind}": block.get_submodule(path)
                   for which, norm, sub in (("attention", attn_norm, attn), ("mlp", mlp_norm, mlp))
                   for kind, path in (("norm", norm), ("module", sub)) if path and hasattr(block, path.split(".")[0])}
        truth = first_calls(hf, modules, IDS)
        for which, owner in (("attention", "self_attn"), ("mlp", "mlp")):
            if f"{owner}.{which}_output_before_norm" not in here or f"{which}_norm" not in truth:
                continue
            checked += 1
            before = saved[f"{owner}.{which}_output_before_norm"]
            norm_args, norm_out = truth[f"{which}_norm"]
            assert torch.equal(before, norm_args[0]), (layer, which)
            if f"{which}_module" in truth:  # what the norm reads is the sublayer's own output
                assert torch.equal(before, truth[f"{which}_module"][1][0] if isinstance(
                    truth[f"{which}_module"][1], tuple) else truth[f"{which}_module"][1]), (layer, which)
            with torch.no_grad():
                normed = modules[f"{which}_norm"](before)
            assert torch.equal(normed, norm_out)
            scale = getattr(block, factor) if factor else None
            contribution = saved[f"{owner}.{which}_output"]
            assert torch.equal(contribution, normed if scale is None else normed * scale), (layer, which)
            assert not torch.equal(before, contribution)
    assert checked > 0


def test_contributions_before_the_norms_are_the_contributions_without_sandwich():
    model, hf, text = make("llama")
    layer = 1
    block = blocks(hf, "llama")[layer]
    names = ["self_attn.attention_output_before_norm", "self_attn.attention_output", "mlp.mlp_output_before_norm",
             "mlp.mlp_output"]
    saved, _ = read(model, layer, names)
    truth = first_calls(hf, {"attention": block.self_attn, "mlp": block.mlp}, IDS)
    assert torch.equal(saved["self_attn.attention_output_before_norm"], truth["attention"][1][0])
    assert torch.equal(saved["mlp.mlp_output_before_norm"], truth["mlp"][1])
    assert torch.equal(saved["self_attn.attention_output_before_norm"], saved["self_attn.attention_output"])
    assert torch.equal(saved["mlp.mlp_output_before_norm"], saved["mlp.mlp_output"])


# -- 6. defaults and order -----------------------------------------------------------------------------------------


def test_qk_norm_values_unavailable_without_qk_norms():
    model, _, _ = make("llama")
    info = model.availability(0)
    for name in QK:
        assert not info[f"self_attn.{name}"].available
        assert "no query or key norm" in info[f"self_attn.{name}"].reason
    with pytest.raises(ValueUnavailable, match=r"'self_attn\.query_norm_input' is unavailable .*no query or key norm"):
        with model.trace(IDS):
            model.layers[0].self_attn.query_norm_input.save()
    assert not any(name in key for key in model.order(0) for name in QK)


def test_order_lists_the_new_values_in_forward_order():
    model, _, _ = make("qwen3_moe")
    # Qwen3-MoE's tiny config: block 1 is routed (decoder_sparse_step=2)
    order = model.order(1, where_present=True)
    q_in, q_out, k_in, k_out = (order[f"self_attn.{name}"] for name in QK)
    assert q_in < q_out < order["self_attn.attention_premix"]
    assert k_in < k_out < order["self_attn.attention_premix"]
    assert order["mlp_input"] < order["mlp.router_logits"] < order["mlp.mlp_output"]
    dense = model.order(0, where_present=True)
    assert dense["mlp.mlp_pre_activation"] < dense["mlp.mlp_activation"] < dense["mlp.mlp_neurons"]
    assert "mlp.router_logits" not in dense
    # a read in that order works in one trace, the reverse raises nnsight's out-of-order error
    saved, _ = read(model, 1, ["self_attn.query_norm_output", "mlp.router_logits"])
    assert set(saved) == {"self_attn.query_norm_output", "mlp.router_logits"}
    with pytest.raises(OutOfOrderError):
        with torch.no_grad(), model.trace(IDS):
            nnsight.save(model.layers[1].mlp.router_logits)
            nnsight.save(model.layers[1].self_attn.query_norm_output)
