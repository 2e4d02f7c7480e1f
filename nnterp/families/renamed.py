"""Llama's block under other module names: StarCoder2, GLM, nanochat, VaultGemma, Apertus, Persimmon.

Each is the sequential pre-norm block, ``h = x + attn(norm1(x)); y = h + mlp(norm2(h))``, so the
identity is the usual ``(x + a) + m``; only the modules are named otherwise. ``mlp_activation``
is the MLP's activation module's output and ``mlp_neurons`` what its down projection sums: the
same tensor where the MLP is not gated (StarCoder2, nanochat, Apertus, Persimmon), the activation
times the up projection where it is (GLM computes gate and up in one ``gate_up_proj``).
VaultGemma norms before the MLP in ``pre_feedforward_layernorm``; Apertus names its norms
``attention_layernorm`` and ``feedforward_layernorm``; Persimmon has NeoX-style names and its
final norm is ``model.final_layernorm``. nanochat and VaultGemma softcap their logits,
``tanh(logits / cap) * cap``.
"""

import transformers

from ..spec.views import Half
from .base import At, Family, pre_norm_block, qk_norms, softcap_logits

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=128,
              max_position_embeddings=64)


def _renamed(name, model_types, tiny_config, *, act, down_proj, input_norm="input_layernorm",
             post_norm="post_attention_layernorm", o_proj="self_attn.o_proj", ln_final="model.norm",
             qk_norm=None, up=None, **readout):
    """``qk_norm``: given the config, the names of the attention's query and key norms, each norming a head's
    queries or keys (``[batch, seq, heads, head_dim]``, or with ``"first"`` after them ``[batch, heads, seq,
    head_dim]``), or None where it has none. ``up``: a gated MLP's up projection (``pre_norm_block``'s)."""
    def block(config, i):
        names = qk_norm(config) if qk_norm else None
        return pre_norm_block(input_norm=input_norm, attention="self_attn", o_proj=o_proj, post_norm=post_norm,
                              mlp="mlp", act=act, down_proj=down_proj, up=up,
                              **(qk_norms(q=names[0], k=names[1], heads_first="first" in names) if names else {}))
    return Family(name=name, model_types=model_types, ln_final=ln_final, block=block,
                  tiny_config=tiny_config, **readout)


STARCODER2 = _renamed("StarCoder2", ("starcoder2",),
                      lambda: transformers.Starcoder2Config(**_SMALL, num_key_value_heads=2),
                      act="mlp.act", down_proj="mlp.c_proj")
GLM = _renamed("GLM", ("glm",), lambda: transformers.GlmConfig(**_SMALL, num_key_value_heads=2, head_dim=16,
                                                               pad_token_id=0, eos_token_id=2),
               act="mlp.activation_fn", down_proj="mlp.down_proj",
               up=At("mlp.gate_up_proj", "output", views=(Half(1),)))  # [gate | up], chunked
NANOCHAT = _renamed("nanochat", ("nanochat",), lambda: transformers.NanoChatConfig(**_SMALL, num_key_value_heads=2),
                    act="mlp.activation_fn", down_proj="mlp.fc2", logits_transform=softcap_logits,
                    # nanochat norms after the rotary embedding (unlike the others): its query_norm_input is the
                    # rotated queries, and its key_norm_output the keys the scores use at every position
                    qk_norm=lambda config: ("q_norm", "k_norm", "first"))
VAULTGEMMA = _renamed("VaultGemma", ("vaultgemma",), lambda: transformers.VaultGemmaConfig(
    **_SMALL, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4),
    act="mlp.act_fn", down_proj="mlp.down_proj", post_norm="pre_feedforward_layernorm", logits_transform=softcap_logits,
    up="mlp.up_proj")
APERTUS = _renamed("Apertus", ("apertus",), lambda: transformers.ApertusConfig(**_SMALL, num_key_value_heads=2),
                   act="mlp.act_fn", down_proj="mlp.down_proj", input_norm="attention_layernorm",
                   post_norm="feedforward_layernorm", qk_norm=lambda config: ("q_norm", "k_norm", "first"))
PERSIMMON = _renamed("Persimmon", ("persimmon",), lambda: transformers.PersimmonConfig(**_SMALL),
                     act="mlp.act", down_proj="mlp.dense_4h_to_h", o_proj="self_attn.dense",
                     ln_final="model.final_layernorm",
                     qk_norm=lambda config: ("q_layernorm", "k_layernorm") if config.qk_layernorm else None)
