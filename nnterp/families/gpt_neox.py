"""GPT-NeoX / Pythia, parallel (``use_parallel_residual=True``, Pythia's default) or sequential.

Parallel: ``y = (mlp_output + attention_output) + layer_input``, where the attention reads
``input_layernorm(x)`` and the MLP ``post_attention_layernorm(x)``, two norms of the same
input; there is no ``layer_mid``. The plain sum ``layer_input + attention_output +
mlp_output`` is within one ulp. Sequential: the usual ``(x + a) + m``, exact.
"""

from transformers import GPTNeoXConfig

from .base import Block, Family, input, output, pre_norm_block
from .gptj import PARALLEL_NO_MID


def _block(config, i):
    sequential = pre_norm_block(
        input_norm="input_layernorm", attention="attention", o_proj="attention.dense",
        post_norm="post_attention_layernorm", mlp="mlp", act="mlp.act", down_proj="mlp.dense_4h_to_h",
    )
    if not config.use_parallel_residual:
        return sequential
    return Block(
        values={
            **sequential.values,
            "layer_mid": PARALLEL_NO_MID,
            "mlp_norm_output": output("post_attention_layernorm"),
            "mlp_input": input("mlp"),
        },
        formula="layer_output = (mlp_output + attention_output) + layer_input",
        combine=lambda t, _: (t["mlp_output"] + t["attention_output"]) + t["layer_input"],
        ulps=1,
    )


GPT_NEOX = Family(
    name="GPT-NeoX",
    model_types=("gpt_neox",),
    layers="gpt_neox.layers",
    embed_tokens="gpt_neox.embed_in",
    ln_final="gpt_neox.final_layer_norm",
    attention="attention",
    mlp="mlp",
    block=_block,
    tiny_config=lambda: GPTNeoXConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=128, vocab_size=128,
        max_position_embeddings=64, use_parallel_residual=True,
    ),
)
