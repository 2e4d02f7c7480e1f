"""GPT-J and CodeGen: a parallel block with one shared norm, ``y = (a + m) + x``.

Attention and MLP both read ``ln_1(x)``, so ``mlp_norm_output`` is ``attention_norm_output``
and there is no ``layer_mid``.
"""

import transformers

from .base import Family, parallel_block


def _gptj_like(name, model_type, tiny_config):
    return Family(
        name=name,
        model_types=(model_type,),
        layers="transformer.h",
        embed_tokens="transformer.wte",
        ln_final="transformer.ln_f",
        attention="attn",
        mlp="mlp",
        block=lambda config, i: parallel_block(
            input_norm="ln_1", attention="attn", o_proj="attn.out_proj", mlp="mlp", act="mlp.act",
            down_proj="mlp.fc_out", order="(a + m) + x",
        ),
        tiny_config=tiny_config,
    )


GPTJ = _gptj_like("GPT-J", "gptj", lambda: transformers.GPTJConfig(n_layer=3, n_embd=64, n_head=4, vocab_size=128,
                                                                   n_positions=64, rotary_dim=8))
CODEGEN = _gptj_like("CodeGen", "codegen", lambda: transformers.CodeGenConfig(n_layer=3, n_embd=64, n_head=4,
                                                                              vocab_size=128, n_positions=64,
                                                                              rotary_dim=8))
