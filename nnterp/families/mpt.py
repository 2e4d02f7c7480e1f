"""MPT: sequential pre-norm; the MLP (``ffn``) adds the residual inside itself.

``ffn(norm_2(h), h)`` returns ``h + down_proj(...)``, so the MLP contribution is the output of
``ffn.down_proj``. The attention's add happens in the block (after ``resid_attn_dropout``),
so its contribution is the attention's output. The block returns a tuple.

The attention computes in its own forward: queries, keys and values are read where it splits the fused
projection into heads (the keys and values of this pass's positions, before the cache adds earlier ones; MPT
has no rotary embedding); the scores are its softmax's input, ``queries · keysᵀ · softmax_scale`` plus ALiBi
(``position_bias``: added to the scores, not to the queries or keys), masked; the probabilities are what its
last matmul mixes the values with.
"""

import transformers

from ..spec.attention import OwnCode
from .base import Family, output, pre_norm_block, stream_and_none

ATTENTION = OwnCode(places=(
    ("queries", "query_states_0", "output", 0), ("keys", "key_states_0", "output", 0),
    ("values", "value_states_0", "output", 0), ("attention_scores", "nn_functional_softmax_0", "input", 0),
    ("attention_probabilities", "torch_matmul_1", "input", 0)))

MPT = Family(
    name="MPT",
    attention_internals=ATTENTION,
    model_types=("mpt",),
    layers="transformer.blocks",
    embed_tokens="transformer.wte",
    ln_final="transformer.norm_f",
    attention="attn",
    mlp="ffn",
    block=lambda config, i: pre_norm_block(
        input_norm="norm_1", attention="attn", o_proj="attn.out_proj", post_norm="norm_2", mlp="ffn",
        act="ffn.act", down_proj="ffn.down_proj", mlp_output=output("ffn.down_proj"),
    ),
    skip_output=stream_and_none,
    tiny_config=lambda: transformers.MptConfig(n_layers=3, d_model=64, n_heads=4, vocab_size=128, max_seq_len=64),
)
