"""GPT-Neo: sequential pre-norm; the block returns ``(hidden, attn_weights)``.

``attn`` is a thin wrapper around ``attn.attention``, which owns the projections.
Layers alternate global and local attention.

The attention computes in its own ``_attn`` method, called by ``attn.attention``: queries, keys and values are
its arguments (the keys and values with the cache's earlier positions, as the attention uses them); the scores
are its softmax's input: ``queries · keysᵀ`` unscaled (GPT-Neo has no ``1/sqrt(head_dim)``), masked (the
causal mask, and the local window on local layers); the probabilities are what its last matmul mixes the
values with.
"""

import transformers

from ..spec.attention import OwnCode
from .base import Family, pre_norm_block, stream_and_none

ATTENTION = OwnCode(module="attention", places=(
    ("queries", "self__attn_0", "input", 0), ("keys", "self__attn_0", "input", 1),
    ("values", "self__attn_0", "input", 2),
    ("attention_scores", "self__attn_0.nn_functional_softmax_0", "input", 0),
    ("attention_probabilities", "self__attn_0.torch_matmul_1", "input", 0)))

GPT_NEO = Family(
    name="GPT-Neo",
    attention_internals=ATTENTION,
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
