"""DeepSeek-V4: ``hc_mult`` parallel streams mixed by hyper-connections.

The stream entering and leaving a block is ``[batch, seq, streams, hidden]``. Each sublayer
reads a collapse of the streams (``attn_hc`` / ``ffn_hc``, which also give per-stream weights
``post`` and a doubly-stochastic mixing matrix ``comb``), and its ``[batch, seq, hidden]``
output is broadcast into every stream:

    layer_mid    = attn_post[..., None] * attention_output[..., None, :] + attn_combᵀ @ layer_input
    layer_output = ffn_post[..., None] * mlp_output[..., None, :] + ffn_combᵀ @ layer_mid

The attention has no ``o_proj``: the heads go through the grouped ``o_a_proj`` and then
``o_b_proj``; ``attention_premix`` is ``o_a_proj``'s input viewed per head. The MLP is a routed
mixture (top-k or hash routing).

On a compressed attention layer (``compressed_sparse_attention``, ``heavily_compressed_attention``)
a compressor pools the stream into extra key-value entries that join the window's keys: the key
axis there is the window's positions followed by the pooled entries, so ``keys``, ``values``, the
scores and the probabilities over them are unavailable on those layers (``queries`` stay).
"""

import torch
import transformers

from ..spec.identity import Custom
from .base import ROUTED, WITH_SINKS, Block, Family, Unavailable, input, output, pre_norm_block

FORMULA = ("layer_mid = attn_post[..., None] * attention_output[..., None, :] + attn_comb^T @ layer_input; "
           "layer_output = ffn_post[..., None] * mlp_output[..., None, :] + ffn_comb^T @ layer_mid "
           "(post and comb: elements 0 and 1 of attn_hc / ffn_hc outputs, cast to the stream's dtype)")


def _mix(post, comb, branch, streams):
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * branch.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


_COMPRESSED = Unavailable(
    "a compressed attention layer: its keys and values are the window's positions followed by the entries its "
    "compressor pools from the stream, so they, and the scores and probabilities over them, have no key axis of "
    "token positions")


def _block(config, i):
    base = pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_a_proj",
        post_norm="post_attention_layernorm", mlp="mlp", act="", down_proj="",
        layer_mid=input("ffn_hc", shared=True), mlp_norm_output=output("post_attention_layernorm"),
        mlp_activation=ROUTED, mlp_neurons=ROUTED,
    )
    compressed = config.layer_types[i] != "sliding_attention"
    over_keys = ("keys", "values", "attention_scores", "attention_probabilities")
    return Block(
        values={**base.values, **(dict.fromkeys(over_keys, _COMPRESSED) if compressed else {})},
        identity=Custom(FORMULA, lambda t, _: _mix(t["ffn_post"], t["ffn_comb"], t["mlp_output"], _mix(
            t["attn_post"], t["attn_comb"], t["attention_output"], t["layer_input"])),
            reads=("layer_input", "attention_output", "mlp_output", "attn_post", "attn_comb", "ffn_post", "ffn_comb")),
        extra={"attn_post": output("attn_hc", index=0), "attn_comb": output("attn_hc", index=1),
               "ffn_post": output("ffn_hc", index=0), "ffn_comb": output("ffn_hc", index=1)},
    )


DEEPSEEK_V4 = Family(
    name="DeepSeek-V4",
    model_types=("deepseek_v4",),
    block=_block,
    attention_internals=WITH_SINKS,
    stream_readout="model.hc_head",  # collapses the streams before the final norm
    premix_is_not_mixed_values="each head's mixed values are rotated back (conjugate RoPE) before the grouped "
                               "output projection, so attention_premix is the rotated mix",
    tiny_config=lambda: transformers.DeepseekV4Config(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=128, max_position_embeddings=64,
        num_key_value_heads=1, head_dim=16, q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, hc_mult=4, hc_sinkhorn_iters=5, o_groups=2, o_lora_rank=16, sliding_window=8,
        index_n_heads=2, index_head_dim=16, index_topk=4,
        layer_types=["sliding_attention"] * 3, mlp_layer_types=["hash_moe", "moe", "moe"],
    ),
)
