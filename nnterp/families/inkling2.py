"""Inkling-2 (text): attention residuals over blocks of layers, each contribution through a short convolution.

The layers are grouped in blocks of ``n_layers_per_attn_res_block``. The stream a layer receives
(``layer_input``) is the partial sum of its block so far; the summaries of the earlier blocks
(``block_states``, the layer's second input) are kept aside. Neither sublayer reads the stream
itself: each reads a learned attention mix of the block states and the partial sum, normed
(``attention_input``, three mixes on a full-attention layer: for the queries, keys and values;
``mlp_input`` for the MLP). Their outputs go through short convolutions
(``post_attention_convolution``, ``post_mlp_convolution``, computed in float32 and cast back)
before they are added, so the contributions are read there. The partial sum is carried in float32
between the two adds and cast back at the end:

    layer_mid    = layer_input.float() + attention_output.float()
    layer_output = (layer_mid + mlp_output).to(layer_input.dtype)

On the first layer of a block (``is_block_boundary``) the stream restarts: the incoming partial sum
becomes the summary of the block it ended (appended to ``block_states``, for this layer's MLP mix
and every later mix) and is not added to, so ``layer_mid`` is the attention's contribution alone.
The model keeps a layer's input after the layer (there, as that summary): an assignment to
``layer_input`` replaces the tensor it keeps, as an edit in place does.

``attention_norm_output`` is ``input_layernorm``'s output on the sliding-window layers (float32
where it norms a mix; the attention is called with its cast to the model's dtype); on the
full-attention layers three norms (``q_input_layernorm``, ``k_input_layernorm``,
``v_input_layernorm``) norm three different mixes, so there is no one normed stream. The output
projection gates each head's mixed values (a sigmoid of ``gate_proj`` of the attention's input)
before its linear map: ``attention_premix`` is the projection's input, before the gate. ``mlp_norm_output`` is
the norm's float32 output; ``mlp_input`` its cast to the model's dtype, what the MLP (a routed
mixture) is called with. The mixes themselves are read natively: ``layers[i].attention_input.output``
(from layer 1 on) and ``layers[i].E_mlp_input.output`` (the block's module ``mlp_input`` has a
standard value's name, so, as nnsight does for the names it serves itself, its envoy is under the
prefix ``E_``; ``layers[i].mlp_input`` is the standard value).

Inkling-2 checkpoints may carry the image-text config (``inkling2``), for which transformers has no
causal LM class: loaded by name, the causal LM built from them is the text model
(``Inkling2ForCausalLM``, whose weights transformers renames from the checkpoint's);
``Inkling2ForConditionalGeneration`` itself is not wrapped.

The model reads its last layer's output out through a mix of it and every block summary
(``model.final_input``) before the final norm, so a single stream cannot be read out the way the
model does: ``project_on_vocab`` and the logit lens refuse on this family. Its attention is eager
only, with per-token sinks and a learned relative position bias: ``attention_scores`` are the
scores with the bias and the mask added, before the sink logit joins them.
"""

import dataclasses

import transformers

from ..spec.identity import Custom
from .base import ROUTED, Block, EagerAttention, Family, Unavailable, input, output, pre_norm_block

FORMULA = "layer_output = ((layer_input.float() + attention_output.float()) + mlp_output).to(layer_input.dtype)"
RESTART = ("layer_output = (attention_output.float() + mlp_output).to(layer_input.dtype) (the first layer of a "
           "block: the stream restarts, layer_input is kept as the summary of the block it ended)")

# the masked scores: the position bias and then the mask are added (attn_weights_1, _2) before the sink joins them
ATTENTION = EagerAttention(scores="attn_weights_2", scores_side="output")
THREE_NORMS = Unavailable(
    "a full-attention layer norms three different mixes of the block states for its queries, keys and values "
    "(q_input_layernorm, k_input_layernorm, v_input_layernorm): no one normed stream feeds the attention")


def _block(config, i):
    sliding = config.layer_types[i] == "hybrid_sliding"
    restarts = i % config.n_layers_per_attn_res_block == 0  # the layer's is_block_boundary
    base = pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp="mlp", act="", down_proj="",
        # the block's input is kept by the model after the layer (a block summary, on a boundary): an assignment
        # replaces the tensor it keeps
        layer_input=input("", arg=0, shared=True),
        **({} if sliding else {"attention_norm_output": THREE_NORMS}),
        attention_output=output("post_attention_convolution"),
        # the float32 partial sum: the MLP's mix reads it and the last add adds to it
        layer_mid=input("mlp_input", arg=1, shared=True),
        mlp_output=output("post_mlp_convolution"),
        mlp_activation=ROUTED, mlp_neurons=ROUTED,
    )
    if restarts:
        return Block(values=base.values, identity=Custom(
            RESTART, lambda t, _: (t["attention_output"].float() + t["mlp_output"]).to(t["layer_input"].dtype),
            mid=lambda t, _: t["mixer_output"].float(), reads=("layer_input", "attention_output", "mlp_output")))
    return Block(values=base.values, identity=Custom(
        FORMULA, lambda t, _: ((t["layer_input"].float() + t["attention_output"].float()) + t["mlp_output"]).to(
            t["layer_input"].dtype),
        mid=lambda t, _: t["layer_input"].float() + t["mixer_output"].float(), reads=("layer_input", "attention_output", "mlp_output")))


INKLING2 = Family(
    name="Inkling-2", model_types=("inkling2_text", "inkling2"), layers="model.layers", embed_tokens="model.embed_tokens",
    ln_final="model.norm", attention="self_attn", mlp="mlp", block=_block,
    heads=lambda config, i: (config.swa_num_attention_heads if config.layer_types[i] == "hybrid_sliding"
                             else config.num_attention_heads),
    attention_internals=ATTENTION,
    readout_unavailable="the model reads its last layer's output out through a learned mix of it and every earlier "
                        "block's summary (model.final_input) before the final norm, so one stream alone has no readout "
                        "the model would give it",
    tiny_config=lambda: transformers.Inkling2TextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16, sliding_window_size=4, d_rel=4,
        rel_extent=16, layer_types=["hybrid_sliding", "hybrid", "hybrid", "hybrid_sliding"],
        n_layers_per_attn_res_block=2, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        vocab_size=128, unpadded_vocab_size=120, max_position_embeddings=64, eos_token_id=2),
)


MESSAGE_NORMS = Unavailable(
    "a loop layer's passes after the first norm the message-gated mixes of its queries, keys and values separately "
    "(three calls of input_layernorm): no one normed stream feeds the attention")


def _loop_block(config, i):
    block = _block(config, i)
    if not config.loop_layer_index_start <= i < config.loop_layer_index_end or isinstance(
            block.values["attention_norm_output"], Unavailable):
        return block
    return dataclasses.replace(block, values={**block.values, "attention_norm_output": MESSAGE_NORMS})


def _loop_schedule(config):
    start, end = config.loop_layer_index_start, config.loop_layer_index_end
    return (*range(start), *(list(range(start, end)) * config.loop_num_passes), *range(end, config.num_hidden_layers))


INKLING2_LOOP = dataclasses.replace(
    INKLING2, name="Inkling-2-Loop", model_types=("inkling2_loop_text",), block=_loop_block, schedule=_loop_schedule,
    tiny_config=lambda: transformers.Inkling2LoopTextConfig(
        hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16, sliding_window_size=4, d_rel=4,
        rel_extent=16, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        n_layers_per_attn_res_block=2, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=3, loop_gate_rank=8,
        vocab_size=128, unpadded_vocab_size=120, max_position_embeddings=64, eos_token_id=2),
)
