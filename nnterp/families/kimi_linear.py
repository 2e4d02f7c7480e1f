"""Kimi-Linear and Bailing-Hybrid (Ling): Kimi Delta Attention (a linear attention) on most blocks, latent
attention on the others, both at ``self_attn``, on the Mixtral / DeepSeek block (a routed mixture with a
shared expert, dense MLPs on the layers ``mlp_layer_types`` names ``dense``).

Which mixer a block has is the config's ``layer_types``. On a linear-attention block the mixer's
output is ``mixer_output`` and the attention's values are unavailable with the reason, as on the other
hybrids. The linear attention of the transformers code runs a pure-PyTorch chunked scan where the
fla kernels are not installed (CPU): its chunk is 64 positions whatever the input, with a Python loop
over them, so a miniature shrinks its heads (``linear_num_heads``, ``linear_head_dim``) to stay fast.
"""

import transformers

from .base import Family
from .hybrid import _hybrid
from .moe import routed_layer

_KDA = _hybrid(mixer="self_attn", kind="Kimi Delta Attention (a linear attention)", is_routed=routed_layer,
               router_path="mlp.gate",
               input_norm="input_layernorm", post_norm="post_attention_layernorm", mlp="mlp", act="mlp.act_fn",
               down_proj="mlp.down_proj")
_SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, vocab_size=128, num_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_num_heads=4, linear_head_dim=16,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2)

KIMI_LINEAR = Family(name="Kimi-Linear", model_types=("kimi_linear",), block=_KDA,
                     tiny_config=lambda: transformers.KimiLinearConfig(**_SMALL))
BAILING_HYBRID = Family(name="Bailing-Hybrid", model_types=("bailing_hybrid",), block=_KDA,
                        premix_is_not_mixed_values="the latent attention multiplies each head's output by a sigmoid "
                                                   "gate (g_proj) before o_proj",
                        tiny_config=lambda: transformers.BailingHybridConfig(
                            **_SMALL, first_k_dense_replace=1, num_expert_group=2, topk_group=1))
