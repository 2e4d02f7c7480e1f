"""GPT-Neo: sequential pre-norm; the block returns ``(hidden, attn_weights)``.

``attn`` is a thin wrapper around ``attn.attention``, which owns the projections.
Layers alternate global and local attention.
"""

import transformers

from .base import OWN_ATTENTION, Family, pre_norm_block, stream_and_none

GPT_NEO = Family(
    name="GPT-Neo",
    attention_internals=OWN_ATTENTION,
    model_types=("gpt_neo",),
    layers="transformer.h",
    embed_tokens="transformer.wte",
    ln_final="transformer.ln_f",
    attention="attn",
    mlp="mlp",
    block=lambda config, i: pre_norm_block(
        input_norm="ln_1", attention="attn", o_proj="attn.attention.out_proj", post_norm="ln_2",
        mlp="mlp", act="mlp.act", down_proj="mlp.c_proj",
    ),
    skip_output=stream_and_none,
    tiny_config=lambda: transformers.GPTNeoConfig(
        num_layers=3, hidden_size=64, num_heads=4, vocab_size=128, max_position_embeddings=64,
        attention_types=[[["global", "local"], 1], [["global"], 1]], window_size=4, intermediate_size=128,
    ),
)
