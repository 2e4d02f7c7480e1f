"""MPT: sequential pre-norm; the MLP (``ffn``) adds the residual inside itself.

``ffn(norm_2(h), h)`` returns ``h + down_proj(...)``, so the MLP contribution is the output of
``ffn.down_proj``. The attention's add happens in the block (after ``resid_attn_dropout``),
so its contribution is the attention's output. The block returns a tuple.
"""

import transformers

from .base import OWN_ATTENTION, Family, output, pre_norm_block, stream_and_none

MPT = Family(
    name="MPT",
    attention_internals=OWN_ATTENTION,
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
