"""Zamba and Zamba2: Mamba blocks, some of which first run a shared transformer whose output joins the Mamba's input.

Every block of ``model.layers`` adds one contribution to the stream, its Mamba's:

    layer_output = layer_input + mixer_output

On a ``"hybrid"`` block (``config.layers_block_type``) a transformer block (``shared_transf`` on Zamba,
``shared_transformer`` on Zamba2: attention and MLP, fed the stream and the token embeddings, its weights
shared by every hybrid block) and a linear map run first; their output is added to the stream *that
the Mamba reads* (``mamba_decoder``: ``x + mamba(norm(x + t))``), never to the stream itself. So
``attention_norm_output`` is ``norm(x + t)`` there, and the attention's and the MLP's values, which
would be contributions to the stream, are unavailable with the reason. The Mamba runs a pure-PyTorch
scan where the kernels are not installed (CPU).
"""

from __future__ import annotations

import transformers

from ..spec.identity import MIXER, Sum, X
from .base import Block, Family, SameAs, Unavailable, input, output
from .recurrent import MLP_VALUES, NO_ATTENTION, not_attention


def _zamba_block(shared: str):
    def block(config, i):
        hybrid = config.layers_block_type[i] == "hybrid"
        mamba = "mamba_decoder." if hybrid else ""
        side = (f"block {i} mixes tokens with a Mamba mixer, not attention: its shared transformer ({shared}) runs "
                "first, but its output is added to the Mamba's input, not to the stream, so the block's one "
                "contribution is mixer_output") if hybrid else None
        no_mlp = Unavailable(side or f"block {i} has no MLP: a Mamba block is one token mixer and its residual add")
        return Block(
            values={
                "layer_input": input("", arg=0),
                "attention_norm_output": output(f"{mamba}input_layernorm"),
                "mixer_output": output(f"{mamba}mamba"),
                "layer_mid": SameAs("layer_output"),  # the stream after the mixer's add is the block's output
                **dict.fromkeys(MLP_VALUES, no_mlp),
                "layer_output": output(""),
                **(dict.fromkeys(not_attention(i, ""), Unavailable(side)) if hybrid
                   else not_attention(i, "a Mamba mixer")),
            },
            identity=Sum(X + MIXER),
        )
    return block


_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, vocab_size=128, mamba_d_state=8,
              layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_hidden_layers=4)

ZAMBA = Family(
    name="Zamba", model_types=("zamba",), layers="model.layers", embed_tokens="model.embed_tokens",
    ln_final="model.final_layernorm", attention=None, mlp=None, block=_zamba_block("shared_transf"),
    attention_internals=NO_ATTENTION,
    tiny_config=lambda: transformers.ZambaConfig(
        **{**_SMALL, "layers_block_type": ["linear_attention", "hybrid"] * 2}, intermediate_size=128, n_mamba_heads=2,
        attn_layer_period=2, attn_layer_offset=1),
)
ZAMBA2 = Family(
    name="Zamba2", model_types=("zamba2",), layers="model.layers", embed_tokens="model.embed_tokens",
    ln_final="model.final_layernorm", attention=None, mlp=None, block=_zamba_block("shared_transformer"),
    attention_internals=NO_ATTENTION,
    tiny_config=lambda: transformers.Zamba2Config(
        **{**_SMALL, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"]}, intermediate_size=128,
        n_mamba_heads=8, chunk_size=16, num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=4),
)
