"""OPT (pre-norm, ``do_layer_norm_before=True``): the MLP's layers sit on the block itself.

There is no MLP module: ``final_layer_norm``, ``fc1``, ``activation_fn`` and ``fc2`` are the
block's own, and ``layers[i].mlp`` is the block. The block flattens the stream to
``[batch * seq, hidden]`` before them; the values keep ``[batch, seq, ...]``.
``final_layer_norm`` here is the block's MLP norm, not the model's final norm.
"""

from transformers import OPTConfig

from ..errors import UnsupportedConfig
from .base import Family, input, output, pre_norm_block


def _check(config):
    if not config.do_layer_norm_before:
        raise UnsupportedConfig(
            "OPT with do_layer_norm_before=False (OPT-350m) norms after each residual add: "
            "layer_output = LN(LN(x + a) + m), so no residual identity exists. Pre-norm OPT models are supported."
        )


OPT = Family(
    name="OPT",
    model_types=("opt",),
    layers="model.decoder.layers",
    embed_tokens="model.decoder.embed_tokens",
    ln_final="model.decoder.final_layer_norm",
    attention="self_attn",
    mlp=None,
    block=lambda config, i: pre_norm_block(
        input_norm="self_attn_layer_norm", attention="self_attn", o_proj="self_attn.out_proj",
        post_norm="final_layer_norm", mlp="fc1", act="activation_fn", down_proj="fc2",
        # the stream after the attention add, before the block flattens it (the add's result, read through .source)
        layer_mid=output("", op="hidden_states_2"), mlp_norm_output=output("final_layer_norm", unflatten=True),
        mlp_input=input("fc1", unflatten=True), mlp_activation=output("activation_fn", unflatten=True),
        mlp_neurons=input("fc2", unflatten=True), mlp_output=output("fc2", unflatten=True),
    ),
    tiny_config=lambda: OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, ffn_dim=128,
                                  vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=64),
    check_config=_check,
)
