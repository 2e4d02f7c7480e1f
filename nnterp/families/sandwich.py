"""Norms after the sublayers: Gemma-2, Gemma-3 (text, and inside ``Gemma3ForConditionalGeneration``), GLM-4,
Kolibri-1, AfMoE, OLMo-2, OLMo-3, FlexOlmo.

A contribution is the output of the norm after its sublayer (``post_attention_layernorm``,
``post_feedforward_layernorm``), not the sublayer's own return; the identity is the usual
``(x + a) + m``. Gemma-2/3 also norm before each sublayer (the MLP's in
``pre_feedforward_layernorm``). OLMo-2/3 have no norm before either sublayer: the attention
reads ``layer_input`` and the MLP reads ``layer_mid``. GLM-4 and Kolibri-1 are Gemma-2's four norms under other names
(``post_self_attn_layernorm`` after the attention, ``post_attention_layernorm`` before the MLP,
``post_mlp_layernorm`` after it); Kolibri-1's MLP is a routed mixture. AfMoE names them
``post_attention_layernorm``, ``pre_mlp_layernorm`` and ``post_mlp_layernorm``; its first
``num_dense_layers`` blocks have a dense MLP and the others a routed mixture, and its attention
gates each head's output (a sigmoid of ``gate_proj``) before ``o_proj``. FlexOlmo is OLMo-2's block
with a routed mixture for MLP.
"""

import transformers

from ..spec.views import Half
from .base import (
    ROUTED,
    At,
    Family,
    Unavailable,
    head_dim,
    input,
    output,
    pre_norm_block,
    qk_norms,
    router,
    softcap_logits,
)

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def _gemma_block(config, i):
    return pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="pre_feedforward_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj",
        up="mlp.up_proj",
        attention_output=output("post_attention_layernorm"), mlp_output=output("post_feedforward_layernorm"),
        # Gemma-3 norms each head's queries and keys before the rotary embedding; Gemma-2 does not
        **(qk_norms(heads_first=True) if config.model_type.startswith("gemma3") else {}),
    )


_ROUTED = {"mlp_activation": ROUTED, "mlp_neurons": ROUTED}
KOLIBRI_ROUTER = Unavailable("Kolibri-1's router computes its logits on one of two paths, chosen by the device, the "
                             "dtype and whether gradients are on (a float32 product on CUDA without them): no one "
                             "place serves them on every run")


def _glm4_block(config, i, routed=False):
    return pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp="mlp", act="mlp.activation_fn", down_proj="mlp.down_proj",
        up=None if routed else At("mlp.gate_up_proj", "output", views=(Half(1),)),  # [gate | up], chunked
        attention_output=output("post_self_attn_layernorm"), mlp_output=output("post_mlp_layernorm"),
        # Kolibri-1 (the routed one) norms each head's queries and keys; GLM-4 does not
        # Kolibri-1's router computes its logits on one of two paths, by device and dtype: not placed
        **(_ROUTED | qk_norms(heads_first=True) | {"router_logits": KOLIBRI_ROUTER} if routed else {}),
    )


def _afmoe_block(config, i):
    return pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj", post_norm="pre_mlp_layernorm",
        mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj", attention_output=output("post_attention_layernorm"),
        mlp_output=output("post_mlp_layernorm"), **qk_norms(),
        **(_ROUTED | router("mlp.router.gate", op="") if i >= config.num_dense_layers else {}),
    )


def _olmo2_block(config, i, routed=False):
    return pre_norm_block(
        input_norm="", attention="self_attn", o_proj="self_attn.o_proj", post_norm="", mlp="mlp",
        act="mlp.act_fn", down_proj="mlp.down_proj", up=None if routed else "mlp.up_proj",
        attention_norm_output=Unavailable("no norm before the attention: it reads layer_input (the block norms "
                                          "the attention's output instead, in post_attention_layernorm)"),
        mlp_norm_output=Unavailable("no norm before the MLP: it reads layer_mid (the block norms the MLP's "
                                    "output instead, in post_feedforward_layernorm)"),
        # the stream the MLP reads is also the residual: edits of what the MLP receives go to a copy
        layer_mid=input("mlp", shared=True), mlp_input=input("mlp", copy=True),
        attention_output=output("post_attention_layernorm"), mlp_output=output("post_feedforward_layernorm"),
        # the q/k norms read the projections' whole outputs (EXAONE-4's, filed here, norm each head's, after the
        # transpose: [batch, heads, seq, head_dim])
        **(qk_norms(heads_first=True) if config.model_type == "exaone4" else qk_norms(width=head_dim(config))),
        **(_ROUTED | router("mlp.gate") if routed else {}),
    )


def _family(name, model_type, block, tiny_config, **readout):
    return Family(
        name=name, model_types=(model_type,), block=block, tiny_config=tiny_config, **readout,
    )


GEMMA2 = _family("Gemma-2", "gemma2", _gemma_block, lambda: transformers.Gemma2Config(
    **_SMALL, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0), logits_transform=softcap_logits)
GEMMA3 = _family("Gemma-3", "gemma3_text", _gemma_block, lambda: transformers.Gemma3TextConfig(
    **_SMALL, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, layer_types=_LAYER_TYPES,
    final_logit_softcapping=30.0), logits_transform=softcap_logits)
# Gemma-3 checkpoints of 4B and more are image-text models: the same blocks, under model.language_model.
GEMMA3_MULTIMODAL = Family(
    name="Gemma-3 (image-text)", model_types=("gemma3",), layers="model.language_model.layers",
    embed_tokens="model.language_model.embed_tokens", ln_final="model.language_model.norm",
    attention="self_attn", mlp="mlp", block=_gemma_block,  # no final softcapping in this class
    tiny_config=lambda: transformers.Gemma3Config(
        text_config=GEMMA3.tiny_config().to_dict(), mm_tokens_per_image=16,
        vision_config=transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2, image_size=32, patch_size=8).to_dict()),
)
OLMO2 = _family("OLMo-2", "olmo2", _olmo2_block, lambda: transformers.Olmo2Config(**_SMALL))
OLMO3 = _family("OLMo-3", "olmo3", _olmo2_block,
                lambda: transformers.Olmo3Config(**_SMALL, sliding_window=4, layer_types=_LAYER_TYPES))
GLM4 = _family("GLM-4", "glm4", _glm4_block,
               lambda: transformers.Glm4Config(**_SMALL, head_dim=16, pad_token_id=0, eos_token_id=2))
KOLIBRI1 = _family("Kolibri-1", "kolibri1", lambda config, i: _glm4_block(config, i, routed=True),
                   lambda: transformers.Kolibri1Config(
    **_SMALL, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    num_experts_per_tok=2, sliding_window=4))
FLEX_OLMO = _family("FlexOlmo", "flex_olmo", lambda config, i: _olmo2_block(config, i, routed=True),
                    lambda: transformers.FlexOlmoConfig(**_SMALL, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                                                        eos_token_id=2))
AFMOE = _family("AfMoE", "afmoe", _afmoe_block, lambda: transformers.AfmoeConfig(
    **_SMALL, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
    sliding_window=4, layer_types=_LAYER_TYPES),
    premix_is_not_mixed_values="the attention gates each head's output (a sigmoid of gate_proj) before o_proj")
