"""Llama 4: Llama's block with the MLP at ``feed_forward``, a routed mixture on the layers of ``moe_layers``.

The identity is the usual ``(x + a) + m``. A routed ``feed_forward`` works on the stream
flattened to ``[batch * seq, hidden]`` and returns ``(output, router_logits)``: ``mlp_output`` is
that output viewed as ``[batch, seq, hidden]``, and, every token running its own experts (with
the shared expert added in place), there is no single ``mlp_activation`` or ``mlp_neurons``.
The dense layers' ``feed_forward`` is the gated MLP (``activation_fn``, ``down_proj``).
"""

import transformers

from .base import ROUTED, Family, output, pre_norm_block, router


def _block(config, i):
    routed = i in (config.moe_layers or [])
    return pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp="feed_forward", act="feed_forward.activation_fn",
        down_proj="feed_forward.down_proj",
        # the router computes its logits with its own linear layer's forward
        **({"mlp_activation": ROUTED, "mlp_neurons": ROUTED, "mlp_output": output("feed_forward", unflatten=True),
            **router("feed_forward.router", op="forward_0")}
           if routed else {}),
    )


LLAMA4 = Family(
    name="Llama 4", model_types=("llama4_text",), mlp="feed_forward", block=_block,
    tiny_config=lambda: transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64, num_local_experts=4,
        moe_layers=[1], attention_chunk_size=4, no_rope_layer_interval=2),
)
