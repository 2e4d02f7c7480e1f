"""The family matrix: every standard value against plain PyTorch hooks, the identity, edits.

Ground truth is independent of nnterp: the module boundaries below are written from the
reference survey of transformers' code, captured with ``register_forward_(pre_)hook`` on
the unwrapped HF model, and the identities are the families' own arithmetic.
"""

from __future__ import annotations

import math

import nnsight
import pytest
import torch
from nnsight.intervention.interleaver import OutOfOrderError

from nnterp import StandardizedTransformer, ValueUnavailable
from nnterp.families import BY_MODEL_TYPE
from nnterp.spec.catalog import BY_NAME

from ..conftest import build_tiny, tiny_tokenizer
from ..hooks import scaled_edit

# value -> (module path relative to the block, "in" | "out"); None where the value has no meaning. A third element
# names a block attribute the block's code multiplies that tensor by as it adds it to the stream (Granite's
# residual_multiplier): the value is the product, and an edit of it is the hook's edit of the product, divided back.
PRE_NORM = lambda ln1, attn, o_proj, ln2, mlp, act, down: {  # noqa: E731
    "layer_input": ("", "in"), "attention_norm_output": (ln1, "out"), "attention_premix": (o_proj, "in"),
    "attention_output": (attn, "out"), "layer_mid": (ln2, "in"), "mlp_norm_output": (ln2, "out"),
    "mlp_input": (mlp, "in"), "mlp_activation": (act, "out"), "mlp_neurons": (down, "in"),
    "mlp_output": (mlp, "out"), "layer_output": ("", "out"),
}
LLAMA = PRE_NORM("input_layernorm", "self_attn", "self_attn.o_proj", "post_attention_layernorm", "mlp",
                 "mlp.act_fn", "mlp.down_proj")
ROUTED = {**LLAMA, "mlp_activation": None, "mlp_neurons": None}
APERTUS_TRUTH = PRE_NORM("attention_layernorm", "self_attn", "self_attn.o_proj", "feedforward_layernorm", "mlp",
                         "mlp.act_fn", "mlp.down_proj")
NEOX_SEQ = PRE_NORM("input_layernorm", "attention", "attention.dense", "post_attention_layernorm", "mlp",
                    "mlp.act", "mlp.dense_4h_to_h")
GPT2_TRUTH = PRE_NORM("ln_1", "attn", "attn.c_proj", "ln_2", "mlp", "mlp.act", "mlp.c_proj")
GPTJ_TRUTH = {**PRE_NORM("ln_1", "attn", "attn.out_proj", None, "mlp", "mlp.act", "mlp.fc_out"),
              "layer_mid": None, "mlp_norm_output": ("ln_1", "out")}
SHARED_NORM = lambda truth: {**truth, "layer_mid": None, "mlp_norm_output": truth["attention_norm_output"]}  # noqa: E731
FALCON_SEQ = PRE_NORM("input_layernorm", "self_attention", "self_attention.dense", "post_attention_layernorm",
                      "mlp", "mlp.act", "mlp.dense_4h_to_h")
SANDWICH = {**PRE_NORM("input_layernorm", "post_attention_layernorm", "self_attn.o_proj",
                       "pre_feedforward_layernorm", "mlp", "mlp.act_fn", "mlp.down_proj"),
            "mlp_output": ("post_feedforward_layernorm", "out")}
GLM4 = {**PRE_NORM("input_layernorm", "post_self_attn_layernorm", "self_attn.o_proj", "post_attention_layernorm", "mlp",
                  "mlp.activation_fn", "mlp.down_proj"), "mlp_output": ("post_mlp_layernorm", "out")}
AFMOE = {**PRE_NORM("input_layernorm", "post_attention_layernorm", "self_attn.o_proj", "pre_mlp_layernorm", "mlp",
                   "mlp.act_fn", "mlp.down_proj"), "mlp_output": ("post_mlp_layernorm", "out")}
FAIRSEQ = {**PRE_NORM("self_attn_layer_norm", "self_attn", "self_attn.out_proj", "final_layer_norm", "fc1",
                      "activation_fn", "fc2"), "mlp_output": ("fc2", "out")}
LLAMA4_DENSE = PRE_NORM("input_layernorm", "self_attn", "self_attn.o_proj", "post_attention_layernorm", "feed_forward",
                        "feed_forward.activation_fn", "feed_forward.down_proj")
