"""Mixtures of experts on a sequential pre-norm block: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V3.

The MLP's output is what the mixture adds (routed experts, plus any shared expert), so the
identity is the usual ``(x + a) + m``. A routed block has no single ``mlp_activation`` or
``mlp_neurons``: every token runs its own experts. Dense blocks among them (DeepSeek-V3's
first ``first_k_dense_replace`` layers, Qwen-MoE's ``mlp_only_layers`` and
``decoder_sparse_step``) have both. GPT-OSS's MLP returns ``(output, router_scores)``.

JetMoE routes the attention too: each token runs ``num_experts_per_tok`` experts of query and
output projections (``self_attention.experts``) over shared keys and values. Its attention is still one
eager attention over ``num_experts_per_tok x num_key_value_heads`` slots (the config's
``num_attention_heads``): slot ``s`` is, counting from 0, the token's ``s // num_key_value_heads``-th
chosen expert (by its router logit, highest first, so another expert from token to token) on key-value
head ``s % num_key_value_heads`` (the keys and values repeated per expert). So the values inside the
attention are read as on any family, a slot for a head, and ``attention_premix`` is the attention
function's output, each slot's before its expert's output projection: there is no one output
projection, so no ``head_outputs``. Its ``self_attention`` returns ``(output, weights, router_logits)``.
"""

import transformers

from .base import ROUTED, STANDARD, WITH_SINKS, At, Family, head_dim, pre_norm_block, qk_norms, router

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


# the router whose first output is the logits, per type (the other types filed here have theirs unplaced)
ROUTERS = {"mixtral": "mlp.gate", "qwen2_moe": "mlp.gate", "qwen3_moe": "mlp.gate", "olmoe": "mlp.gate",
           "gpt_oss": "mlp.router", "deepseek_v3": "mlp.gate"}


# the q/k norms of the types filed under these families, per type (from transformers' code): "head" where they norm
# [batch, seq, heads, head_dim], "first" [batch, heads, seq, head_dim], "whole" the projections' whole outputs
QK_NORMS = {"flint": "head", "laguna": "head", "mellum": "head", "minimax_m3_vl_text": "head", "hy_v3": "first",
            "exaone_moe": "first", "minimax_m2": "whole"}


def _qk_norms(config, how):
    if how == "whole":
        return qk_norms(width=head_dim(config))
    return qk_norms(heads_first=how == "first") if how else {}


def _block(is_routed, qk_norm=None):
    """``qk_norm``: ``"head"`` where the attention norms each head's queries and keys (Qwen3-MoE), ``"whole"``
    where it norms the projections' whole outputs (OLMoE)."""
    def block(config, i):
        routed = {"mlp_activation": ROUTED, "mlp_neurons": ROUTED} if is_routed(config, i) else {}
        if routed and config.model_type in ROUTERS:
            routed |= router(ROUTERS[config.model_type])
        norms = _qk_norms(config, qk_norm or QK_NORMS.get(config.model_type))
        return pre_norm_block(
            input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
            post_norm="post_attention_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj", **routed,
            **norms,
        )
    return block


def routed_layer(config, i) -> bool:
    """Whether block ``i`` is a routed mixture, by the config's own description of its layers (the proof
    checks the answer against the block's modules)."""
    kinds = getattr(config, "mlp_layer_types", None)
    if kinds:
        return kinds[i] != "dense"
    if getattr(config, "first_k_dense_replace", None) is not None:
        return i >= config.first_k_dense_replace
    if getattr(config, "moe_layer_interval", None):  # ERNIE-4.5-MoE
        end = config.moe_layer_end_index if config.moe_layer_end_index not in (None, -1) else config.num_hidden_layers
        return (i + 1) % config.moe_layer_interval == 0 and config.moe_layer_start_index <= i <= end
    if getattr(config, "decoder_sparse_step", None):
        return (i not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (i + 1) % config.decoder_sparse_step == 0)
    return True


def _moe(name, model_type, is_routed, tiny_config, attention_internals=STANDARD, qk_norm=None):
    return Family(
        name=name, model_types=(model_type,), block=_block(is_routed, qk_norm), tiny_config=tiny_config,
        attention_internals=attention_internals,
    )


def _always(config, i):
    return True


MIXTRAL = _moe("Mixtral", "mixtral", routed_layer,
               lambda: transformers.MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2))
QWEN2_MOE = _moe("Qwen2-MoE", "qwen2_moe", routed_layer, lambda: transformers.Qwen2MoeConfig(
    **_SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
    decoder_sparse_step=1, mlp_only_layers=[1]))
QWEN3_MOE = _moe("Qwen3-MoE", "qwen3_moe", routed_layer, lambda: transformers.Qwen3MoeConfig(
    **_SMALL, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2), qk_norm="head")
OLMOE = _moe("OLMoE", "olmoe", _always, lambda: transformers.OlmoeConfig(**_SMALL, num_experts=4, num_experts_per_tok=2),
             qk_norm="whole")
GPT_OSS = _moe("GPT-OSS", "gpt_oss", _always, lambda: transformers.GptOssConfig(
    **_SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"]), attention_internals=WITH_SINKS)
DEEPSEEK_V3 = _moe("DeepSeek-V3", "deepseek_v3", routed_layer,
                   lambda: transformers.DeepseekV3Config(
                       **{**_SMALL, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8,
                       n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                       q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))

# each slot's output (expert slot x key-value head) as the attention function returns it, [batch, seq, slots, head_dim]
_SLOTS_MIXED = At("self_attention", "output", op="attention_interface_1", index=0)
JETMOE = Family(
    name="JetMoE", model_types=("jetmoe",), attention="self_attention",
    block=lambda config, i: pre_norm_block(
        input_norm="input_layernorm", attention="self_attention", o_proj="", post_norm="post_attention_layernorm",
        mlp="mlp", act="", down_proj="", attention_premix=_SLOTS_MIXED, mlp_activation=ROUTED, mlp_neurons=ROUTED,
        **router("mlp.router.layer", op="")),  # its linear layer computes the logits
    attention_internals=STANDARD,
    tiny_config=lambda: transformers.JetMoeConfig(
        hidden_size=64, num_hidden_layers=3, num_key_value_heads=2, kv_channels=16, intermediate_size=64,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64),
)
