"""Granite, Granite-MoE, HyperCLOVAX and MiniCPM3: a residual multiplier ``r`` on both contributions.

the block adds ``self_attn.output[0] * r`` and ``mlp.output * r`` to the stream, with
``r = config.residual_multiplier``. The contributions are those products, what the stream receives
(``layer_mid = layer_input + attention_output``, ``layer_output = layer_mid + mlp_output``): they are
at no module boundary, so each is computed as the block computes it and handed back through ``r``
(``nnterp.spec.views.Times``); the modules' own outputs stay at their native paths. (Block 0's input is the embedding times
``embedding_multiplier``, and the logits are ``lm_head`` divided by ``logits_scaling``.)
Granite-MoE's MLP is a routed mixture at ``block_sparse_moe``.
Granite-MoE-shared and Granite-MoE-SWA (the same block with sliding-window attention) add a shared
MLP (``shared_mlp``, where ``shared_intermediate_size > 0``; the default config has none) called with
the same normed stream: the MLP contribution is the experts' output plus the shared MLP's, summed in
the block's own code, so ``mlp_output`` is read at that add (the operation nnsight's ``.source``
names ``hidden_states_4``) and ``mlp_input`` is the norm's output. ``layers[i].mlp`` is the mixture,
the module every config of the type has (``layers[i].shared_mlp`` is the shared MLP); the MLP is
routed, so no single activation exists. Granite-MoE-SWA's eager attention scales the heads' mixed
values by attention-sink factors, so the values inside its attention are unavailable.
HyperCLOVAX norms each sublayer's output (``post_norm1``, ``post_norm2``) before the factor, so a
contribution is that norm's output times ``r``, and it multiplies its logits by ``logits_scaling``. MiniCPM3's factor is the
block's ``residual_scale`` (``scale_depth / sqrt(num_hidden_layers)``), its attention is latent
(MLA), and it divides the normed stream by ``logits_scaling`` before the head.
"""

import transformers

from .base import (
    ROUTED,
    STANDARD,
    A,
    Family,
    M,
    SameAs,
    Sum,
    Unavailable,
    X,
    added_times,
    output,
    pre_norm_block,
    router,
)

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64, embedding_multiplier=12.0, residual_multiplier=0.22,
              attention_multiplier=0.0625, logits_scaling=8.0)


def _block(config, i, mlp="mlp", factor="residual_multiplier", **overrides):
    return added_times(pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp=mlp, act=f"{mlp}.act_fn", down_proj=f"{mlp}.down_proj",
        up=None if overrides.get("mlp_activation") is ROUTED else f"{mlp}.up_proj",
        identity=Sum((X + A * factor) + M * factor),
        **overrides,
    ), factor)


GRANITE = Family(
    name="Granite",
    model_types=("granite",),
    block=_block,
    logits_transform=lambda logits, config: logits / config.logits_scaling,
    tiny_config=lambda: transformers.GraniteConfig(**_SMALL),
)
GRANITE_MOE = Family(
    name="Granite-MoE",
    model_types=("granitemoe",),
    mlp="block_sparse_moe",
    block=lambda config, i: _block(config, i, mlp="block_sparse_moe", mlp_activation=ROUTED, mlp_neurons=ROUTED,
                                   **router("block_sparse_moe.router")),
    logits_transform=lambda logits, config: logits / config.logits_scaling,
    tiny_config=lambda: transformers.GraniteMoeConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2),
)


def _shared_block(config, i):
    """Granite-MoE's block; with a shared MLP, the MLP contribution is the sum of the two modules' outputs."""
    shared = {"mlp_output": output("", op="hidden_states_4"),  # moe_hidden_states + self.shared_mlp(hidden_states)
              "mlp_input": SameAs("mlp_norm_output")} if config.shared_intermediate_size else {}
    return _block(config, i, mlp="block_sparse_moe", mlp_activation=ROUTED, mlp_neurons=ROUTED, **shared,
                  **router("block_sparse_moe.router"))


_SINK_SCALED = Unavailable(
    "its eager attention scales each head's mixed values by a sink factor, sigmoid(logsumexp(scores) - sink), "
    "after the matmul with the softmax: no tensor is the pattern that mixes the values")

GRANITE_MOE_SHARED = Family(
    name="Granite-MoE-shared",
    model_types=("granitemoeshared", "granitemoe_swa"),
    mlp="block_sparse_moe",
    block=_shared_block,
    logits_transform=lambda logits, config: logits / config.logits_scaling,
    attention_internals=lambda config: _SINK_SCALED if config.model_type == "granitemoe_swa" else STANDARD,
    tiny_config=lambda: transformers.GraniteMoeSharedConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2,
                                                            shared_intermediate_size=64),
    variants=(("`shared_intermediate_size > 0`", {}),
              ("`shared_intermediate_size = 0` (the default: no shared MLP)", {"shared_intermediate_size": 0})),
)
HYPERCLOVAX = Family(
    name="HyperCLOVAX",
    model_types=("hyperclovax",),
    block=lambda config, i: _block(config, i, attention_output=output("post_norm1"), mlp_output=output("post_norm2")),
    logits_transform=lambda logits, config: logits * config.logits_scaling,
    tiny_config=lambda: transformers.HyperCLOVAXConfig(**_SMALL),
)
MINICPM3 = Family(
    name="MiniCPM3",
    model_types=("minicpm3",),
    block=lambda config, i: _block(config, i, factor="residual_scale"),
    head_input_transform=lambda hidden, config: hidden / config.logits_scaling,
    tiny_config=lambda: transformers.MiniCPM3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=128, max_position_embeddings=64, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, head_dim=16, scale_emb=12, scale_depth=1.4, dim_model_base=16),
)