LLAMA4_ROUTED = {**LLAMA4_DENSE, "mlp_activation": None, "mlp_neurons": None}  # mlp_output flattened: [b * s, h]
NO_PRE_NORM = {**SANDWICH, "attention_norm_output": None, "mlp_norm_output": None, "layer_mid": ("mlp", "in")}
# formula(x, a, m, e): e holds the block module ("block") and the hook captures of a case's extra locations
seq = lambda x, a, m, e: (x + a) + m  # noqa: E731
am_x = lambda x, a, m, e: (a + m) + x  # noqa: E731
ma_x = lambda x, a, m, e: (m + a) + x  # noqa: E731


def gemma4(x, a, m, e):
    return (((x + a) + m) + e["P"]) * e["block"].layer_scalar


def doge(x, a, m, e):
    return e["block"].post_attention_residual * (e["block"].input_residual * x + a) + m


def zaya(x, a, m, e):
    def scaled(s, branch, stream):
        return (branch + s.hidden_states_bias) * s.hidden_states_scale + (stream + s.residual_bias) * s.residual_scale
    block = e["block"]
    return scaled(block.post_mlp_residual_scale, m, scaled(block.post_attention_residual_scale, a, x))


def hyper_connections(x, a, m, e):
    def mix(post, comb, branch, streams):
        return (post.to(streams.dtype).unsqueeze(-1) * branch.unsqueeze(-2)
                + torch.matmul(comb.to(streams.dtype).transpose(-1, -2), streams))
    return mix(e["ffn_post"], e["ffn_comb"], m, mix(e["attn_post"], e["attn_comb"], a, x))


def broadcast_streams(x, a, m, e):
    def add(post, branch, streams):
        return (post.float().unsqueeze(-1) * branch.float().unsqueeze(-2) + streams.float()).to(streams.dtype)
    return add(e["ffn_post"], m, add(e["attn_post"], a, x))


def depth_scaled(branch, stream, k):
    """Beam's add number k: the branch over sqrt(k), the stream times sqrt((k - 1) / k)."""
    return branch * (1 / math.sqrt(k)) + stream * math.sqrt((k - 1) / k)


def beam(x, a, m, e):
    k = e["block"].attn_residual_add_idx  # 2(i + 1), the block's own count of adds
    return depth_scaled(m, depth_scaled(a, x, k), k + 1)


CUSTOM_IDENTITY = {"beam", "gemma4", "gemma4_dense", "doge", "doge_moe", "zaya", "deepseek_v4", "hy_v4"}
CUSTOM_MID = {
    "beam": lambda x, a, block: depth_scaled(a, x, block.attn_residual_add_idx),
    "doge": lambda x, a, block: block.input_residual * x + a,
    "doge_moe": lambda x, a, block: block.input_residual * x + a,
}
SANDWICH_ROUTED = {**SANDWICH, "mlp_activation": None, "mlp_neurons": None}


def SCALED(truth, factor="residual_multiplier"):  # noqa: N802
    """``truth`` whose contributions the block multiplies by its attribute ``factor`` as it adds them."""
    return {**truth, **{name: (*truth[name], factor) for name in ("attention_output", "mlp_output")}}


def tiny(model_type, **changes):
    def config():
        cfg = BY_MODEL_TYPE[model_type].tiny_config()
        for key, value in changes.items():
            setattr(cfg, key, value)
        return cfg
    return config


