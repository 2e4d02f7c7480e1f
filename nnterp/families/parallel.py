"""Parallel blocks with one shared norm on the model.layers layout: Phi, StableLM, Cohere.

Phi sums ``(a + m) + x``; StableLM (parallel mode) and Cohere sum ``(x + a) + m``, so their
plain sum is exact. StableLM's sequential mode is the usual pre-norm block.
"""

from transformers import CohereConfig, PhiConfig, StableLmConfig

from .base import MODEL_LAYERS, Family, parallel_block, pre_norm_block

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              vocab_size=128, max_position_embeddings=64)


def _stablelm_block(config, i):
    modules = dict(input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj", mlp="mlp",
                   act="mlp.act_fn", down_proj="mlp.down_proj")
    if config.use_parallel_residual:
        return parallel_block(order="(x + a) + m", **modules)
    return pre_norm_block(post_norm="post_attention_layernorm", **modules)


def _family(name, model_type, ln_final, block, tiny_config, **options):
    return Family(name=name, model_types=(model_type,), **{**MODEL_LAYERS, "ln_final": ln_final}, block=block,
                  tiny_config=tiny_config, **options)


PHI = _family("Phi", "phi", "model.final_layernorm", lambda config, i: parallel_block(
    input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.dense", mlp="mlp",
    act="mlp.activation_fn", down_proj="mlp.fc2", order="(a + m) + x"), lambda: PhiConfig(**_SMALL))
STABLELM = _family("StableLM", "stablelm", "model.norm", _stablelm_block,
                   lambda: StableLmConfig(**_SMALL, num_key_value_heads=4, use_parallel_residual=True),
                   variants=(("`use_parallel_residual=True`", {}),
                             ("`use_parallel_residual=False`", {"use_parallel_residual": False})))
COHERE = _family("Cohere", "cohere", "model.norm", lambda config, i: parallel_block(
    input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj", mlp="mlp",
    act="mlp.act_fn", down_proj="mlp.down_proj", order="(x + a) + m"),
    lambda: CohereConfig(**_SMALL, num_key_value_heads=2, use_qk_norm=False, logit_scale=0.5),
    logits_transform=lambda logits, config: logits * config.logit_scale)  # Cohere scales the head's output
