"""DBRX: the attention half of each block is one module, ``norm_attn_norm``, and the MLP a routed mixture.

``norm_attn_norm`` norms the stream (``norm_1``), runs the attention (``attn``), adds its output to
the stream and norms the sum (``norm_2``); it returns ``(residual, normed)``: the stream after the
attention's add (``layer_mid``, also ``norm_2``'s input) and the MLP's input. The block then runs
``ffn`` (a router and experts, so no single activation) and adds its output to ``layer_mid``:
``layer_output = (attention_output + layer_input) + mlp_output``, in the code's order.
"""

import transformers

from .base import ROUTED, A, Family, M, Sum, X, pre_norm_block, router

DBRX = Family(
    name="DBRX", model_types=("dbrx",), layers="transformer.blocks", embed_tokens="transformer.wte",
    ln_final="transformer.norm_f", attention="norm_attn_norm.attn", mlp="ffn",
    block=lambda config, i: pre_norm_block(
        input_norm="norm_attn_norm.norm_1", attention="norm_attn_norm.attn", o_proj="norm_attn_norm.attn.out_proj",
        post_norm="norm_attn_norm.norm_2", mlp="ffn", act="", down_proj="", mlp_activation=ROUTED,
        mlp_neurons=ROUTED, identity=Sum((A + X) + M), **router("ffn.router.layer", op="")),  # its linear layer computes the logits
    # checkpoints set clip_qkv and attn_config.rope_theta (the attention reads it), which the default leaves out
    tiny_config=lambda: transformers.DbrxConfig(
        d_model=64, n_heads=4, n_layers=3, max_seq_len=64, vocab_size=128,
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
)