# case -> (config factory, truth, layer formula in the code's order of addition, block output is a tuple)
# truth may be a function of the layer index, for models whose blocks differ.
CASES = {
    "gpt2": (tiny("gpt2"), GPT2_TRUTH, seq, False),
    "gpt_bigcode": (tiny("gpt_bigcode"), GPT2_TRUTH, seq, False),
    "gptj": (tiny("gptj"), GPTJ_TRUTH, am_x, False),
    "codegen": (tiny("codegen"), GPTJ_TRUTH, am_x, False),
    "gpt_neo": (tiny("gpt_neo"),
                PRE_NORM("ln_1", "attn", "attn.attention.out_proj", "ln_2", "mlp", "mlp.act", "mlp.c_proj"),
                seq, True),
    "gpt_neox_parallel": (tiny("gpt_neox"), {**NEOX_SEQ, "layer_mid": None}, ma_x, False),
    "gpt_neox_sequential": (tiny("gpt_neox", use_parallel_residual=False), NEOX_SEQ, seq, False),
    # BLOOM and MPT add the residual inside their modules: the contributions enter those adds.
    "bloom": (tiny("bloom"),
              {**PRE_NORM("input_layernorm", None, "self_attention.dense", "post_attention_layernorm", "mlp",
                          "mlp.gelu_impl", "mlp.dense_4h_to_h"),
               "attention_output": ("self_attention.dense", "out"), "mlp_output": ("mlp.dense_4h_to_h", "out")},
              seq, True),
    "mpt": (tiny("mpt"), {**PRE_NORM("norm_1", "attn", "attn.out_proj", "norm_2", "ffn", "ffn.act", "ffn.down_proj"),
                          "mlp_output": ("ffn.down_proj", "out")}, seq, True),
    # Falcon: the hooks clone, so a saved parallel MLP output must not be the in-place sum m + a.
    "falcon_7b_parallel": (tiny("falcon"), SHARED_NORM(FALCON_SEQ), ma_x, True),
    "falcon_rw_alibi": (tiny("falcon", parallel_attn=False, alibi=True, bias=True, multi_query=False),
                        FALCON_SEQ, seq, True),
    "falcon_rw_rope": (tiny("falcon", parallel_attn=False), FALCON_SEQ, seq, True),
    "falcon_40b_two_norms": (tiny("falcon", new_decoder_architecture=True, num_kv_heads=2),
                             {**FALCON_SEQ, "attention_norm_output": ("ln_attn", "out"), "layer_mid": None,
                              "mlp_norm_output": ("ln_mlp", "out")}, ma_x, True),
    "falcon_new_one_norm": (tiny("falcon", new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
                            SHARED_NORM(FALCON_SEQ), ma_x, True),
    # OPT: the MLP's layers are the block's own and run on [batch*seq, hidden]; hooks see 2-D tensors.
    "opt": (tiny("opt"), {**PRE_NORM("self_attn_layer_norm", "self_attn", "self_attn.out_proj", "final_layer_norm",
                                     "fc1", "activation_fn", "fc2"), "mlp_output": ("fc2", "out")}, seq, False),
    "phi": (tiny("phi"), SHARED_NORM(PRE_NORM("input_layernorm", "self_attn", "self_attn.dense", None, "mlp",
                                              "mlp.activation_fn", "mlp.fc2")), am_x, False),
    "stablelm_parallel": (tiny("stablelm"), SHARED_NORM(LLAMA), seq, False),
    "stablelm_sequential": (tiny("stablelm", use_parallel_residual=False), LLAMA, seq, False),
    "cohere": (tiny("cohere"), SHARED_NORM(LLAMA), seq, False),
    "cohere2_moe": (tiny("cohere2_moe"), lambda i: SHARED_NORM(LLAMA if i == 0 else ROUTED), seq, False),
    "llama": (tiny("llama"), LLAMA, seq, False),
    "mistral": (tiny("mistral"), LLAMA, seq, False),
    "qwen2": (tiny("qwen2"), LLAMA, seq, False),
    "qwen3": (tiny("qwen3"), LLAMA, seq, False),
    "smollm3": (tiny("smollm3"), LLAMA, seq, False),
    "gemma": (tiny("gemma"), LLAMA, seq, False),
    "olmo": (tiny("olmo"), LLAMA, seq, False),
    # Llama's block under other names
    "starcoder2": (tiny("starcoder2"), PRE_NORM("input_layernorm", "self_attn", "self_attn.o_proj",
                                                "post_attention_layernorm", "mlp", "mlp.act", "mlp.c_proj"), seq, False),
    "glm": (tiny("glm"), PRE_NORM("input_layernorm", "self_attn", "self_attn.o_proj", "post_attention_layernorm", "mlp",
                                  "mlp.activation_fn", "mlp.down_proj"), seq, False),
    "nanochat": (tiny("nanochat"), PRE_NORM("input_layernorm", "self_attn", "self_attn.o_proj",
                                            "post_attention_layernorm", "mlp", "mlp.activation_fn", "mlp.fc2"), seq, False),
    "vaultgemma": (tiny("vaultgemma"), PRE_NORM("input_layernorm", "self_attn", "self_attn.o_proj",
                                                "pre_feedforward_layernorm", "mlp", "mlp.act_fn", "mlp.down_proj"), seq, False),
    "apertus": (tiny("apertus"), APERTUS_TRUTH, seq, False),
    "persimmon": (tiny("persimmon"), PRE_NORM("input_layernorm", "self_attn", "self_attn.dense",
                                              "post_attention_layernorm", "mlp", "mlp.act", "mlp.dense_4h_to_h"), seq, False),
    "ctrl": (tiny("ctrl"), {**PRE_NORM("layernorm1", "dropout1", "multi_head_attention.dense", "layernorm2", "ffn",
                                       "ffn.1", "ffn.2"), "mlp_output": ("dropout2", "out")}, seq, False),
    # BioGPT and XGLM: OPT's block on [batch, seq, hidden]
    "biogpt": (tiny("biogpt"), FAIRSEQ, seq, False),
    "xglm": (tiny("xglm"), FAIRSEQ, seq, False),
    "phi3": (tiny("phi3"), {**PRE_NORM("input_layernorm", "resid_attn_dropout", "self_attn.o_proj",
                                       "post_attention_layernorm", "mlp", "mlp.activation_fn", "mlp.down_proj"),
                            "mlp_output": ("resid_mlp_dropout", "out")}, seq, False),
    # Gemma-2/3 and OLMo-2/3: the contributions are the outputs of the norms after the sublayers.
    "gemma2": (tiny("gemma2"), SANDWICH, seq, False),
    "gemma3": (tiny("gemma3_text"), SANDWICH, seq, False),
    "olmo2": (tiny("olmo2"), NO_PRE_NORM, seq, False),
    "olmo3": (tiny("olmo3"), NO_PRE_NORM, seq, False),
    "gemma3_image_text": (tiny("gemma3"), SANDWICH, seq, False),
    "glm4": (tiny("glm4"), GLM4, seq, False),
    "kolibri1": (tiny("kolibri1"), {**GLM4, "mlp_activation": None, "mlp_neurons": None}, seq, False),
    "beam": (tiny("beam"), lambda i: SANDWICH if i == 0 else SANDWICH_ROUTED, beam, False),  # dense, sparse, sparse
    "afmoe": (tiny("afmoe"), lambda i: AFMOE if i == 0 else {**AFMOE, "mlp_activation": None, "mlp_neurons": None},
              seq, False),  # num_dense_layers=1
    "flex_olmo": (tiny("flex_olmo"), {**NO_PRE_NORM, "mlp_activation": None, "mlp_neurons": None}, seq, False),
    # Granite's block adds each sublayer's output times its residual multiplier: the contributions are the products
    "granite": (tiny("granite"), SCALED(LLAMA), seq, False),
    "granitemoe": (tiny("granitemoe"), SCALED({**PRE_NORM("input_layernorm", "self_attn", "self_attn.o_proj",
                                                          "post_attention_layernorm", "block_sparse_moe", None, None),
                                               "mlp_activation": None, "mlp_neurons": None}), seq, False),
    "minicpm3": (tiny("minicpm3"), SCALED(LLAMA, "residual_scale"), seq, False),
    "hyperclovax": (tiny("hyperclovax"), SCALED({**LLAMA, "attention_output": ("post_norm1", "out"),
                                                 "mlp_output": ("post_norm2", "out")}), seq, False),
    # Gemma-4: per-layer input branch P and the block's layer_scalar (0.7 in the tests); MoE beside the MLP.
    "gemma4": (tiny("gemma4_text"), {**SANDWICH_ROUTED, "P": ("post_per_layer_input_norm", "out")}, gemma4, False),
    "gemma4_dense": (tiny("gemma4_text", enable_moe_block=False, hidden_size_per_layer_input=0), SANDWICH,
                     lambda x, a, m, e: ((x + a) + m) * e["block"].layer_scalar, False),
    "doge": (tiny("doge"), LLAMA, doge, False),
    "doge_moe": (tiny("doge", is_moe=True, num_experts=16, num_experts_per_tok=4), ROUTED, doge, False),
    "zaya": (tiny("zaya"), {**ROUTED, "layer_mid": ("post_attention_residual_scale", "out")}, zaya, True),
    "deepseek_v4": (tiny("deepseek_v4"), {
        **ROUTED, "attention_premix": ("self_attn.o_a_proj", "in"), "layer_mid": ("ffn_hc", "in"),
        "attn_post": ("attn_hc", "out"), "attn_comb": ("attn_hc", "out1"),
        "ffn_post": ("ffn_hc", "out"), "ffn_comb": ("ffn_hc", "out1")}, hyper_connections, False),
    # HY-V4: per-stream weights, no mixing matrix; the streams are the residual, added in float32
    "hy_v4": (tiny("hy_v4"), lambda i: {**(LLAMA if i == 0 else ROUTED), "layer_mid": ("ffn_hc", "in"),
                                        "attn_post": ("attn_hc", "out"), "ffn_post": ("ffn_hc", "out")},
              broadcast_streams, True),
    "mixtral": (tiny("mixtral"), ROUTED, seq, False),
    # attention_premix is the attention function's output (each slot's), which no module returns: it is compared with
    # transformers' own attention function in tests/families/test_attention.py
    "jetmoe": (tiny("jetmoe"), {name: where for name, where in PRE_NORM(
        "input_layernorm", "self_attention", None, "post_attention_layernorm", "mlp", None, None).items()
        if name != "attention_premix"} | {"mlp_activation": None, "mlp_neurons": None}, seq, False),
    "olmoe": (tiny("olmoe"), ROUTED, seq, False),
    "gpt_oss": (tiny("gpt_oss"), ROUTED, seq, False),
    "qwen2_moe": (tiny("qwen2_moe"), lambda i: LLAMA if i == 1 else ROUTED, seq, False),  # mlp_only_layers=[1]
    "qwen3_moe": (tiny("qwen3_moe"), lambda i: ROUTED if i == 1 else LLAMA, seq, False),  # decoder_sparse_step=2
    "llama4": (tiny("llama4_text"), lambda i: LLAMA4_ROUTED if i == 1 else LLAMA4_DENSE, seq, False),  # moe_layers=[1]
    "deepseek_v3": (tiny("deepseek_v3"), lambda i: LLAMA if i == 0 else ROUTED, seq, False),  # first_k_dense=1
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])


