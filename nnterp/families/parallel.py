"""Parallel blocks with one shared norm on the model.layers layout: Phi, StableLM, Cohere, Cohere2-MoE.

Phi sums ``(a + m) + x``; StableLM (parallel mode) and Cohere sum ``(x + a) + m``, so their
plain sum is exact. StableLM's sequential mode is the usual pre-norm block. Cohere2-MoE is
Cohere's block with a routed mixture for MLP on the layers its ``mlp_layer_types`` marks
sparse; Cohere and it scale the head's output by ``logit_scale``.
"""

import transformers

from .base import ROUTED, Family, parallel_block, pre_norm_block, router
from .moe import routed_layer

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              vocab_size=128, max_position_embeddings=64)


def _stablelm_block(config, i):
    modules = dict(input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj", mlp="mlp",
                   act="mlp.act_fn", down_proj="mlp.down_proj", up="mlp.up_proj")
    if config.use_parallel_residual:
        return parallel_block(order="(x + a) + m", **modules)
    return pre_norm_block(post_norm="post_attention_layernorm", **modules)


def _family(name, model_type, ln_final, block, tiny_config, **options):
    return Family(name=name, model_types=(model_type,), ln_final=ln_final, block=block,
                  tiny_config=tiny_config, **options)


PHI = _family("Phi", "phi", "model.final_layernorm", lambda config, i: parallel_block(
    input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.dense", mlp="mlp",
    act="mlp.activation_fn", down_proj="mlp.fc2", order="(a + m) + x"), lambda: transformers.PhiConfig(**_SMALL))
STABLELM = _family("StableLM", "stablelm", "model.norm", _stablelm_block,
                   lambda: transformers.StableLmConfig(**_SMALL, num_key_value_heads=4, use_parallel_residual=True),
                   variants=(("`use_parallel_residual=True`", {}),
                             ("`use_parallel_residual=False`", {"use_parallel_residual": False})))


def _cohere_block(config, i):
    routed = {"mlp_activation": ROUTED, "mlp_neurons": ROUTED, **router("mlp.gate")} if routed_layer(config, i) else {}
    return parallel_block(input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj", mlp="mlp",
                          act="mlp.act_fn", down_proj="mlp.down_proj", order="(x + a) + m", **routed)


COHERE = _family("Cohere", "cohere", "model.norm", lambda config, i: parallel_block(
    input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj", mlp="mlp",
    act="mlp.act_fn", down_proj="mlp.down_proj", order="(x + a) + m", up="mlp.up_proj"),
    lambda: transformers.CohereConfig(**_SMALL, num_key_value_heads=2, use_qk_norm=False, logit_scale=0.5),
    logits_transform=lambda logits, config: logits * config.logit_scale)  # Cohere scales the head's output
COHERE2_MOE = _family("Cohere2-MoE", "cohere2_moe", "model.norm", _cohere_block,
                      lambda: transformers.Cohere2MoeConfig(**_SMALL, num_key_value_heads=2, head_dim=16, num_experts=4,
                                                            num_experts_per_tok=2, sliding_window=4, logit_scale=0.5,
                                                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                                            mlp_layer_types=["dense", "sparse", "sparse"]),
                      logits_transform=lambda logits, config: logits * config.logit_scale)
