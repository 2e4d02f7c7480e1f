"""Blocks that gate the carried stream per channel before each add: Doge and ZAYA.

Doge: ``layer_mid = input_residual * layer_input + attention_output`` and
``layer_output = post_attention_residual * layer_mid + mlp_output``, with ``[hidden]``
parameters of the block. Its mixture-of-experts MLP (``is_moe``) returns a tuple, runs its
activation twice, and routes with product keys: no single activation.

ZAYA: each add is a ``ZayaResidualScaling`` module, ``(branch + hb) * hs + (stream + rb) * rs``,
so ``layer_mid`` and ``layer_output`` are those modules' outputs and the contributions are the
raw sublayer outputs. The stream is float32 whatever the weights' dtype; the block returns
``(hidden, router_state)``. Its MLP is a routed mixture.
"""

import transformers

from .base import ROUTED, A, Custom, Family, M, Sum, X, output, pre_norm_block, qk_norms

_SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64)


def _doge_block(config, i):
    return pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj",
        identity=Sum("post_attention_residual" * ("input_residual" * X + A) + M),
        **({"mlp_activation": ROUTED, "mlp_neurons": ROUTED} if config.is_moe else {}),
        **qk_norms(),  # each head's queries and keys, [batch, seq, heads, head_dim], before the rotary embedding
    )


def _scaled(scaling, branch, stream):
    return (branch + scaling.hidden_states_bias) * scaling.hidden_states_scale + (
        stream + scaling.residual_bias) * scaling.residual_scale


def _zaya_block(config, i):
    return pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp="mlp", act="", down_proj="",
        layer_mid=output("post_attention_residual_scale"), mlp_activation=ROUTED, mlp_neurons=ROUTED,
        identity=Custom(
            "layer_mid = (attention_output + hb1) * hs1 + (layer_input + rb1) * rs1; "
            "layer_output = (mlp_output + hb2) * hs2 + (layer_mid + rb2) * rs2 "
            "(the parameters of post_attention_residual_scale and post_mlp_residual_scale)",
            lambda t, block: _scaled(block.post_mlp_residual_scale, t["mlp_output"],
                                     _scaled(block.post_attention_residual_scale, t["attention_output"], t["layer_input"])),
            reads=("layer_input", "attention_output", "mlp_output")),
    )


DOGE = Family(
    name="Doge", model_types=("doge",), block=_doge_block,
    tiny_config=lambda: transformers.DogeConfig(**_SMALL, intermediate_size=128, keep_window_size=2048),
    variants=(("a dense MLP", {}), ("`is_moe=True`", {"is_moe": True, "num_experts": 16, "num_experts_per_tok": 4})),
)
ZAYA = Family(
    name="ZAYA", model_types=("zaya",), block=_zaya_block,
    skip_output=lambda stream, block: (stream, block.inputs[0][1]),  # pass the router state on
    tiny_config=lambda: transformers.ZayaConfig(**_SMALL, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                                num_experts_per_tok=1, router_hidden_size=16),
)
