"""GPT-2 and GPT-BigCode: sequential pre-norm with a plain GELU MLP (``mlp_neurons`` is ``mlp_activation``)."""

import transformers

from .base import STANDARD, EagerAttention, Family, pre_norm_block

# reorder_and_upcast_attn=True: the attention runs its own method instead of the attention interface
UPCAST_AND_REORDERED = EagerAttention(call="self__upcast_and_reordered_attn_0", queries_arg=0,
                                      probabilities="torch_matmul_0")

GPT2 = Family(
    name="GPT-2",
    model_types=("gpt2",),
    attention_internals=lambda config: UPCAST_AND_REORDERED if config.reorder_and_upcast_attn else STANDARD,
    layers="transformer.h",
    embed_tokens="transformer.wte",
    ln_final="transformer.ln_f",
    attention="attn",
    mlp="mlp",
    block=lambda config, i: pre_norm_block(
        input_norm="ln_1", attention="attn", o_proj="attn.c_proj", post_norm="ln_2",
        mlp="mlp", act="mlp.act", down_proj="mlp.c_proj",
    ),
    tiny_config=lambda: transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64),
)

GPT_BIGCODE = Family(
    name="GPT-BigCode",  # GPT-2's block with nn.Linear projections and multi-query attention
    model_types=("gpt_bigcode",),
    layers="transformer.h",
    embed_tokens="transformer.wte",
    ln_final="transformer.ln_f",
    attention="attn",
    mlp="mlp",
    block=GPT2.block,
    tiny_config=lambda: transformers.GPTBigCodeConfig(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                                      multi_query=True),
)
