"""Granite, Granite-MoE, HyperCLOVAX and MiniCPM3: a residual multiplier ``r`` on both contributions.

``layer_mid = layer_input + attention_output * r`` and
``layer_output = layer_mid + mlp_output * r`` with ``r = config.residual_multiplier``:
the products are not at any module boundary, so the values are the sublayers' own
outputs and the identity carries ``r``. (Block 0's input is the embedding times
``embedding_multiplier``, and the logits are ``lm_head`` divided by ``logits_scaling``.)
Granite-MoE's MLP is a routed mixture at ``block_sparse_moe``. HyperCLOVAX norms each
contribution after its sublayer (``post_norm1``, ``post_norm2``), so a contribution is that
norm's output, and it multiplies its logits by ``logits_scaling``. MiniCPM3's factor is the
block's ``residual_scale`` (``scale_depth / sqrt(num_hidden_layers)``), its attention is latent
(MLA), and it divides the normed stream by ``logits_scaling`` before the head.
"""

from transformers import GraniteConfig, GraniteMoeConfig, HyperCLOVAXConfig, MiniCPM3Config

from .base import MODEL_LAYERS, ROUTED, Family, output, pre_norm_block

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64, embedding_multiplier=12.0, residual_multiplier=0.22,
              attention_multiplier=0.0625, logits_scaling=8.0)


def _block(config, i, mlp="mlp", factor="residual_multiplier", **overrides):
    return pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp=mlp, act=f"{mlp}.act_fn", down_proj=f"{mlp}.down_proj",
        formula=f"layer_output = (layer_input + attention_output * r) + mlp_output * r, r = {factor}",
        combine=lambda t, block: (t["layer_input"] + t["attention_output"] * getattr(block, factor))
        + t["mlp_output"] * getattr(block, factor),
        **overrides,
    )


GRANITE = Family(
    name="Granite",
    model_types=("granite",),
    **MODEL_LAYERS,
    block=_block,
    logits_transform=lambda logits, config: logits / config.logits_scaling,
    tiny_config=lambda: GraniteConfig(**_SMALL),
)
GRANITE_MOE = Family(
    name="Granite-MoE",
    model_types=("granitemoe",),
    **{**MODEL_LAYERS, "mlp": "block_sparse_moe"},
    block=lambda config, i: _block(config, i, mlp="block_sparse_moe", mlp_activation=ROUTED, mlp_neurons=ROUTED),
    logits_transform=lambda logits, config: logits / config.logits_scaling,
    tiny_config=lambda: GraniteMoeConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2),
)
HYPERCLOVAX = Family(
    name="HyperCLOVAX",
    model_types=("hyperclovax",),
    **MODEL_LAYERS,
    block=lambda config, i: _block(config, i, attention_output=output("post_norm1"), mlp_output=output("post_norm2")),
    logits_transform=lambda logits, config: logits * config.logits_scaling,
    tiny_config=lambda: HyperCLOVAXConfig(**_SMALL),
)
MINICPM3 = Family(
    name="MiniCPM3",
    model_types=("minicpm3",),
    **MODEL_LAYERS,
    block=lambda config, i: _block(config, i, factor="residual_scale"),
    head_input_transform=lambda hidden, config: hidden / config.logits_scaling,
    tiny_config=lambda: MiniCPM3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=128, max_position_embeddings=64, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, head_dim=16, scale_emb=12, scale_depth=1.4, dim_model_base=16),
)
