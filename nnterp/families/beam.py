"""Beam: Gemma-2's four norms with depth-scaled residual adds.

Each add weighs the stream and the contribution by the index ``k`` of the add (``2(i + 1)`` for
block ``i``'s attention add, one more for its MLP add), so the stream keeps a unit scale with depth:
``layer_mid = attention_output / sqrt(k) + layer_input * sqrt((k - 1) / k)`` and the same for the
MLP with ``k + 1``. The contributions are the outputs of the norms after the sublayers
(``post_attention_layernorm``, ``post_feedforward_layernorm``). The layers that
``mlp_layer_types`` marks sparse have a routed mixture for MLP. The attention gates each head's
output (a sigmoid of ``gate_proj``) before ``o_proj``, and the logits are softcapped in float32.
"""

import math

import torch
import transformers

from .base import ROUTED, Block, Custom, Family, output, pre_norm_block, qk_norms, router


def _add(branch, stream, k):
    """The model's own depth-scaled add, term for term."""
    return branch * (1.0 / math.sqrt(k)) + stream * math.sqrt((k - 1) / k)


def _block(config, i):
    k = 2 * (i + 1)
    routed = config.mlp_layer_types[i] == "sparse"
    base = pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="pre_feedforward_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj",
        attention_output=output("post_attention_layernorm"), mlp_output=output("post_feedforward_layernorm"),
        **({"mlp_activation": ROUTED, "mlp_neurons": ROUTED, **router("mlp.gate")} if routed else {}),
        **qk_norms(),  # each head's queries and keys, [batch, seq, heads, head_dim], before the rotary embedding
    )
    return Block(
        values=base.values,
        identity=Custom(
            f"layer_output = mlp_output / sqrt({k + 1}) + (attention_output / sqrt({k}) + layer_input * "
            f"sqrt({k - 1}/{k})) * sqrt({k}/{k + 1})",
            lambda t, block: _add(t["mlp_output"], _add(t["attention_output"], t["layer_input"], k), k + 1),
            reads=("layer_input", "attention_output", "mlp_output")),
    )


def _softcap_in_float32(logits: torch.Tensor, config) -> torch.Tensor:
    cap = config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits.float() / cap) * cap


BEAM = Family(
    name="Beam", model_types=("beam",), block=_block, logits_transform=_softcap_in_float32,
    premix_is_not_mixed_values="the attention gates each head's output (a sigmoid of gate_proj) before o_proj",
    tiny_config=lambda: transformers.BeamConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, max_position_embeddings=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, sliding_window=4, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"]),
)
