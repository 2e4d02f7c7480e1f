"""StandardizedVLLM against transformers, one family per run: ``python check_vllm.py <family>`` in the vLLM venv
(tests/vllm/setup.sh) prints one JSON line of measurements, which tests/vllm/test_vllm.py asserts on.

A tiny model is built from a config (head_dim 32: vLLM's CPU attention has no smaller head size), saved with a
tokenizer to a temporary folder, and loaded twice: by transformers, read with plain forward hooks (the ground
truth), and by StandardizedVLLM (one engine for the family, in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import nnsight  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=128, bos_token_id=2, eos_token_id=2, pad_token_id=1)
# Granite's muP factors (the stream scaled at the embedding, each contribution by residual_multiplier)
MUP = dict(SMALL, embedding_multiplier=4.0, residual_multiplier=0.3, attention_multiplier=0.05, logits_scaling=3.0)
def scaled(model_type: str, **changed):
    """nnterp's tiny config of a family (its own choice of the family's options), at head size 32 and the width of
    the configs here (vLLM's CPU attention has no smaller head size)."""
    from nnterp.families import BY_MODEL_TYPE

    config = BY_MODEL_TYPE[model_type].tiny_config()
    for key, value in dict(hidden_size=128, head_dim=32, intermediate_size=256, vocab_size=128,
                           max_position_embeddings=128, bos_token_id=2, eos_token_id=2, pad_token_id=1).items():
        if key in config.to_dict():
            setattr(config, key, value)
    for key, value in changed.items():
        setattr(config, key, value)
    return config


_NEOX = dict(num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=4, vocab_size=128,
             max_position_embeddings=128, bos_token_id=2, eos_token_id=2, pad_token_id=1)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
    "gemma": lambda: transformers.GemmaConfig(**SMALL, head_dim=32),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=32, query_pre_attn_scalar=32),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2,
                                                  sliding_window=None),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=64, shared_expert_intermediate_size=128),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=64),
    "phi3": lambda: transformers.Phi3Config(**SMALL),
    "gemma3": lambda: transformers.Gemma3TextConfig(**SMALL, head_dim=32, query_pre_attn_scalar=32),
    "olmoe": lambda: transformers.OlmoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2),
    "stablelm": lambda: transformers.StableLmConfig(**SMALL),
    "glm4": lambda: transformers.Glm4Config(**SMALL, head_dim=32),
    "gptj": lambda: transformers.GPTJConfig(n_layer=3, n_embd=128, n_head=4, vocab_size=128, n_positions=128,
                                            rotary_dim=16, bos_token_id=2, eos_token_id=2, pad_token_id=1),
    "opt": lambda: transformers.OPTConfig(num_hidden_layers=3, hidden_size=128, ffn_dim=256, num_attention_heads=4,
                                          vocab_size=128, max_position_embeddings=128, word_embed_proj_dim=128,
                                          bos_token_id=2, eos_token_id=2, pad_token_id=1),
    "falcon": lambda: transformers.FalconConfig(num_hidden_layers=3, hidden_size=128, num_attention_heads=4,
                                                vocab_size=128, max_position_embeddings=128, parallel_attn=True,
                                                new_decoder_architecture=False, bias=False, alibi=False,
                                                bos_token_id=2, eos_token_id=2, pad_token_id=1),
    "bloom": lambda: transformers.BloomConfig(n_layer=3, hidden_size=128, n_head=4, vocab_size=128,
                                              bos_token_id=2, eos_token_id=2, pad_token_id=1),
    "cohere": lambda: transformers.CohereConfig(**SMALL, logit_scale=0.5),
    # vLLM's Cohere2 sliding layers attend to sliding_window + 1 positions, transformers' to sliding_window: the
    # engines compute different models past the window, so the window here is longer than the prompt and its steps
    "cohere2": lambda: transformers.Cohere2Config(**SMALL, logit_scale=0.5, sliding_window=16,
                                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "granite": lambda: transformers.GraniteConfig(**MUP),
    "granitemoe": lambda: transformers.GraniteMoeConfig(**MUP, num_local_experts=4, num_experts_per_tok=2),
    "hyperclovax": lambda: transformers.HyperCLOVAXConfig(**MUP),
    # the window lets the last position (6) see position 2 through the sliding block 2, which patching by hand moves
    "gpt_oss": lambda: transformers.GptOssConfig(**SMALL, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=5),
    "llama4_text": lambda: transformers.Llama4TextConfig(**{**SMALL, "intermediate_size": 64}, head_dim=32,
                                                         intermediate_size_mlp=256, num_local_experts=4,
                                                         # vLLM's chunks are whole KV blocks (128 tokens here)
                                                         interleave_moe_layer_step=2, attention_chunk_size=128,
                                                         no_rope_layer_interval=2),
    "gpt2": lambda: transformers.GPT2Config(n_layer=3, n_embd=128, n_head=4, vocab_size=128, n_positions=128,
                                            bos_token_id=2, eos_token_id=2, pad_token_id=1),
    # vLLM's Transformers backend (nnterp/vllm/backend.py)
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**_NEOX),
    "gpt_neox_sequential": lambda: transformers.GPTNeoXConfig(**_NEOX, use_parallel_residual=False),
    "olmo": lambda: transformers.OlmoConfig(**SMALL),
    "flex_olmo": lambda: transformers.FlexOlmoConfig(**SMALL, num_experts=4, num_experts_per_tok=2),
    "olmo2": lambda: transformers.Olmo2Config(**SMALL),
    "olmo3": lambda: transformers.Olmo3Config(**SMALL),
    "glm": lambda: transformers.GlmConfig(**SMALL, head_dim=32),
    "starcoder2": lambda: transformers.Starcoder2Config(**SMALL),
    "smollm3": lambda: transformers.SmolLM3Config(**SMALL),
    "vaultgemma": lambda: transformers.VaultGemmaConfig(**SMALL, head_dim=32, query_pre_attn_scalar=32),
    "phi": lambda: transformers.PhiConfig(**_NEOX, partial_rotary_factor=0.5),
    "persimmon": lambda: transformers.PersimmonConfig(**_NEOX),
    "biogpt": lambda: transformers.BioGptConfig(**_NEOX),
    "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(n_layer=3, n_embd=128, n_head=4, vocab_size=128,
                                                         n_positions=128, bos_token_id=2, eos_token_id=2,
                                                         pad_token_id=1),
    "codegen": lambda: transformers.CodeGenConfig(n_layer=3, n_embd=128, n_head=4, vocab_size=128, n_positions=128,
                                                  n_ctx=128, rotary_dim=16, bos_token_id=2, eos_token_id=2,
                                                  pad_token_id=1),
    "nanochat": lambda: transformers.NanoChatConfig(**SMALL),
    # types nnterp files under Llama that vLLM runs through the backend
    "helium": lambda: transformers.HeliumConfig(**SMALL, head_dim=32),
    "seed_oss": lambda: transformers.SeedOssConfig(**SMALL, head_dim=32),
    "ministral": lambda: transformers.MinistralConfig(**SMALL, head_dim=32),
    "cwm": lambda: transformers.CwmConfig(**SMALL, head_dim=32),
    "hunyuan_v1_dense": lambda: transformers.HunYuanDenseV1Config(**SMALL, head_dim=32),
    "arcee": lambda: transformers.ArceeConfig(**SMALL, head_dim=32),
    "jais2": lambda: transformers.Jais2Config(**SMALL, head_dim=32),
    # sliding attention (window 6: the patched position stays in the last one's window)
    "kolibri1": lambda: scaled("kolibri1", sliding_window=6),
    # refused (nnterp/vllm/backend.py's REJECTED: vLLM computes another model, or refuses it): kept to measure
    # again on another vLLM (StandardizedVLLM refuses them before any engine starts)
    "doge": lambda: transformers.DogeConfig(**SMALL, keep_window_size=2048),
    "dory": lambda: scaled("dory"),
    "beam": lambda: scaled("beam"),
    "zaya": lambda: scaled("zaya"),
    "jetmoe": lambda: transformers.JetMoeConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                                num_attention_heads=4, num_key_value_heads=2, kv_channels=32,
                                                num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                                                max_position_embeddings=128, bos_token_id=2, eos_token_id=2,
                                                pad_token_id=1),
    "xglm": lambda: transformers.XGLMConfig(d_model=128, ffn_dim=256, num_layers=3, attention_heads=4, vocab_size=128,
                                            max_position_embeddings=128, bos_token_id=2, eos_token_id=2,
                                            pad_token_id=1),
    "gpt_neo": lambda: transformers.GPTNeoConfig(num_layers=3, hidden_size=128, num_heads=4, vocab_size=128,
                                                 max_position_embeddings=128, attention_types=[[["global"], 3]],
                                                 bos_token_id=2, eos_token_id=2, pad_token_id=1),
}
# the transformers modules each standard value is read at (relative to a block): (path, side, element)
LLAMA_HOOKS = {
    "layer_input": ("", "input"), "attention_norm_output": ("input_layernorm", "output"),
    "attention_premix": ("self_attn.o_proj", "input"), "attention_output": ("self_attn", "output"),
    "layer_mid": ("post_attention_layernorm", "input"), "mlp_norm_output": ("post_attention_layernorm", "output"),
    "mlp_input": ("mlp", "input"), "mlp_neurons": ("mlp.down_proj", "input"), "mlp_output": ("mlp", "output"),
    "layer_output": ("", "output"),
}
GPT2_HOOKS = {
    "layer_input": ("", "input"), "attention_norm_output": ("ln_1", "output"),
    "attention_premix": ("attn.c_proj", "input"), "attention_output": ("attn", "output"),
    "layer_mid": ("ln_2", "input"), "mlp_norm_output": ("ln_2", "output"), "mlp_input": ("mlp", "input"),
    "mlp_activation": ("mlp.act", "output"), "mlp_neurons": ("mlp.c_proj", "input"), "mlp_output": ("mlp", "output"),
    "layer_output": ("", "output"),
}
GEMMA2_HOOKS = {**LLAMA_HOOKS, "attention_output": ("post_attention_layernorm", "output"),
                "layer_mid": ("pre_feedforward_layernorm", "input"),
                "mlp_norm_output": ("pre_feedforward_layernorm", "output"),
                "mlp_output": ("post_feedforward_layernorm", "output")}
