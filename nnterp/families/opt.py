"""OPT: the MLP's layers sit on the block itself; pre-norm blocks, or post-norm ones (OPT-350m).

There is no MLP module: ``final_layer_norm``, ``fc1``, ``activation_fn`` and ``fc2`` are the
block's own, and ``layers[i].mlp`` is the block. The block flattens the stream to
``[batch * seq, hidden]`` before them; the values keep ``[batch, seq, ...]``.
``final_layer_norm`` here is the block's MLP norm, not the model's final norm.

With ``do_layer_norm_before=False`` (OPT-350m) each block norms the stream after each residual add:

    n = self_attn_layer_norm(layer_input + attention_output)     (layer_mid: what the MLP reads, and its residual)
    layer_output = final_layer_norm(n + mlp_output)

No norm sits before either sublayer, so ``attention_norm_output`` and ``mlp_norm_output`` are unavailable, and
``mlp_input`` is a copy of ``layer_mid`` handed to the MLP alone (an edit of ``layer_mid`` reaches both). Such a
model has no final norm: ``model.ln_final`` does not exist and the head reads the last block's output. Where
``word_embed_proj_dim`` is not ``hidden_size`` (OPT-350m) the model projects the embeddings up to the stream
(``project_in``) and the stream down before the head (``project_out``, after the final norm if there is one):
``project_on_vocab`` runs ``project_out`` too.

The attention scales the query projection's output by ``1/sqrt(head_dim)`` before its attention function, and
passes that function ``scaling=1.0``: ``queries`` are read at the projection's output (``q_proj``, viewed per
head), before that scaling, as on every other family; keys, values, scores and probabilities are read in the
attention function, as on the others.
"""

import dataclasses
from dataclasses import dataclass

import transformers

from ..spec.sourced import sourced
from .base import At, EagerAttention, Family, input, output, post_norm_block, pre_norm_block


@sourced
@dataclass(frozen=True)
class UnscaledQueries(EagerAttention):
    """The standard places, but the queries at ``q_proj``'s output (the attention function's are pre-scaled)."""

    def locations(self, attention: str) -> dict[str, At]:
        return {**EagerAttention.locations(self, attention), "queries": At(attention, "output", op="self_q_proj_0", heads=True)}


def _block(config, i):
    # the activation's input, before the block unflattens it: fc1's output, [batch * seq, ffn_dim]
    block = _flat_block(config, i)
    return dataclasses.replace(block, values={**block.values,
                                              "mlp_pre_activation": input("activation_fn", unflatten=True)})


def _flat_block(config, i):
    if not config.do_layer_norm_before:
        return post_norm_block(
            first_norm="self_attn_layer_norm", second_norm="final_layer_norm", attention="self_attn",
            o_proj="self_attn.out_proj", why=" (do_layer_norm_before=False)",
            mlp_input=input("fc1", unflatten=True, copy=True), mlp_activation=output("activation_fn", unflatten=True),
            mlp_neurons=input("fc2", unflatten=True), mlp_output=output("fc2", unflatten=True))
    return pre_norm_block(
        input_norm="self_attn_layer_norm", attention="self_attn", o_proj="self_attn.out_proj",
        post_norm="final_layer_norm", mlp="fc1", act="activation_fn", down_proj="fc2",
        # the stream after the attention add, before the block flattens it (the add's result, read through .source)
        layer_mid=output("", op="hidden_states_2"), mlp_norm_output=output("final_layer_norm", unflatten=True),
        mlp_input=input("fc1", unflatten=True), mlp_activation=output("activation_fn", unflatten=True),
        mlp_neurons=input("fc2", unflatten=True), mlp_output=output("fc2", unflatten=True),
    )


def _per_config(config) -> dict:
    """The modules after the blocks, as OPTDecoder builds them for this config."""
    changes = {}
    if not config.do_layer_norm_before or getattr(config, "_remove_final_layer_norm", False):
        changes["ln_final"] = None  # the decoder's final_layer_norm is None
    if config.word_embed_proj_dim != config.hidden_size:
        changes["head_input"] = "model.decoder.project_out"
    return changes


OPT = Family(
    name="OPT",
    model_types=("opt",),
    layers="model.decoder.layers",
    embed_tokens="model.decoder.embed_tokens",
    ln_final="model.decoder.final_layer_norm",
    attention="self_attn",
    mlp=None,
    block=_block,
    attention_internals=UnscaledQueries(),
    tiny_config=lambda: transformers.OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, ffn_dim=128,
                                               vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=64),
    variants=(("pre-norm", {}), ("post-norm (OPT-350m)", {"do_layer_norm_before": False, "word_embed_proj_dim": 32})),
    per_config=_per_config,
)
