"""CPM-Ant: learned prompt positions prepended to the stream, and blocks that add inside two sub-blocks.

``CpmAntModel`` puts ``prompt_length`` learned prompt embeddings before the tokens, runs the blocks on
``[batch, prompt_length + seq, hidden]`` and drops the prompt positions after the final norm. Every value is
read without them (``At.prefix``, from the config's ``prompt_length``): position i of a value is token i. An
in-place edit changes those positions of the model's tensor; an assignment replaces them and leaves the prompt
positions as the model made them. (The model's own embedding output, ``model.embed_tokens``, keeps them.) The
model prepends them in full on a pass with an empty cache only: the values of a pass given a filled cache (a
generation's later steps too) are refused, since its stream holds other positions: trace without a cache.

A block ``encoder.layers[i]`` is ``self_att`` (``layernorm_before_attention``, ``self_attention``, its own add)
then ``ffn`` (``layernorm_before_ffn``, ``ffn``, its own add): the sequential identity, ``layer_mid`` being what
``ffn`` is called with. The attention computes its scores in its own code.
"""

import torch
import transformers

from .base import OWN_ATTENTION, Family, input, output, pre_norm_block


def _block(config, i):
    p = config.prompt_length  # the positions the model prepends to the tokens
    return pre_norm_block(
        input_norm="self_att.layernorm_before_attention", attention="self_att.self_attention",
        o_proj="self_att.self_attention.attention_out", post_norm="ffn.layernorm_before_ffn", mlp="ffn.ffn",
        act="ffn.ffn.w_in.act", down_proj="ffn.ffn.w_out",
        layer_input=input("", arg=0, prefix=p),
        attention_norm_output=output("self_att.layernorm_before_attention", prefix=p),
        attention_premix=input("self_att.self_attention.attention_out", heads=True, prefix=p),
        attention_output=output("self_att.self_attention", index=0, prefix=p),
        # what the ffn sub-block is called with: its norm's input and its residual, one tensor
        layer_mid=input("ffn", arg=0, prefix=p),
        mlp_norm_output=output("ffn.layernorm_before_ffn", prefix=p),
        mlp_input=input("ffn.ffn", prefix=p),
        mlp_activation=output("ffn.ffn.w_in.act", prefix=p),
        mlp_neurons=input("ffn.ffn.w_out", prefix=p),
        mlp_output=output("ffn.ffn", prefix=p),
        layer_output=output("", index=0, prefix=p),
    )


def _skipped(stream, block):
    """What a skipped block returns: its input's prompt positions then ``stream`` on the tokens, and no attention
    weights (the block returns ``(hidden, weights)``)."""
    full = block.inputs[0][0]
    return torch.cat((full[:, : full.shape[1] - stream.shape[1]], stream), dim=1), None


CPMANT = Family(
    name="CPM-Ant", model_types=("cpmant",), layers="cpmant.encoder.layers", embed_tokens="cpmant.input_embedding",
    ln_final="cpmant.encoder.output_layernorm", attention="self_att.self_attention", mlp="ffn.ffn", block=_block,
    attention_internals=OWN_ATTENTION,
    skip_output=_skipped,
    tiny_config=lambda: transformers.CpmAntConfig(
        vocab_size=128, hidden_size=64, num_attention_heads=4, dim_head=16, dim_ff=128, num_hidden_layers=3,
        position_bias_num_buckets=32, position_bias_max_distance=64, prompt_types=3, prompt_length=3,
        segment_types=4),
)