GLM4_HOOKS = {**LLAMA_HOOKS, "attention_output": ("post_self_attn_layernorm", "output"),
              "mlp_output": ("post_mlp_layernorm", "output")}
GPTJ_HOOKS = {  # in forward order: one norm's output feeds both sublayers
    "layer_input": ("", "input"), "attention_norm_output": ("ln_1", "output"), "mlp_norm_output": ("ln_1", "output"),
    "attention_premix": ("attn.out_proj", "input"), "attention_output": ("attn", "output"),
    "mlp_input": ("mlp", "input"), "mlp_activation": ("mlp.fc_out", "input"),
    "mlp_neurons": ("mlp.fc_out", "input"), "mlp_output": ("mlp", "output"), "layer_output": ("", "output"),
}
OPT_HOOKS = {
    "layer_input": ("", "input"), "attention_norm_output": ("self_attn_layer_norm", "output"),
    "attention_premix": ("self_attn.out_proj", "input"), "attention_output": ("self_attn", "output"),
    "layer_mid": ("final_layer_norm", "input"), "mlp_norm_output": ("final_layer_norm", "output"),
    "mlp_input": ("fc1", "input"), "mlp_activation": ("fc2", "input"), "mlp_neurons": ("fc2", "input"),
    "mlp_output": ("fc2", "output"), "layer_output": ("", "output"),
}
FALCON_HOOKS = {  # in forward order: one norm's output feeds both sublayers
    "layer_input": ("", "input"), "attention_norm_output": ("input_layernorm", "output"),
    "mlp_norm_output": ("input_layernorm", "output"), "attention_premix": ("self_attention.dense", "input"),
    "attention_output": ("self_attention", "output"), "mlp_input": ("mlp", "input"),
    "mlp_activation": ("mlp.dense_4h_to_h", "input"), "mlp_neurons": ("mlp.dense_4h_to_h", "input"),
    "mlp_output": ("mlp", "output"), "layer_output": ("", "output"),
}
BLOOM_HOOKS = {  # transformers' attention and MLP add the residual inside: their contributions are dense outputs
    "layer_input": ("", "input"), "attention_norm_output": ("input_layernorm", "output"),
    "attention_premix": ("self_attention.dense", "input"), "attention_output": ("self_attention.dense", "output"),
    "layer_mid": ("post_attention_layernorm", "input"), "mlp_norm_output": ("post_attention_layernorm", "output"),
    "mlp_input": ("mlp", "input"), "mlp_activation": ("mlp.dense_4h_to_h", "input"),
    "mlp_neurons": ("mlp.dense_4h_to_h", "input"), "mlp_output": ("mlp.dense_4h_to_h", "output"),
    "layer_output": ("", "output"),
}
COHERE_HOOKS = {  # in forward order: one norm's output feeds both sublayers
    "layer_input": ("", "input"), "attention_norm_output": ("input_layernorm", "output"),
    "mlp_norm_output": ("input_layernorm", "output"), "attention_premix": ("self_attn.o_proj", "input"),
    "attention_output": ("self_attn", "output"), "mlp_input": ("mlp", "input"),
    "mlp_neurons": ("mlp.down_proj", "input"), "mlp_output": ("mlp", "output"), "layer_output": ("", "output"),
}
# a third element: the block attribute the block's code multiplies the tensor by before adding it to the stream
GRANITE_HOOKS = {**LLAMA_HOOKS, "attention_output": ("self_attn", "output", "residual_multiplier"),
                 "mlp_output": ("mlp", "output", "residual_multiplier")}
