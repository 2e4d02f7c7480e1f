"""Reformer: reversible blocks over a stream passed between them in two halves.

``ReformerModel`` concatenates the embeddings with themselves and splits the result into two halves
``[X1, X2]``. Each block ``encoder.layers[i]`` is called with them (``prev_attn_output=X1``,
``hidden_states=X2``) and returns ``ReformerOutput(hidden_states=Y2, attn_output=Y1)``:

    Y1 = X1 + attention(X2)        (attention: its own layer_norm, LSH or local self-attention, output.dense)
    Y2 = X2 + feed_forward(Y1)     (feed_forward: its own layer_norm, dense, act_fn, output.dense)

The final norm (``encoder.layer_norm``, over ``2 * hidden_size``) and the head read ``[Y1, Y2]`` of the last
block, so the stream is the concatenation ``[X1, X2]``: ``layer_input`` and ``layer_output`` are
``[batch, seq, 2 * hidden_size]``, read as the two tensors joined (``At.join``; edits go back to the model as the
two halves), and ``project_on_vocab`` reads it with the model's norm and head. ``attention_output`` adds to the
first half, ``mlp_output`` to the second. The MLP module ``feed_forward`` holds its own norm: ``mlp_input`` is
what its first layer (``dense``) is called with, the normed ``Y1``. The stream after the attention's add,
``[Y1, X2]``, is held by the model as two tensors at two moments (X2 at the block's input, Y1 at
``feed_forward``'s), so ``layer_mid`` is unavailable.

The model pads a sequence longer than its shortest chunk to a multiple of its chunk lengths (after the tokens);
every value is read without the padding (``At.count``, from the block's ``orig_sequence_length``). Attention is
computed chunk by chunk in the model's own code (sorted by hash bucket on LSH layers), so the values inside it are
unavailable. LSH attention draws random rotations on every pass unless ``config.hash_seed`` is set (loading warns;
the tests set it), and ``config.num_buckets`` left unset is fixed by the first long sequence the model sees. Its
blocks run under ``torch.no_grad()`` (the model recomputes them backwards in training), so no gradient reaches a
value. Skipping blocks needs ``use_cache=False``: the model's cache takes an entry from every block. On a batch
the model pads, its head reads a strided slice of the normed stream, which ``F.linear`` computes as a matmul then
the bias add (one fused addmm on a contiguous one): ``project_on_vocab`` of the last ``layer_output`` is then the
model's norm and head on the same values, and in bfloat16 its logits may differ from the model's by that rounding.
Prompts of different lengths are left-padded, with position ids (nnsight passes them): where the model must then
pad the batch to its chunk length too, transformers' Reformer fails building the padding's position ids (its own
code, given position ids): run such prompts one at a time, or at lengths the chunk lengths divide.
"""

import warnings

import torch
import transformers

from ..spec.errors import UnsupportedConfig
from ..spec.identity import Custom
from .base import Block, Family, Unavailable, input, output

COUNT = "orig_sequence_length"  # the block's keyword argument: how many positions are tokens
FORMULA = ("layer_output = cat(layer_input[..., :hidden] + attention_output, "
           "layer_input[..., hidden:] + mlp_output) (the mlp reads the first half of the result)")

NO_MID = Unavailable(
    "a reversible block: the stream after the attention's add is [Y1, X2], which the model holds as two tensors at "
    "two moments (X2 is the block's input hidden_states, Y1 what feed_forward is called with), never as one; read "
    "the second half of layer_input and feed_forward's input natively")
CHUNKED = Unavailable(
    "the feed-forward runs chunk by chunk along the sequence (config.chunk_size_feed_forward), so its norm, "
    "activation and neurons are one tensor per chunk; mlp_output, their concatenation, is available")


def _combine(t, _):
    x, half = t["layer_input"], t["attention_output"].shape[-1]
    return torch.cat((x[..., :half] + t["attention_output"], x[..., half:] + t["mlp_output"]), dim=-1)


