"""GPT-2: sequential pre-norm, Conv1D projections, plain GELU MLP (``mlp_neurons`` is ``mlp_activation``)."""

from transformers import GPT2Config

from .base import Family, pre_norm_block

GPT2 = Family(
    name="GPT-2",
    model_types=("gpt2",),
    layers="transformer.h",
    embed_tokens="transformer.wte",
    ln_final="transformer.ln_f",
    attention="attn",
    mlp="mlp",
    block=lambda config, i: pre_norm_block(
        input_norm="ln_1", attention="attn", o_proj="attn.c_proj", post_norm="ln_2",
        mlp="mlp", act="mlp.act", down_proj="mlp.c_proj",
    ),
    tiny_config=lambda: GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64),
)