GRANITE_MOE_HOOKS = {**GRANITE_HOOKS, "mlp_input": ("block_sparse_moe", "input"),
                     "mlp_output": ("block_sparse_moe", "output", "residual_multiplier")}
HYPERCLOVAX_HOOKS = {**GRANITE_HOOKS, "attention_output": ("post_norm1", "output", "residual_multiplier"),
                     "mlp_output": ("post_norm2", "output", "residual_multiplier")}
LLAMA4_HOOKS = {**LLAMA_HOOKS, "mlp_input": ("feed_forward", "input"), "mlp_output": ("feed_forward", "output")}
del LLAMA4_HOOKS["mlp_neurons"]
NEOX_HOOKS = {  # transformers' GPT-NeoX: parallel (Pythia's) or sequential
    "layer_input": ("", "input"), "attention_norm_output": ("input_layernorm", "output"),
    "attention_premix": ("attention.dense", "input"), "attention_output": ("attention", "output"),
    "layer_mid": ("post_attention_layernorm", "input"), "mlp_norm_output": ("post_attention_layernorm", "output"),
    "mlp_input": ("mlp", "input"), "mlp_activation": ("mlp.act", "output"),
    "mlp_neurons": ("mlp.dense_4h_to_h", "input"), "mlp_output": ("mlp", "output"), "layer_output": ("", "output"),
}
POST_NORM_HOOKS = {  # OLMo-2's: the norms after the sublayers, none before
    "layer_input": ("", "input"), "attention_premix": ("self_attn.o_proj", "input"),
    "attention_output": ("post_attention_layernorm", "output"), "layer_mid": ("mlp", "input"),
    "mlp_input": ("mlp", "input"), "mlp_neurons": ("mlp.down_proj", "input"),
    "mlp_output": ("post_feedforward_layernorm", "output"), "layer_output": ("", "output"),
}
PHI_HOOKS = {  # in forward order: one norm's output feeds both sublayers
    "layer_input": ("", "input"), "attention_norm_output": ("input_layernorm", "output"),
    "mlp_norm_output": ("input_layernorm", "output"), "attention_premix": ("self_attn.dense", "input"),
    "attention_output": ("self_attn", "output"), "mlp_input": ("mlp", "input"),
    "mlp_activation": ("mlp.activation_fn", "output"), "mlp_neurons": ("mlp.fc2", "input"),
    "mlp_output": ("mlp", "output"), "layer_output": ("", "output"),
}


def with_activation(hooks: dict, path: str, **changed) -> dict:
    """``hooks`` (in forward order) with ``changed`` places, and the activation's output at ``path`` read just before
    the down projection's input."""
    out = {}
    for name, place in {**hooks, **changed}.items():
        if name == "mlp_neurons":
            out["mlp_activation"] = (path, "output")
        out[name] = place
    return out


BIOGPT_HOOKS = with_activation(OPT_HOOKS, "activation_fn")
HOOKS = {"gpt_neox": {k: v for k, v in NEOX_HOOKS.items() if k != "layer_mid"}, "gpt_neox_sequential": NEOX_HOOKS,
         "olmo2": POST_NORM_HOOKS, "olmo3": POST_NORM_HOOKS, "glm": with_activation(LLAMA_HOOKS, "mlp.activation_fn"),
         "starcoder2": with_activation(LLAMA_HOOKS, "mlp.act", mlp_neurons=("mlp.c_proj", "input")),
         "vaultgemma": {**LLAMA_HOOKS, "attention_output": ("self_attn", "output"),
                        "layer_mid": ("pre_feedforward_layernorm", "input"),
                        "mlp_norm_output": ("pre_feedforward_layernorm", "output")},
         "doge": LLAMA_HOOKS, "flex_olmo": {k: v for k, v in POST_NORM_HOOKS.items() if k != "mlp_neurons"},
         "jetmoe": {k: v for k, v in LLAMA_HOOKS.items() if k not in ("attention_premix", "mlp_neurons")} | {
             "attention_output": ("self_attention", "output")}, "xglm": BIOGPT_HOOKS,
         "nanochat": with_activation(LLAMA_HOOKS, "mlp.activation_fn", mlp_neurons=("mlp.fc2", "input")),
         "kolibri1": {k: v for k, v in GLM4_HOOKS.items() if k != "mlp_neurons"},
         "dory": with_activation(GEMMA2_HOOKS, "mlp.act_fn"), "beam": with_activation(GEMMA2_HOOKS, "mlp.act_fn"),
         "zaya": {k: v for k, v in LLAMA_HOOKS.items() if k != "mlp_neurons"} | {
             "layer_mid": ("post_attention_residual_scale", "output")},
         "arcee": with_activation(LLAMA_HOOKS, "mlp.act_fn"), "jais2": with_activation(LLAMA_HOOKS, "mlp.act_fn"),
         "phi": PHI_HOOKS, "codegen": GPTJ_HOOKS, "gpt_bigcode": GPT2_HOOKS, "biogpt": BIOGPT_HOOKS,
         "persimmon": with_activation(LLAMA_HOOKS, "mlp.act", attention_premix=("self_attn.dense", "input"),
                                      mlp_neurons=("mlp.dense_4h_to_h", "input")),
         "llama4_text": LLAMA4_HOOKS, "cohere": COHERE_HOOKS, "cohere2": COHERE_HOOKS, "granite": GRANITE_HOOKS,
         "granitemoe": GRANITE_MOE_HOOKS, "hyperclovax": HYPERCLOVAX_HOOKS,
         "bloom": BLOOM_HOOKS, "falcon": FALCON_HOOKS, "opt": OPT_HOOKS, "gpt2": GPT2_HOOKS, "gemma2": GEMMA2_HOOKS,
         "gemma3": GEMMA2_HOOKS, "gptj": GPTJ_HOOKS, "glm4": GLM4_HOOKS}
# the values a block has where its module is (the catalog's WHERE_PRESENT), at transformers' modules, per type: the
# q/k norms (a fourth element "heads_first": the norm reads [batch, heads, seq, dim]), the router, the activation's
# input; the contributions before a sandwich block's norms are found below (the norm's input, else the contribution)
QK = {"query_norm_input": ("self_attn.q_norm", "input"), "query_norm_output": ("self_attn.q_norm", "output"),
      "key_norm_input": ("self_attn.k_norm", "input"), "key_norm_output": ("self_attn.k_norm", "output")}
