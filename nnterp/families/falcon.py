"""Falcon, in four configurations and three block shapes.

- ``parallel_attn=True`` (7B style): parallel, one shared ``input_layernorm``.
- ``parallel_attn=False`` (RW style, ALiBi or RoPE): sequential pre-norm.
- ``new_decoder_architecture=True`` (40B style): parallel, ``ln_attn`` and ``ln_mlp`` on the
  same input; with ``num_ln_in_parallel_attn=1`` one shared ``input_layernorm``.

Parallel blocks sum ``(m + a) + x`` and do it in place: ``mlp_output += attention_output``
on the MLP's returned tensor. ``mlp_output`` is therefore read as a copy there (an in-place
edit of it does not reach the model; assigning it does). The block returns a tuple.

The attention computes in its own forward, in two ways:

- with rotary embeddings (``alibi=False``): the queries are read after the rotary embedding; the keys and
  values where the cache hands them back (after the rotary embedding, with the cache's earlier positions, as the
  attention uses them: the values are computed before the queries are rotated, and a block's values are read
  in the order queries, keys, values, so they are read there; a pass run without the KV cache,
  ``use_cache=False``, never reaches them). The scores are its softmax's input,
  ``queries · keysᵀ / sqrt(head_dim)`` plus the mask; the probabilities its softmax's output.
- with ALiBi (``alibi=True``): queries, keys and values are read where the fused projection is split into
  heads (this pass's positions, before the cache adds earlier ones); the scores are its softmax's input,
  ``(queries · keysᵀ + alibi) * inv_norm_factor`` plus the mask (ALiBi is added to the scores, and scaled with
  them); the probabilities are the pattern after its dropout.

With one key-value head (``multi_query``) the keys and values have one head; the new architecture
(``new_decoder_architecture=True``) repeats each key-value head for its query heads when it splits the fused
projection, so its keys and values have one head per query head.

From transformers 5.25 on, Falcon's attention calls transformers' attention interface, as Llama's does (ALiBi
comes in the attention mask): its internals are read at the standard places there, where the installed
``FalconAttention`` calls it, and the keys and values of the new architecture have their key-value heads.
"""

import inspect

import transformers

from ..spec.attention import STANDARD, OwnCode
from ..spec.errors import UnsupportedConfig
from .base import Family, output, parallel_block, pre_norm_block, stream_and_none

ROTARY = OwnCode(places=(
    ("queries", "apply_rotary_pos_emb_0", "output", 0), ("keys", "layer_past_update_0", "output", 0),
    ("values", "layer_past_update_0", "output", 1), ("attention_scores", "F_softmax_0", "input", 0),
    ("attention_probabilities", "F_softmax_0", "output", 0)))
ALIBI = OwnCode(places=(
    ("queries", "query_layer_0", "output", 0), ("keys", "key_layer_0", "output", 0),
    ("values", "value_layer_0", "output", 0), ("attention_scores", "F_softmax_1", "input", 0),
    ("attention_probabilities", "attention_probs_2", "output", 0)))

_MODULES = dict(attention="self_attention", o_proj="self_attention.dense", mlp="mlp", act="mlp.act",
                down_proj="mlp.dense_4h_to_h")


def _attention(config):
    """The places of the attention's internals in the installed transformers' ``FalconAttention``: its own code
    (up to transformers 5.24), or its call of the attention interface (5.25 on)."""
    from transformers.models.falcon.modeling_falcon import FalconAttention

    if "attention_interface(" in inspect.getsource(FalconAttention.forward):
        return STANDARD
    return ALIBI if config.alibi else ROTARY


def _check(config):
    if config.new_decoder_architecture and not config.parallel_attn:
        raise UnsupportedConfig(
            "Falcon with new_decoder_architecture=True and parallel_attn=False fails in transformers' own forward "
            "(FalconDecoderLayer has no ln_attn). Use parallel_attn=True with the new architecture."
        )


def _block(config, i):
    if not config.parallel_attn:
        return pre_norm_block(input_norm="input_layernorm", post_norm="post_attention_layernorm", **_MODULES)
    # transformers sets an unset num_ln_in_parallel_attn to 2 on the new architecture when it builds the model
    two_norms = config.new_decoder_architecture and config.num_ln_in_parallel_attn in (None, 2)
    return parallel_block(
        input_norm="ln_attn" if two_norms else "input_layernorm", mlp_norm="ln_mlp" if two_norms else None,
        order="(m + a) + x", mlp_output=output("mlp", copy=True), **_MODULES,
    )


FALCON = Family(
    name="Falcon",
    attention_internals=_attention,
    model_types=("falcon",),
    layers="transformer.h",
    embed_tokens="transformer.word_embeddings",
    ln_final="transformer.ln_f",
    attention="self_attention",
    mlp="mlp",
    block=_block,
    skip_output=stream_and_none,
    tiny_config=lambda: transformers.FalconConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=3, vocab_size=128, new_decoder_architecture=False,
        parallel_attn=True, multi_query=True),
    check_config=_check,
    variants=(("`parallel_attn=True` (7B style)", {}),
              ("`parallel_attn=False` (RW style)", {"parallel_attn": False}),
              ("`new_decoder_architecture=True` (40B style)", {"new_decoder_architecture": True, "num_kv_heads": 2}),
              ("`new_decoder_architecture=True, num_ln_in_parallel_attn=1`",
               {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1})),
)
