"""HY-V4: ``hc_mult`` parallel streams, each sublayer's output broadcast into them with per-stream weights.

As in DeepSeek-V4, the stream entering and leaving a block is ``[batch, seq, streams, hidden]`` and
each sublayer reads a collapse of the streams (``attn_hc`` / ``ffn_hc``, whose first output is the
per-stream weights ``post``). Unlike DeepSeek-V4 there is no mixing matrix: the streams themselves
are the residual, and the add runs in float32 before the cast back:

    layer_mid    = (attn_post[..., None] * attention_output[..., None, :] + layer_input)   in float32
    layer_output = (ffn_post[..., None] * mlp_output[..., None, :] + layer_mid)            in float32

The attention is latent attention with a learned top-k token selection (an indexer), per-head sinks
and a sigmoid gate on each head's output; the MLP is dense on the layers ``mlp_layer_types`` calls
``"dense"`` and a routed mixture with a shared expert on the others.
"""

import transformers

from ..spec.identity import Custom
from .base import ROUTED, WITH_SINKS, Block, Family, input, output, pre_norm_block

FORMULA = ("layer_mid = (attn_post[..., None] * attention_output[..., None, :] + layer_input); "
           "layer_output = (ffn_post[..., None] * mlp_output[..., None, :] + layer_mid) "
           "(each add in float32, cast back to the stream's dtype; post: element 0 of attn_hc / ffn_hc outputs)")


def _broadcast_add(post, branch, streams):
    return (post.float().unsqueeze(-1) * branch.float().unsqueeze(-2) + streams.float()).to(streams.dtype)


def _block(config, i):
    routed = config.mlp_layer_types[i] == "sparse"
    base = pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj",
        layer_mid=input("ffn_hc", shared=True), mlp_norm_output=output("post_attention_layernorm"),
        **({"mlp_activation": ROUTED, "mlp_neurons": ROUTED} if routed else {}),
    )
    return Block(
        values=base.values,
        identity=Custom(FORMULA, lambda t, _: _broadcast_add(t["ffn_post"], t["mlp_output"], _broadcast_add(
            t["attn_post"], t["attention_output"], t["layer_input"])),
            reads=("layer_input", "attention_output", "mlp_output", "attn_post", "ffn_post")),
        extra={"attn_post": output("attn_hc", index=0), "ffn_post": output("ffn_hc", index=0)},
    )


HY_V4 = Family(
    name="HY-V4",
    model_types=("hy_v4",),
    block=_block,
    attention_internals=WITH_SINKS,
    stream_readout="model.hc_head",  # collapses the streams before the final norm
    premix_is_not_mixed_values="each head's output is multiplied by a sigmoid gate (gate_proj) before o_proj",
    tiny_config=lambda: transformers.HYV4Config(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        vocab_size=128, max_position_embeddings=64, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, index_topk=4,
        index_head_dim=16, index_n_heads=2, hc_mult=3, mlp_layer_types=["dense", "sparse", "sparse"],
        indexer_types=["full", "shared", "full"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
)