QK_FIRST = {name: (path, side, None, "heads_first") for name, (path, side) in QK.items()}
PERSIMMON_QK = {name: (path.replace("_norm", "_layernorm"), side) for name, (path, side) in QK.items()}
ACT_IN = {"mlp_pre_activation": ("mlp.act_fn", "input"), "mlp_up_output": ("mlp.up_proj", "output")}
# Phi-3's and GLM-4's one gate-and-up projection, chunked: its output's second half (a fourth element "half1")
FUSED_UP = {"mlp_up_output": ("mlp.gate_up_proj", "output", None, "half1")}
WHERE_PRESENT = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "gemma", "gemma2", "stablelm", "cohere", "cohere2", "granite",
                     "hyperclovax", "olmo", "smollm3", "helium", "seed_oss", "ministral", "cwm",
                     "hunyuan_v1_dense", "vaultgemma"), ACT_IN),
    # no up projection: Arcee's and Jais-2's MLPs are not gated
    **dict.fromkeys(("arcee", "jais2"), {"mlp_pre_activation": ("mlp.act_fn", "input")}),
    "qwen3": {**QK, **ACT_IN}, "gemma3": {**QK_FIRST, **ACT_IN}, "qwen3_moe": {**QK, "router_logits": ("mlp.gate", "output")},
    "olmoe": {**QK, "router_logits": ("mlp.gate", "output")}, "mixtral": {"router_logits": ("mlp.gate", "output")},
    "qwen2_moe": {"router_logits": ("mlp.gate", "output")}, "gpt_oss": {"router_logits": ("mlp.router", "output")},
    "granitemoe": {"router_logits": ("block_sparse_moe.router", "output")},
    "phi3": {"mlp_pre_activation": ("mlp.activation_fn", "input"), **FUSED_UP},
    "glm4": {"mlp_pre_activation": ("mlp.activation_fn", "input"), **FUSED_UP}, "glm": {"mlp_pre_activation": ("mlp.activation_fn", "input"), **FUSED_UP},
    **dict.fromkeys(("gpt2", "gptj", "falcon", "gpt_bigcode", "codegen", "gpt_neox", "gpt_neox_sequential"),
                    {"mlp_pre_activation": ("mlp.act", "input")}),
    "opt": {"mlp_pre_activation": ("activation_fn", "input")}, "biogpt": {"mlp_pre_activation": ("activation_fn", "input")},
    "bloom": {"mlp_pre_activation": ("mlp.gelu_impl", "input")},
    "olmo2": {**QK, **ACT_IN}, "olmo3": {**QK, **ACT_IN}, "flex_olmo": QK,
    "kolibri1": QK_FIRST, "nanochat": {**QK_FIRST, "mlp_pre_activation": ("mlp.activation_fn", "input")},
    "persimmon": {**PERSIMMON_QK, "mlp_pre_activation": ("mlp.act", "input")},
    "starcoder2": {"mlp_pre_activation": ("mlp.act", "input")},
    "phi": {"mlp_pre_activation": ("mlp.activation_fn", "input")},
}


INTERNAL_NAMES = ("queries", "keys", "values", "attention_scores", "attention_probabilities")


def with_points(hooks: dict, family: str) -> dict:
    """``hooks`` with the family's ``WHERE_PRESENT`` places, in forward order: the q/k norms before the heads' output,
    the router and the activation's input before the activation, each contribution's value before its norm just
    before it (the norm's input, where the contribution is a norm's output; else the contribution's own place)."""
    extra = dict(WHERE_PRESENT.get(family, {}))
    for name in ("attention_output", "mlp_output"):
        if name in hooks:
            path, side, *rest = hooks[name]
            extra[f"{name}_before_norm"] = (path, "input") if "norm" in path.rpartition(".")[2] else hooks[name]
    anchors = {"attention_premix": ("query_norm_input", "query_norm_output", "key_norm_input", "key_norm_output"),
               "attention_output": ("attention_output_before_norm",),
               "mlp_activation": ("router_logits", "mlp_pre_activation", "mlp_up_output"),
               "mlp_neurons": ("router_logits", "mlp_pre_activation", "mlp_up_output"),
               "mlp_output": ("router_logits", "mlp_pre_activation", "mlp_up_output", "mlp_output_before_norm")}
    if "half1" in extra.get("mlp_up_output", ()):  # one gate-and-up projection: the up part exists before the gate's
        anchors = {key: tuple(sorted(names, key=("mlp_up_output",).count, reverse=True)) for key, names in anchors.items()}
    out: dict = {}
    for name, place in hooks.items():
        for before in anchors.get(name, ()):
            if before in extra and before not in out:
                out[before] = extra[before]
        out[name] = place
    return out


OWNER = {"attention_premix": "self_attn", "attention_output": "self_attn", "mlp_activation": "mlp",
         "mlp_neurons": "mlp", "mlp_output": "mlp", **{name: "self_attn" for name in QK},
         "attention_output_before_norm": "self_attn", "router_logits": "mlp", "mlp_pre_activation": "mlp",
         "mlp_up_output": "mlp",
         "mlp_output_before_norm": "mlp"}
PROMPT = [5, 17, 33, 9, 60, 41, 12]
OTHER = [7, 8, 99, 3]


def tokenizer():
    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2}
    while len(vocab) < 128:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="<eos>", bos_token="<eos>")