def first(x):
    return x[0] if isinstance(x, tuple) else x


def hook_capture(hf_model, truth, ids):
    """Run the plain HF model with forward hooks; return {(layer, value): tensor} and the logits."""
    captured, handles = {}, []
    for i, block in enumerate(hf_model.base_model_blocks):
        for name, where in truth(i).items():
            if where is None:
                continue
            path, side, *scale = where
            module = block.get_submodule(path) if path else block
            factor = getattr(block, scale[0]) if scale else None

            def hook(mod, args, kwargs, out=None, key=(i, name), side=side, factor=factor):
                if key in captured:
                    return
                if side == "in":
                    tensor = args[0] if args else kwargs["hidden_states"]
                else:
                    tensor = out[int(side[3:])] if side[3:] else first(out)
                if factor is not None:  # the product the block's code adds to the stream
                    tensor = tensor * factor
                captured[key] = tensor.detach().clone()  # a clone: later in-place adds must not change it

            if side == "in":
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(
                    lambda m, a, k, o, hook=hook: hook(m, a, k, o), with_kwargs=True))
    try:
        with torch.no_grad():
            logits = hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        for h in handles:
            h.remove()
    return captured, logits


def make(case, dtype):
    config_factory, truth, formula, is_tuple = CASES[case]
    truth = truth if callable(truth) else (lambda i, truth=truth: truth)
    hf_model = build_tiny(config_factory(), dtype)
    model = StandardizedTransformer(hf_model, tokenizer=tiny_tokenizer())
    hf_model.base_model_blocks = model.layers._module  # the ModuleList, for the hooks
    return model, hf_model, truth, formula, is_tuple


