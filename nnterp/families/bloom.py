"""BLOOM: sequential pre-norm whose residual adds happen inside the modules.

``self_attention`` and ``mlp`` each return ``residual + contribution``, so their outputs
are the stream, not what they add. The contributions are the tensors entering those
adds: the outputs of ``self_attention.dense`` and ``mlp.dense_4h_to_h``. The block
returns ``(hidden, attention_probs)``.

The attention computes in its own forward: queries, keys and values are read where it splits the fused
projection into heads (``_reshape``: the keys and values of this pass's positions, before the cache adds
earlier ones); the scores are its softmax's input, ``alibi.baddbmm(queries, keysᵀ, beta=1, alpha=1/sqrt(head_dim))``
plus the mask (ALiBi is added to the scores, not to the queries or keys); the probabilities are the pattern after
its dropout, which its last matmul mixes the values with.
"""

import transformers

from ..spec.attention import OwnCode
from ..spec.errors import UnsupportedConfig
from .base import Family, output, pre_norm_block, stream_and_none

ATTENTION = OwnCode(places=(
    ("queries", "self__reshape_0", "output", 0), ("keys", "self__reshape_0", "output", 1),
    ("values", "self__reshape_0", "output", 2), ("attention_scores", "F_softmax_0", "input", 0),
    ("attention_probabilities", "attention_probs_1", "output", 0)))


def _check(config):
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        raise UnsupportedConfig(
            "BLOOM with apply_residual_connection_post_layernorm=True carries the norm's output, not the "
            "residual stream, between blocks (layer_output = ln2(ln1(x) + a) + m): the residual identity "
            "does not exist, so the standard values would be wrong. Use a config with it set to False."
        )
    if getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
        raise UnsupportedConfig(
            "BLOOM with pretraining_tp > 1 and slow_but_exact=True never calls self_attention.dense or "
            "mlp.dense_4h_to_h, where the contributions are read. Set slow_but_exact=False."
        )


BLOOM = Family(
    name="BLOOM",
    attention_internals=ATTENTION,
    model_types=("bloom",),
    layers="transformer.h",
    embed_tokens="transformer.word_embeddings",
    ln_final="transformer.ln_f",
    attention="self_attention",
    mlp="mlp",
    block=lambda config, i: pre_norm_block(
        input_norm="input_layernorm", attention="self_attention", o_proj="self_attention.dense",
        post_norm="post_attention_layernorm", mlp="mlp", act="mlp.gelu_impl", down_proj="mlp.dense_4h_to_h",
        attention_output=output("self_attention.dense"), mlp_output=output("mlp.dense_4h_to_h"),
    ),
    skip_output=stream_and_none,
    tiny_config=lambda: transformers.BloomConfig(n_layer=3, hidden_size=64, n_head=4, vocab_size=128),
    check_config=_check,
)