def build(family: str, folder: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # off the initial values (norm weights at 1, biases at 0)
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.eval().save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return model


def backbone(model):
    """The causal LM's backbone (transformer, model, gpt_neox, ...): its base model, or ``model`` where the class's
    base_model_prefix names none it has (Llama 4's text model says language_model)."""
    base = model.base_model
    return model.model if base is model else base


def blocks_of(model):
    base = backbone(model)
    if hasattr(base, "decoder"):
        return base.decoder.layers
    return base.h if hasattr(base, "h") else base.layers


def first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def hooked(model, ids, hooks, edit=None):
    """Transformers' logits at the last position, and every value of every block by plain hooks; ``edit`` =
    (layer, path, side, fn, stream) replaces that tensor by fn(tensor) (a hook's returned value; written into the
    tensor where it is the ``stream`` the block also keeps as its residual, which a returned value would not reach)."""
    seen, handles = {}, []
    for i, block in enumerate(blocks_of(model)):
        for name, (path, side, *factor) in hooks.items():
            try:
                module = block.get_submodule(path) if path else block
            except AttributeError:  # a value the family does not have (a mixture of experts' down projection)
                continue
            times = getattr(block, factor[0]) if factor and factor[0] else None
            heads_first, half = "heads_first" in factor, "half1" in factor

            def record(_module, args, kwargs_or_out, out=None, i=i, name=name, side=side, times=times,
                       heads_first=heads_first, half=half):
                tensor = (args[0] if args else kwargs_or_out["hidden_states"]) if side == "input" else first(out)
                tensor = tensor.transpose(1, 2) if heads_first else tensor  # [batch, seq, heads, dim]
                tensor = tensor.chunk(2, dim=-1)[1] if half else tensor
                seen[(i, name)] = (tensor.detach() if times is None else tensor.detach() * times).clone()
            if side == "input":
                handles.append(module.register_forward_pre_hook(lambda m, a, k, f=record: f(m, a, k), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(lambda m, a, o, f=record: f(m, a, None, o)))
    if edit is not None:
        layer, (path, side, *factor), fn, stream = edit
        if "half1" in factor:  # the second half of the module's output alone
            whole = fn
            fn = lambda t: torch.cat([t.chunk(2, dim=-1)[0], whole(t.chunk(2, dim=-1)[1])], dim=-1)  # noqa: E731
        block = blocks_of(model)[layer]
        module = block.get_submodule(path) if path else block
        if factor and factor[0]:  # the edit is of the product the stream receives: the module's output, divided back
            times, unscaled = getattr(block, factor[0]), fn
            fn = lambda t: unscaled(t * times) / times  # noqa: E731
        if side == "output":
            def change(_m, _a, out):
                return (fn(out[0]), *out[1:]) if isinstance(out, tuple) else fn(out)
            handles.append(module.register_forward_hook(change))
        else:
            def change_in(_m, args, kwargs):
                if stream:  # the stream the block goes on with too (its residual): changed in place
                    tensor = args[0] if args else kwargs["hidden_states"]
                    tensor.copy_(fn(tensor.clone()))
                    return None
                if args:
                    return (fn(args[0]), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
            handles.append(module.register_forward_pre_hook(change_in, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits[:, -1:], seen


def readout(model, hidden):
    """Transformers' own readout of a stream: its final norm, its head, the final softcap (Gemma-2)."""
    base = backbone(model)
    base = getattr(base, "decoder", base)
    norm = next(getattr(base, name) for name in ("ln_f", "final_layer_norm", "norm", "final_layernorm", "layer_norm")
                if hasattr(base, name))
    logits = model.get_output_embeddings()(norm(hidden))
    if model.config.model_type == "granite" or model.config.model_type == "granitemoe":
        logits = logits / model.config.logits_scaling
    elif model.config.model_type == "hyperclovax":
        logits = logits * model.config.logits_scaling
    elif model.config.model_type.startswith("cohere"):
        logits = logits * model.config.logit_scale
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def greedy(model, ids, steps):
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-steps:]


def where(model, layer, name):
    block = model.layers[layer]
    owner = OWNER.get(name)
    return getattr(block, owner) if owner else block


def main(family: str) -> dict:
    from nnterp.vllm import StandardizedVLLM

    folder = tempfile.mkdtemp(prefix=f"nnterp-vllm-{family}-")
    hf = build(family, folder)
    hooks = with_points(HOOKS.get(family, LLAMA_HOOKS), family)
    if family == "bloom":  # vLLM's BLOOM uses the exact GELU, transformers' the tanh approximation: use vLLM's here
        for block in blocks_of(hf):
            block.mlp.gelu_impl = torch.nn.GELU()
    model = StandardizedVLLM(folder, dtype="float32", distributed_executor_backend="uni", max_model_len=128,
                             enable_prefix_caching=False)
    if model.vllm_family.batched:
        # vLLM's Transformers backend decorates transformers' backbone class itself for its compilation (the
        # class's __call__ then reads an attribute its own __init__ sets): the ground truth's instance, made before,
        # is told to run its forward as it is
        for module in hf.modules():
            module.__dict__.setdefault("do_not_compile", True)
    result: dict = {"key": family, "family": model.vllm_family.name, "num_layers": model.num_layers,
                    "hidden_size": model.hidden_size, "num_heads": model.num_heads, "vocab_size": model.vocab_size,
                    "repr_has_names": "layer_output" in repr(model) and "layers" in repr(model)}
    available = [name for name in hooks if model.availability(0)[OWNER.get(name, "block") + "." + name
                                                                  if name in OWNER else name].available]
    result["available"] = available
    result["missing"] = sorted(f"{OWNER[name]}.{name}" if name in OWNER else name for name in set(hooks) - set(available))
    # outside a trace: hasattr tells availability, and an available value says it holds a tensor inside one
    result["outside_a_trace"] = [hasattr(model.layers[0].self_attn, "attention_scores"),
                                 hasattr(model.layers[0], "layer_output"),
                                 "inside `with model.trace" in repr(model.layers[1].layer_output)]
    result["reasons"] = {key: entry.reason for key, entry in model.availability(0).items() if not entry.available}
    layers = range(model.num_layers)

    # every value of every block, in forward order, and the logits
    with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
        values = nnsight.save({})
        for i in layers:
            for name in available:
                values[f"{i}.{name}"] = getattr(where(model, i, name), name)  # no clone: what a read keeps
        logits = model.logits.save()
        probs = model.next_token_probs.save()
    ref_logits, ref = hooked(hf, PROMPT, hooks)
    diffs = {}
    for key, value in values.items():
        i, name = key.split(".", 1)
        expected = ref[(int(i), name)].reshape(value.shape)
        diffs[key] = float((value - expected).abs().max()) / max(1.0, float(expected.abs().max()))
    result["value_diffs"] = diffs
    result["shapes"] = {key: list(value.shape) for key, value in values.items() if key.startswith("0.")}
    result["logits_diff"] = float((logits - ref_logits).abs().max())
    result["logits_shape"] = list(logits.shape)
    result["probs_diff"] = float((probs - ref_logits[:, -1].softmax(-1)).abs().max())

    # edits, in place and assigned, against the same edit made by a plain hook on the transformers model
    direction = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(1))
    hf_paths = {"layer_output": ("", "output"), "mlp_output": hooks["mlp_output"], "layer_mid": hooks.get("layer_mid"),
                "layer_input": ("", "input"), "attention_output": hooks["attention_output"]}
    edits = {}
    for layer, name, how in [(0, "layer_output", "inplace"), (0, "layer_output", "assign"), (1, "layer_output", "assign"),
                             (model.num_layers - 1, "layer_output", "inplace"), (0, "mlp_output", "inplace"),
                             (1, "mlp_output", "assign"), (1, "layer_mid", "assign"), (1, "layer_mid", "inplace"),
                             (1, "layer_input", "assign"), (2, "attention_output", "inplace")]:
        if name not in available:
            continue
        with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
            owner = where(model, layer, name)
            if how == "inplace":
                getattr(owner, name)[:] += 3 * direction
            else:
                setattr(owner, name, getattr(owner, name) * 0.5 + 3 * direction)
            edited = model.logits.save()
        fn = (lambda t: t + 3 * direction) if how == "inplace" else (lambda t: t * 0.5 + 3 * direction)
        expected, _ = hooked(hf, PROMPT, hooks, edit=(layer, hf_paths[name], fn, name == "layer_mid"))
        edits[f"{layer}.{name}.{how}"] = {"diff": float((edited - expected).abs().max()),
                                          "moved": float((expected - ref_logits).abs().max())}
    # the values a block has where its module is: each edited in place (1.5 t + 0.3 |t|, elementwise, so the same on
    # any layout, and no affine map a norm after it would undo), against the same edit by a hook on transformers' module
    for name in ("query_norm_output", "key_norm_input", "attention_output_before_norm", "mlp_pre_activation",
                 "mlp_up_output", "mlp_output_before_norm"):
        if name not in available:
            continue
        with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
            value = getattr(where(model, 1, name), name)
            value[:] = value * 1.5 + 0.3 * value.abs()
            edited = model.logits.save()
        expected, _ = hooked(hf, PROMPT, hooks, edit=(1, hooks[name], lambda t: t * 1.5 + 0.3 * t.abs(), False))
        edits[f"1.{name}.inplace"] = {"diff": float((edited - expected).abs().max()),
                                      "moved": float((expected - ref_logits).abs().max())}
    # the router's logits edited: every token sent to expert 0 (vLLM's experts choose from the gate's output), against
    # transformers' router made to choose from the same edited logits (Mixtral's softmax, top k, renormalized)
    if "router_logits" in available and family == "mixtral":
        delta = torch.zeros(hf.config.num_local_experts)
        delta[0] = 8.0
        with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
            model.layers[1].mlp.router_logits[:] += delta
            edited = model.logits.save()
        router = blocks_of(hf)[1].get_submodule(hooks["router_logits"][0])

        def choose(module, args, out, delta=delta):
            logits = out[0] + delta
            top, index = torch.topk(torch.softmax(logits.float(), dim=-1), module.top_k, dim=-1)
            return logits, (top / top.sum(dim=-1, keepdim=True)).to(out[1].dtype), index
        handle = router.register_forward_hook(choose)
        try:
            expected, _ = hooked(hf, PROMPT, {})
        finally:
            handle.remove()
        edits["1.router_logits.inplace"] = {"diff": float((edited - expected).abs().max()),
                                            "moved": float((expected - ref_logits).abs().max())}
    result["edits"] = edits
    # every value served on vLLM is one compared above (the attention's internals below)
    result["unchecked"] = sorted(key for key, entry in model.availability(0).items() if entry.available
                                 and key.rpartition(".")[2] not in (*hooks, *INTERNAL_NAMES, "mixer_output"))

    # two invokes in one trace, prompts of different lengths
    with torch.no_grad(), model.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(PROMPT):
            a = model.layers[1].layer_output.clone().save()
            a_logits = model.logits.save()
        with tracer.invoke(OTHER):
            b = model.layers[1].layer_output.clone().save()
            b_logits = model.logits.save()
    _, ref_b = hooked(hf, OTHER, hooks)
    ref_b_logits, _ = hooked(hf, OTHER, hooks)
    result["invokes"] = {"shapes": [list(a.shape), list(b.shape)],
                         "a": float((a - ref[(1, "layer_output")]).abs().max()),
                         "b": float((b - ref_b[(1, "layer_output")]).abs().max()),
                         "a_logits": float((a_logits - ref_logits).abs().max()),
                         "b_logits": float((b_logits - ref_b_logits).abs().max())}

    # greedy generation, token for token
    steps = 8
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        out = tracer.result.save()
    result["generated"] = list(out.outputs[0].token_ids)
    result["expected_generated"] = greedy(hf, PROMPT, steps)

    # steering during greedy generation: a vector added to layer_output of two blocks at every step, against the
    # same addition by a forward hook in a greedy loop over transformers (every position steered once in both)
    rms = float(ref[(0, "layer_output")].pow(2).mean().sqrt())  # Gemma's stream is scaled by sqrt(hidden)
    toward = hf.get_output_embeddings().weight[40].detach()  # the head's row of token 40: a direction it reads
    vector = max(0.8, 2 * rms) * direction + rms * model.hidden_size ** 0.5 * toward / toward.norm()
    ids = model.steered_generate(PROMPT, [0, 1], vector, max_new_tokens=steps)
    handles = [blocks_of(hf)[i].register_forward_hook(
        lambda _m, _a, out: (out[0] + vector, *out[1:]) if isinstance(out, tuple) else out + vector) for i in (0, 1)]
    try:
        result["expected_steered"] = greedy(hf, PROMPT, steps)
    finally:
        for handle in handles:
            handle.remove()
    result["steered"] = ids[0, len(PROMPT):].tolist()
    result["steered_prompt"] = ids[0, :len(PROMPT)].tolist() == PROMPT
    # the same steering written in a trace (one invoke per prompt, the standard value's own read): the path
    # steered_generate takes where its one edit of the step's slab cannot serve the value
    traced = model._steered_in_a_trace([PROMPT], [0, 1], "layer_output", vector, steps, {"temperature": 0.0})
    result["steered_in_a_trace"] = list(traced[0].outputs[0].token_ids)
    # a contribution steered (a module's own output): against the same addition by a hook on transformers' module
    if "mlp_output" in available:
        path, side, *factor = hooks["mlp_output"]
        scaled = vector / 2
        ids = model.steered_generate(PROMPT, [0, 1], scaled, value="mlp_output", max_new_tokens=steps)
        # added to the module's output: divided by the factor the block multiplies it by, where it does
        module_added = [scaled / getattr(blocks_of(hf)[i], factor[0]) if factor else scaled for i in (0, 1)]
        handles = [(blocks_of(hf)[i].get_submodule(path) if path else blocks_of(hf)[i]).register_forward_hook(
            lambda _m, _a, out, add=module_added[i]: (out[0] + add, *out[1:]) if isinstance(out, tuple) else out + add)
            for i in (0, 1)]
        try:
            result["expected_steered_mlp"] = greedy(hf, PROMPT, steps)
        finally:
            for handle in handles:
                handle.remove()
        result["steered_mlp"] = ids[0, len(PROMPT):].tolist()

    # the lens' readout: every block's stream through project_on_vocab, against transformers' own final norm and
    # head on the hooked stream, and on the last block against transformers' logits at every position
    with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
        lens = nnsight.save([model.project_on_vocab(model.layers[i].layer_output) for i in layers])
        lens_logits = model.logits.save()
    with torch.no_grad():
        every_position = hf(torch.tensor([PROMPT])).logits
        expected_lens = [readout(hf, ref[(i, "layer_output")].reshape(1, len(PROMPT), -1)) for i in layers]
    result["lens"] = {"shape": list(lens[0].shape),
                      "diff": max(float((got - want).abs().max()) for got, want in zip(lens, expected_lens)),
                      "last_vs_logits": float((lens[-1] - every_position).abs().max()),
                      "last_vs_vllm_logits": float((lens[-1][:, -1:] - lens_logits).abs().max()),
                      "layers_differ": float((lens[0] - lens[-1]).abs().max())}

    # nnterp's add_to inside a trace (every position, then the last position only), against the same addition by
    # forward hooks on transformers' blocks
    from nnterp.tools.steering import add_to

    added = {}
    for label, positions in (("all", None), ("last", [-1])):
        try:
            with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
                add_to(model, [1, 0], 3 * direction, positions=positions)
                got = model.logits.save()
        except Exception as error:  # noqa: BLE001 - reported to the test
            added[label] = f"{type(error).__name__}: {error}"
            continue
        columns = slice(None) if positions is None else slice(-1, None)

        def shift(_m, _a, out, columns=columns):
            tensor = (out[0] if isinstance(out, tuple) else out).clone()
            tensor[:, columns] += 3 * direction
            return (tensor, *out[1:]) if isinstance(out, tuple) else tensor
        handles = [blocks_of(hf)[i].register_forward_hook(shift) for i in (0, 1)]
        try:
            with torch.no_grad():
                want = hf(torch.tensor([PROMPT])).logits[:, -1:]
        finally:
            for handle in handles:
                handle.remove()
        added[label] = {"diff": float((got - want).abs().max()), "moved": float((want - ref_logits).abs().max())}
    result["add_to"] = added

    # activation patching by hand, as the refusal of activation_patching says: the clean value saved by one trace,
    # assigned in the corrupted run of the next, against the same patch by a forward hook on transformers
    corrupted = [*PROMPT[:2], 77, *PROMPT[3:]]
    try:
        with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
            clean = model.layers[1].layer_output.clone().save()
        with torch.no_grad(), model.trace(corrupted, temperature=0.0, max_tokens=1):
            model.layers[1].layer_output[:, 2] = clean[:, 2]
            patched = model.logits.save()
        clean_stream = ref[(1, "layer_output")].reshape(1, len(PROMPT), -1)

        def patch(_m, _a, out):
            tensor = (out[0] if isinstance(out, tuple) else out).clone()
            tensor[:, 2] = clean_stream[:, 2]
            return (tensor, *out[1:]) if isinstance(out, tuple) else tensor
        handle = blocks_of(hf)[1].register_forward_hook(patch)
        try:
            with torch.no_grad():
                want = hf(torch.tensor([corrupted])).logits[:, -1:]
        finally:
            handle.remove()
        corrupted_logits, _ = hooked(hf, corrupted, hooks)
        result["patching_by_hand"] = {"diff": float((patched - want).abs().max()),
                                      "moved": float((want - corrupted_logits).abs().max())}
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["patching_by_hand"] = f"{type(error).__name__}: {error}"

    # the attention's internals: the queries, keys and values entering vLLM's kernel and the scores and
    # probabilities recomputed from them, against transformers' eager attention (its probabilities, output_attentions)
    # and nnterp's transformers values; and the kernel's own output (attention_premix) against the recomputed
    # probabilities mixing the values, head by head
    internals = ("queries", "keys", "values", "attention_scores", "attention_probabilities")
    try:
        with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
            got = nnsight.save({(i, name): getattr(model.layers[i].self_attn, name).clone()
                                for i in layers for name in (*internals, "attention_premix")})
        import nnterp

        on_hf = nnterp.StandardizedTransformer(folder, attention_values=True, attn_implementation="eager")
        eager = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        if family == "bloom":  # vLLM's exact GELU, as above
            for block in [*blocks_of(eager), *blocks_of(on_hf._module)]:
                block.mlp.gelu_impl = torch.nn.GELU()
        with torch.no_grad(), on_hf.trace(torch.tensor([PROMPT])):
            want = nnsight.save({(i, name): getattr(on_hf.layers[i].self_attn, name).clone()
                                 for i in layers for name in internals})
        with torch.no_grad():
            patterns = eager(torch.tensor([PROMPT]), output_attentions=True).attentions
        diffs = {}
        for (i, name), value in want.items():
            mine = got[(i, name)]
            if name == "attention_scores":  # the masked entries: the dtype's minimum on both sides
                mine, value = mine.clamp(min=-1e30), value.clamp(min=-1e30)
            diffs[f"{i}.{name}"] = [list(mine.shape), list(value.shape),
                                    float((mine - value).abs().max()) / max(1.0, float(value.abs().max()))]
        mixed = {}
        for i in layers:
            probs, values = got[(i, "attention_probabilities")][0], got[(i, "values")][0]  # [h, t, t], [t, kv, d]
            values = values.repeat_interleave(probs.shape[0] // values.shape[1], dim=1).transpose(0, 1)
            mixed[i] = float(((probs @ values).transpose(0, 1) - got[(i, "attention_premix")][0]).abs().max())
        result["internals"] = {"diffs": diffs, "mixed": mixed, "patterns": max(
            float((got[(i, "attention_probabilities")] - patterns[i]).abs().max()) for i in layers)}
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["internals"] = f"{type(error).__name__}: {error}"
    # a query edited in place reaches the kernel in the order it is read: head 0's query set to u at every position,
    # the kernel's own output for head 0 is the softmax of u . keys (the keys as the unedited pass read them, scaled
    # as the kernel scales) mixing the values as read
    try:
        u = torch.randn(got[(0, "queries")].shape[-1], generator=torch.Generator().manual_seed(3))
        keys, values = got[(0, "keys")], got[(0, "values")]
        with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
            attention = model.layers[0].self_attn
            attention.queries[:, :, 0] = u
            premix = attention.attention_premix.clone().save()
        facts = model.layers[0].self_attn._nnterp_kernel
        logits = (keys[0, :, 0] @ u) * facts["scale"]  # [key]: every query attends with u to the same keys
        if facts["softcap"]:
            logits = torch.tanh(logits / facts["softcap"]) * facts["softcap"]
        want = torch.stack([logits[: q + 1].softmax(-1) @ values[0, : q + 1, 0] for q in range(len(PROMPT))])
        result["query_edit"] = {"diff": float((premix[0, :, 0] - want).abs().max()),
                                "moved": float((premix[0, :, 0] - got[(0, "attention_premix")][0, :, 0]).abs().max())}
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["query_edit"] = f"{type(error).__name__}: {error}"
    # a generated token's step has no scores to recompute (its keys are in the paged cache); assigning is refused
    refusals = {}
    for label, body in (("step", "generated"), ("assign", "assign")):
        try:
            with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=2, ignore_eos=True) as tracer:
                for step in tracer.iter[0:2]:
                    if body == "assign":
                        model.layers[0].self_attn.attention_scores = torch.zeros(1)
                    elif step == 1:
                        model.layers[0].self_attn.attention_probabilities.save()
            refusals[label] = None
        except Exception as error:  # noqa: BLE001 - reported to the test, which checks the message
            refusals[label] = f"{type(error).__name__}: {error}"
    result["internal_refusals"] = refusals

    # run_with_cache and collect over two prompts of different lengths (each its own request): every cached value
    # against the plain hooks' value at the prompt's own positions, the logits at every position against
    # transformers'; collect's rows (every token, two blocks) against the same hooks
    from nnterp.collection import collect
    from nnterp.tools.activation_cache import run_with_cache
    from nnterp.tools.patching import activation_patching, attribution_patching

    prompts = [PROMPT, OTHER]
    truth = [hooked(hf, ids, hooks)[1] for ids in prompts]
    with torch.no_grad():
        every = [hf(torch.tensor([ids])).logits[0] for ids in prompts]
    try:
        cache_logits, cache = run_with_cache(model, prompts)
        mask = cache.attention_mask.bool()
        diffs, worst = {}, 0.0
        for name in available:
            for layer in layers:
                cached = cache[name, layer]
                for row in range(len(prompts)):
                    want = truth[row][(layer, name)].reshape(cached[row][mask[row]].shape)
                    diff = float((cached[row][mask[row]] - want).abs().max()) / max(1.0, float(want.abs().max()))
                    diffs[f"{layer}.{name}"] = max(diffs.get(f"{layer}.{name}", 0.0), diff)
        for row in range(len(prompts)):
            worst = max(worst, float((cache_logits[row][mask[row]] - every[row]).abs().max()))
        if isinstance(result.get("internals"), dict):  # the internals, as one trace read them (prompt 0: unpadded)
            internal = {f"{layer}.{name}": float((cache[name, layer][0] - got[(layer, name)][0]).abs().max())
                        for layer in layers for name in internals}
            internal["padded"] = list(cache["attention_probabilities", 0].shape)
        else:
            internal = None
        result["run_with_cache"] = {"diffs": diffs, "internals": internal, "logits": worst,
                                    "shape": list(cache_logits.shape),
                                    "ids": [cache.input_ids[row][mask[row]].tolist() for row in range(2)],
                                    "held": sorted(cache.names)}
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["run_with_cache"] = f"{type(error).__name__}: {error}"
    texts = [" ".join(f"w{i}" for i in ids) for ids in prompts]
    collected_names = [name for name in ("layer_output", "mlp_output", "attention_output") if name in available]
    try:
        if model.tokenizer(texts[0])["input_ids"] != PROMPT:  # transformers' own class for the type, not the one saved
            raise LookupError(f"the tokenizer loaded for {family} ({type(model.tokenizer).__name__}) does not read "
                              "the tiny vocabulary's words")
        collection = collect(model, texts, tempfile.mkdtemp(), values=collected_names, layers=[-1, 0],
                             positions="all", batch_size=2, progress=False)
        diffs = {}
        for name in collected_names:
            rows = collection[name]  # [tokens, layers, width], the prompts' tokens one after the other
            want = torch.cat([torch.stack([truth[p][(layer, name)].reshape(len(prompts[p]), -1)
                                           for layer in (model.num_layers - 1, 0)], dim=1) for p in range(2)])
            diffs[name] = float((rows - want).abs().max()) / max(1.0, float(want.abs().max()))
        last = collect(model, texts, tempfile.mkdtemp(), values=["layer_output"], layers=[1], progress=False)
        want_last = torch.stack([truth[p][(1, "layer_output")].reshape(len(prompts[p]), -1)[-1] for p in range(2)])
        result["collect"] = {"diffs": diffs, "last": float((last["layer_output"][:, 0] - want_last).abs().max()),
                             "rows": len(collection[collected_names[0]])}
    except LookupError as error:
        result["collect"] = {"skipped": str(error)}
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["collect"] = f"{type(error).__name__}: {error}"

    # the tools StandardizedVLLM cannot run, and the arguments of those it runs that it cannot honour, are refused
    # at their entry, saying why
    metric = lambda logits: logits[:, -1, 3].mean()  # noqa: E731
    calls = {"run_with_cache(names_filter=)": lambda: run_with_cache(model, "w5", names_filter="blocks.0.hook_z"),
             "activation_patching": lambda: activation_patching(model, "w5 w6", "w7 w6", metric),
             "attribution_patching": lambda: attribution_patching(model, "w5 w6", "w7 w6", metric),
             "collect(max_new_tokens=)": lambda: collect(model, ["w5 w6"], tempfile.mkdtemp(), max_new_tokens=2)}
    refused = {}
    for tool, call in calls.items():
        try:
            call()
            refused[tool] = None
        except Exception as error:  # noqa: BLE001 - reported to the test, which checks the type and message
            refused[tool] = f"{type(error).__name__}: {error}"
    result["tool_refusals"] = refused

    # refusals: a batch in one invoke, an unavailable value (with its reason)
    try:
        with model.trace([PROMPT, OTHER], temperature=0.0, max_tokens=1):
            model.logits.save()
        result["batch_refusal"] = None
    except ValueError as error:
        result["batch_refusal"] = str(error)
    lacking = [key for key, entry in model.availability(0).items() if not entry.available]
    result["unavailable"] = None
    if lacking:  # the first value the family has no place for, read in a trace
        owner, _, name = lacking[0].rpartition(".")
        try:
            with model.trace(PROMPT, temperature=0.0, max_tokens=1):
                getattr(getattr(model.layers[0], owner) if owner else model.layers[0], name).save()
            result["unavailable"] = {"key": lacking[0], "error": None}
        except Exception as error:  # noqa: BLE001 - reported to the test, which checks the type's name and message
            result["unavailable"] = {"key": lacking[0], "error": f"{type(error).__name__}: {error}",
                                     "reason": result["reasons"][lacking[0]]}
    return result


if __name__ == "__main__":
    print("NNTERP-RESULT " + json.dumps(main(sys.argv[1])), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the in-process engine's threads would hold the exit