def read_all(model, ids):
    """Every available value of every block, read in one trace in order(i) order."""
    saved = {}
    with torch.no_grad(), model.trace(ids):
        for i in range(model.num_layers):
            for key in model.order(i, aliases=True):
                owner, _, name = key.rpartition(".")
                envoy = model.layers[i] if not owner else getattr(model.layers[i], owner)
                saved[(i, name)] = getattr(envoy, name).save()
        logits = model.logits.save()
    return saved, logits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_values_equal_hooks_and_identity_holds(case, dtype):
    model, hf_model, truth, formula, is_tuple = make(case, dtype)
    expected, saved, logits = hooks_and_reads(model, hf_model, truth, IDS)
    for i in range(model.num_layers):
        extras = {"block": hf_model.base_model_blocks[i]}
        for name, where in truth(i).items():
            if name not in BY_NAME:  # an extra location some identity needs
                extras[name] = expected[(i, name)]
                continue
            if where is None:
                assert name not in {k.rpartition(".")[2] for k in model.order(i)}
                continue
            got, want = saved[(i, name)], expected[(i, name)]
            if want.dim() == 2:  # OPT's flattened MLP tensors
                want = want.view(*IDS.shape, -1)
            if name == "attention_premix":  # [batch, seq, (groups,) width] per head
                assert got.shape == (*IDS.shape, model.num_heads, want[0, 0].numel() // model.num_heads)
                want = want.reshape(got.shape)
            assert torch.equal(got, want), f"layer {i} {name}"
        x, a, m, y = (saved[(i, n)] for n in ("layer_input", "attention_output", "mlp_output", "layer_output"))
        assert a.shape == m.shape == (2, 7, model.hidden_size)
        assert x.shape == y.shape and x.shape[:2] == (2, 7) and x.shape[-1] == model.hidden_size
        assert torch.equal(formula(x, a, m, extras), y), f"layer {i}: identity"
        if i + 1 < model.num_layers:
            assert torch.equal(y, expected[(i + 1, "layer_input")])
        if case in CUSTOM_MID:
            assert torch.equal(saved[(i, "layer_mid")], CUSTOM_MID[case](x, a, extras["block"]))
        if case in CUSTOM_IDENTITY:
            continue
        if truth(i)["layer_mid"] is not None:
            assert torch.equal(saved[(i, "layer_mid")], x + a)
        # the plain sum: exact on a sequential block, one ulp of the dtype on a parallel one
        plain = x + a + m
        ulp = torch.finfo(dtype).eps * y.abs().clamp_min(1)
        assert ((plain - y).abs() <= ulp).all()


def hooks_and_reads(model, hf_model, truth, ids):
    """The plain model's hook captures and the standard names' reads of ``ids``, once both runs are seen to give the
    same logits: ``(expected, saved, logits)``."""
    expected, expected_logits = hook_capture(hf_model, truth, ids)
    saved, logits = read_all(model, ids)
    assert torch.equal(logits, expected_logits)
    return expected, saved, logits


def assert_placed_as_hooks(saved, expected, at, layers):
    """Each catalog value a block's truth places equals the hooks' tensor (in its shape), and each it marks None
    was not read (the spec has it unavailable); a truth's other entries are places an identity needs."""
    for i in range(layers):
        for name, where in at(i).items():
            if name not in BY_NAME:
                continue
            if where is None:
                assert (i, name) not in saved, f"layer {i}: {name} should be unavailable"
                continue
            got, want = saved[(i, name)], expected[(i, name)]
            assert torch.equal(got, want.reshape(got.shape)), f"layer {i} {name}"


def register_edit(hf_model, module, side, edit):
    """A hook that applies ``edit`` to the module's input or output tensor (the first element of a tuple); a side
    ``"out*r"`` (``module_of``'s, for a value the block multiplies by ``r``) edits the product the block adds and
    hands the module the changed elements divided by ``r``, the others as they were (plus a zero through which the
    gradient reaches the product)."""
    side, _, factor = side.partition("*")
    if factor:
        edit = scaled_edit(edit, float(factor))
    if side == "in":
        def pre(mod, args, kwargs):
            if args:
                return (edit(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": edit(kwargs["hidden_states"])}
        return module.register_forward_pre_hook(pre, with_kwargs=True)

    def post(mod, args, out):
        return (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out)
    return module.register_forward_hook(post)


def run_with_hook(hf_model, module, side, edit, ids=IDS):
    """Ground truth for an edit: the HF model's logits with a hook that applies ``edit`` to the tensor."""
    handle = register_edit(hf_model, module, side, edit)
    try:
        with torch.no_grad():
            return hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        handle.remove()




def module_of(hf_model, truth, layer, name):
    path, side, *scale = truth(layer)[name]
    block = hf_model.base_model_blocks[layer]
    if scale:
        side = f"{side}*{getattr(block, scale[0])!r}"
    return (block.get_submodule(path) if path else block), side


@pytest.mark.parametrize("case", CASES)
def test_edits_and_assignments_reach_the_logits(case):
    model, hf_model, truth, _, is_tuple = make(case, torch.float32)
    with torch.no_grad(), model.trace(IDS):
        clean = model.logits.save()

    def zero_last(t):
        t = t.clone()
        t[:, -1] = 0
        return t

    # in place on a contribution, and an assignment of the other
    with torch.no_grad(), model.trace(IDS):
        model.layers[1].self_attn.attention_output[:, -1] = 0
        model.layers[1].mlp.mlp_output = model.layers[1].mlp.mlp_output * 0.5
        edited = model.logits.save()
    handle = register_edit(hf_model, *module_of(hf_model, truth, 1, "attention_output"), zero_last)
    try:
        expected = run_with_hook(hf_model, *module_of(hf_model, truth, 1, "mlp_output"), lambda t: t * 0.5)
    finally:
        handle.remove()
    assert torch.equal(edited, expected)
    assert not torch.equal(edited, clean)

    # assignment of a block output: the tuple is kept for the next block
    with torch.no_grad(), model.trace(IDS):
        model.layers[0].layer_output = model.layers[0].layer_output * 2
        raw = model.layers[0].output.save()
        doubled = model.logits.save()
    assert isinstance(raw, tuple) == is_tuple
    assert torch.equal(doubled, run_with_hook(hf_model, *module_of(hf_model, truth, 0, "layer_output"), lambda t: t * 2))

    # assignment of an input, and a single head zeroed in place through the per-head view
    if "attention_premix" not in truth(1):  # routed heads (JetMoE): no module to hook, edited in test_attention.py
        return
    with torch.no_grad(), model.trace(IDS):
        model.layers[1].layer_input = model.layers[1].layer_input * 0.5
        model.layers[1].self_attn.attention_premix[:, :, 0] = 0
        both = model.logits.save()
    o_proj, _ = module_of(hf_model, truth, 1, "attention_premix")
    block1 = hf_model.base_model_blocks[1]
    config = hf_model.config.get_text_config()
    head_dim = getattr(config, "v_head_dim", None) or getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)

    def zero_head(t):
        t = t.clone()
        t.view(*t.shape[:2], -1)[..., :head_dim] = 0  # head 0: the first head_dim features of each token
        return t

    handle = block1.register_forward_pre_hook(
        lambda mod, args, kwargs: ((args[0] * 0.5, *args[1:]), kwargs), with_kwargs=True)
    try:
        expected = run_with_hook(hf_model, o_proj, "in", zero_head)
    finally:
        handle.remove()
    assert torch.equal(both, expected)


@pytest.mark.parametrize("case", ["gpt2", "gpt_neox_parallel", "bloom"])
def test_order_is_the_forward_order(case):
    model, *_ = make(case, torch.float32)
    order = model.order(1)
    keys = list(order)
    assert list(order.values()) == sorted(order.values())

    def read(key):
        owner, _, name = key.rpartition(".")
        return getattr(model.layers[1] if not owner else getattr(model.layers[1], owner), name)

    for earlier, later in zip(keys, keys[1:]):
        if order[earlier] == order[later]:
            continue
        with model.trace(IDS):  # forward order works
            read(earlier).save()
            read(later).save()
        with pytest.raises(OutOfOrderError):
            with model.trace(IDS):
                read(later).save()
                read(earlier).save()


def test_out_of_order_read_raises():
    model, *_ = make("llama", torch.float32)
    with pytest.raises(OutOfOrderError, match=r"layers\[1\]\.layer_input was requested.*model\.order\(1\)"):
        with model.trace(IDS):
            model.layers[1].mlp.mlp_output.save()
            model.layers[1].layer_input.save()


@pytest.mark.parametrize("case", ["gptj", "gpt_neox_parallel"])
def test_unavailable_value_raises_with_its_reason(case):
    model, *_ = make(case, torch.float32)
    assert not hasattr(model.layers[0], "layer_mid")
    with pytest.raises(ValueUnavailable, match=r"'layer_mid' is unavailable on GPT-(J|NeoX): a parallel block"):
        with model.trace(IDS):
            model.layers[0].layer_mid.save()
    info = model.availability(0)
    assert not info["layer_mid"].available and "parallel" in info["layer_mid"].reason
    assert info["mlp.mlp_output"].available
    assert "layer_mid" not in model.order(0)
    # the model is still usable after the error
    with model.trace(IDS):
        out = model.layers[0].layer_output.save()
    assert out.shape == (2, 7, model.hidden_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_check_identity_passes_on_every_family(case, dtype):
    from nnterp.core.validation import check_identity

    model, *_ = make(case, dtype)
    results = check_identity(model)
    assert len(results) == model.num_layers and all(r.exact for r in results), [str(r) for r in results]


def test_check_identity_catches_a_wrong_spec():
    import dataclasses

    from nnterp.core.validation import check_identity

    model, *_ = make("gpt2", torch.float32)
    right = model._nnterp_blocks[1]
    wrong = dataclasses.replace(right, values={**right.values, "mlp_output": right.values["mlp_input"]})
    model._nnterp_blocks = (model._nnterp_blocks[0], wrong, *model._nnterp_blocks[2:])
    results = check_identity(model)
    assert results[0].exact and not results[1].exact and results[1].max_abs_diff > 0
    assert "MISMATCH" in str(results[1])


def test_order_differs_between_blocks_of_one_model():
    model, *_ = make("deepseek_v3", torch.float32)  # block 0 dense, the others routed
    assert "mlp.mlp_activation" in model.order(0) and "mlp.mlp_activation" not in model.order(1)
    with pytest.raises(ValueUnavailable, match="routed mixture of experts"):
        with model.trace(IDS):
            model.layers[1].mlp.mlp_activation.save()


def test_values_at_one_location_share_a_rank():
    model, *_ = make("olmo2", torch.float32)  # layer_mid and mlp_input are both the MLP's input
    order = model.order(0)
    assert order["layer_mid"] == order["mlp_input"]
    assert "attention_norm_output" not in order
    model, *_ = make("gptj", torch.float32)  # one norm feeds both sublayers
    assert model.order(0)["mlp_norm_output"] == model.order(0)["attention_norm_output"]


def test_falcon_parallel_mlp_output_is_not_the_in_place_sum():
    model, hf_model, *_ = make("falcon_7b_parallel", torch.float32)
    with torch.no_grad(), model.trace(IDS):
        x = model.layers[0].layer_input.save()
        a = model.layers[0].self_attn.attention_output.save()
        m = model.layers[0].mlp.mlp_output.save()
        raw = model.layers[0].mlp.output.save()  # the model's own tensor, which becomes m + a in place
        y = model.layers[0].layer_output.save()
    assert torch.equal(raw, m + a) and not torch.equal(m, raw)
    assert torch.equal((m + a) + x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_project_on_vocab_of_the_last_block_is_the_logits(case, dtype):
    model, *_ = make(case, dtype)
    with torch.no_grad(), model.trace(IDS):
        last = model.layers[-1].layer_output.save()
        logits = model.logits.save()
    with torch.no_grad():
        assert torch.equal(model.project_on_vocab(last), logits)


@pytest.mark.parametrize("model_type", ["hy_v4"])
def test_the_default_config_miniature_is_proven(model_type):
    """The type's default config (four streams, top-k token selection wider than the prompt), shrunk."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from nnterp.core.validation import check_identity
    from nnterp.proof.miniature import miniature_config

    from ..conftest import perturb

    torch.manual_seed(0)
    config = miniature_config(CONFIG_MAPPING[model_type](num_hidden_layers=3))
    model = StandardizedTransformer(perturb(AutoModelForCausalLM.from_config(config)).eval(), tokenizer=tiny_tokenizer(256))
    assert all(result.exact for result in check_identity(model, IDS))
    model.enable_attention_values()  # the internals proven on the miniature too


@pytest.mark.parametrize("case", ["opt", "gpt2"])
def test_several_values_per_generation_step_are_the_hooks_at_each_step(case):
    """OPT reads its values through a view of the [batch * seq] stream it flattens, with [batch, seq] read once per
    call of a block: after a step's first value nnsight follows the model step by step, and each later value of the
    step must still be that step's (ground truth: the plain model's generate with hooks, per call)."""
    model, hf_model, truth, *_ = make(case, torch.float32)
    at = truth(1)
    names = ("mlp_input", "mlp_neurons", "layer_output")
    calls = {name: [] for name in names}
    handles = []
    for name in names:
        path, side = at[name]
        module = hf_model.base_model_blocks[1].get_submodule(path) if path else hf_model.base_model_blocks[1]
        if side == "in":
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, name=name: calls[name].append((a[0] if a else k["hidden_states"]).clone()),
                with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(lambda m, a, o, name=name: calls[name].append(first(o).clone())))
    ids = IDS[:1, :4]
    options = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    try:
        with torch.no_grad():
            hf_model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad(), model.generate(ids, **options) as tracer:
        read = nnsight.save([])
        for _ in tracer.iter[:3]:
            step = {"mlp_input": model.layers[1].mlp_input, "mlp_neurons": model.layers[1].mlp.mlp_neurons,
                    "layer_output": model.layers[1].layer_output}
            model.layers[2].layer_output.shape  # noqa: B018 - and a later block's value in the same step
            read.append(step)
    assert len(read) == 3
    for n, step in enumerate(read):
        for name in names:
            assert torch.equal(step[name], calls[name][n].reshape(step[name].shape)), (n, name)


@pytest.mark.parametrize("case", ["granite", "minicpm3", "hyperclovax"])
def test_the_proof_refuses_a_contribution_the_identity_scales(case):
    """A contribution is what the block adds: the spec that served the sublayer's own output and carried the factor
    in the identity (Granite's before) satisfies its identity bit for bit, and the proof still refuses it."""
    import dataclasses

    from nnterp.core.validation import problems_of
    from nnterp.spec.identity import A, M, Sum, X

    model, hf_model, *_ = make(case, torch.float32)
    assert problems_of(model) == []
    factor = next(view.attribute for view in model.location(1, "attention_output").views)
    right = model._nnterp_blocks[1]
    unscaled = {name: dataclasses.replace(right.values[name], views=()) for name in ("attention_output", "mlp_output")}
    wrong = dataclasses.replace(right, values={**right.values, **unscaled}, identity=Sum((X + A * factor) + M * factor))
    model._nnterp_blocks = tuple(wrong if i == 1 else b for i, b in enumerate(model._nnterp_blocks))
    model._unbind()
    problems = problems_of(model)
    assert problems and all(p.startswith("layer 1:") for p in problems)
    assert any(f"the identity adds attention_output * {factor}, not attention_output" in p for p in problems), problems
    assert not any("the identity fails" in p for p in problems)  # the old spec's arithmetic holds: only the contract
