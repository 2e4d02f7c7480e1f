"""Gemma-4 (text): norms after the sublayers, an optional per-layer input, and a per-block scale.

``layer_output = (((layer_input + attention_output) + mlp_output) + per_layer_input_output) * layer_scalar``
where the contributions are the outputs of ``post_attention_layernorm`` and
``post_feedforward_layernorm``, the per-layer-input branch (when
``hidden_size_per_layer_input > 0``) is ``post_per_layer_input_norm``'s output, and
``layer_scalar`` is the block's buffer: the stream is rescaled every block, so
``layer_output`` is not ``layer_input`` plus the contributions. With ``enable_moe_block`` the
MLP contribution is the dense MLP and the experts together, so the dense MLP's activation
is not the block's: ``mlp_activation`` and ``mlp_neurons`` are unavailable.

The same blocks serve the image-text type of Gemma-4 checkpoints (``gemma4``, its text decoder at
``model.language_model``) and Gemma-4-Unified (``gemma4_unified_text``, and ``gemma4_unified`` at
``model.language_model``), whose blocks have no per-layer input and no experts. Their default
configs give the full-attention layers their own head size (``per_layer_config``).
"""

import dataclasses

import transformers

from ..spec.identity import A, M, Name, Sum, X
from .base import ROUTED, Block, Family, output, pre_norm_block, shared_kv_qk_norms, softcap_logits


def _block(config, i):
    ple = bool(getattr(config, "hidden_size_per_layer_input", 0))  # Gemma-4-Unified has no per-layer input
    moe = bool(getattr(config, "enable_moe_block", False))
    base = pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="pre_feedforward_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj",
        attention_output=output("post_attention_layernorm"), mlp_output=output("post_feedforward_layernorm"),
        **({"mlp_activation": ROUTED, "mlp_neurons": ROUTED} if moe else {}),
        **shared_kv_qk_norms(config, i),
    )
    stream = (X + A) + M
    return Block(
        values=base.values,
        identity=Sum(((stream + Name("per_layer_input_output")) if ple else stream) * "layer_scalar"),
        extra={"per_layer_input_output": output("post_per_layer_input_norm")} if ple else {},
    )


GEMMA4 = Family(
    name="Gemma-4",
    model_types=("gemma4_text",),
    block=_block,
    logits_transform=softcap_logits,
    tiny_config=lambda: transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, head_dim=16, global_head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32,
    ),
    variants=(("`enable_moe_block=True`, a per-layer input", {}),
              ("`enable_moe_block=False`, no per-layer input",
               {"enable_moe_block": False, "hidden_size_per_layer_input": 0})),
)


def _image_text(family: Family, name: str, model_type: str, tiny_config) -> Family:
    """``family`` in its image-text class: the same blocks under ``model.language_model``, the same softcapped head."""
    return dataclasses.replace(
        family, name=name, model_types=(model_type,), layers="model.language_model.layers",
        embed_tokens="model.language_model.embed_tokens", ln_final="model.language_model.norm", variants=(),
        tiny_config=tiny_config)


GEMMA4_MULTIMODAL = _image_text(
    GEMMA4, "Gemma-4 (image-text)", "gemma4",
    tiny_config=lambda: transformers.Gemma4Config(text_config=GEMMA4.tiny_config().to_dict()))
GEMMA4_UNIFIED = dataclasses.replace(
    GEMMA4, name="Gemma-4-Unified", model_types=("gemma4_unified_text",), variants=(),
    tiny_config=lambda: transformers.Gemma4UnifiedTextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, head_dim=16, global_head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], final_logit_softcapping=30.0))
GEMMA4_UNIFIED_MULTIMODAL = _image_text(
    GEMMA4_UNIFIED, "Gemma-4-Unified (image-text)", "gemma4_unified",
    tiny_config=lambda: transformers.Gemma4UnifiedConfig(text_config=GEMMA4_UNIFIED.tiny_config().to_dict()))