def _block(config, i):
    chunked = bool(config.chunk_size_feed_forward)

    def at(where, path, **view):
        return where(path, count=COUNT, **view)

    return Block(
        values={
            "layer_input": at(input, "", join=(input("", arg=0, kwarg="prev_attn_output"),
                                               input("", arg=1, kwarg="hidden_states"))),
            "attention_norm_output": at(output, "attention.layer_norm"),
            "attention_premix": at(input, "attention.output.dense", heads=True),
            "attention_output": at(output, "attention", index=0),
            "layer_mid": NO_MID,
            "mlp_norm_output": CHUNKED if chunked else at(output, "feed_forward.layer_norm"),
            "mlp_input": CHUNKED if chunked else at(input, "feed_forward.dense"),
            "mlp_activation": CHUNKED if chunked else at(output, "feed_forward.dense.act_fn"),
            "mlp_neurons": CHUNKED if chunked else at(input, "feed_forward.output.dense"),
            "mlp_output": at(output, "feed_forward"),
            # ReformerOutput(hidden_states=Y2, attn_output=Y1, ...): the stream is [Y1, Y2]
            "layer_output": at(output, "", join=(output("", index=1), output("", index=0))),
        },
        identity=Custom(FORMULA, _combine, reads=("layer_input", "attention_output", "mlp_output")),
    )


def _skipped(stream, block):
    """What a skipped block returns: the stream's halves in its output's fields, its padding (if any) the block
    input's."""
    from transformers.models.reformer.modeling_reformer import ReformerOutput

    kwargs = block.inputs[1]
    if kwargs.get("use_cache") and kwargs.get("past_buckets_states") is not None:
        raise ValueError("Reformer's cache takes one entry from every block's attention, in order, so a skipped block "
                         "breaks it: trace with use_cache=False to skip blocks")
    whole = torch.cat((kwargs["prev_attn_output"], kwargs["hidden_states"]), dim=-1)
    whole = torch.cat((stream, whole[:, stream.shape[1]:]), dim=1)
    half = whole.shape[-1] // 2
    return ReformerOutput(hidden_states=whole[..., half:], attn_output=whole[..., :half], attention_probs=None,
                          buckets=None)


def _check(config):
    if not config.is_decoder:
        raise UnsupportedConfig("Reformer is a causal language model only with is_decoder=True in its config (its "
                                "attention is causal then); this config builds a bidirectional encoder")
    if "lsh" in config.attn_layers and config.hash_seed is None:
        warnings.warn("Reformer's LSH attention hashes with random rotations drawn on every pass (config.hash_seed is "
                      "None): two passes over the same tokens differ, so values compared across traces (patching, "
                      "steering against a clean run) mix in that randomness. Set a seed to compare them: "
                      "StandardizedTransformer(name, hash_seed=0).", stacklevel=2)


REFORMER = Family(
    name="Reformer", model_types=("reformer",),
    layers="reformer.encoder.layers", embed_tokens="reformer.embeddings.word_embeddings",
    ln_final="reformer.encoder.layer_norm", attention="attention", mlp="feed_forward", block=_block,
    check_config=_check,
    attention_internals=Unavailable(
        "Reformer computes attention in its own code, chunk by chunk: LSH layers hash shared query-key vectors into "
        "buckets and attend within chunks of the positions sorted by bucket, local layers within neighbouring chunks, "
        "so no [query, key] scores over the positions exist, and its queries and keys are not at module boundaries"),
    skip_output=_skipped,
    tiny_config=lambda: transformers.ReformerConfig(
        vocab_size=128, hidden_size=32, num_attention_heads=4, attention_head_size=8, feed_forward_size=64,
        attn_layers=["local", "lsh", "local", "lsh"], axial_pos_shape=(4, 8), axial_pos_embds_dim=(8, 24),
        max_position_embeddings=32, local_attn_chunk_length=2, lsh_attn_chunk_length=4, num_buckets=2,
        hash_seed=0, is_decoder=True, pad_token_id=1, eos_token_id=2),
)
