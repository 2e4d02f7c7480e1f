"""Blocks of another topology than one attention and one MLP sublayer, placed with the existing values.

- RecurrentGemma (Griffin): ``temporal_pre_norm`` → ``temporal_block`` → add, ``channel_pre_norm`` →
  ``mlp_block`` → add. The temporal block is an RG-LRU recurrent block or local attention, at the same
  path, by the config's ``block_types``: on the recurrent blocks ``mixer_output`` is the temporal block's
  output and the attention's values are unavailable (the hybrids' shape). The code adds the mixer's
  output to the stream first, ``mixer + x``, then the MLP's output to that, ``m + mid``: the same bits as
  ``(mixer_output + layer_input) + mlp_output`` (a floating-point add commutes). The embedding is
  multiplied by ``sqrt(hidden_size)`` (rounded to bfloat16) before block 0, and the logits are softcapped,
  ``tanh(logits / logits_soft_cap) * logits_soft_cap``.
- Falcon-H1: a Mamba-2 mixer and attention side by side on the same normed stream, each output scaled
  (``ssm_out_multiplier``, ``attention_out_multiplier``) and the two summed before the residual add; then
  the MLP, whose output carries its own ``down_multiplier``. ``mixer_output`` is that sum and
  ``attention_output`` the attention's scaled output, both read at the block's own operations (nnsight's
  ``.source`` names them); the Mamba half is the module ``layers[i].mamba`` times ``ssm_out_multiplier``.
  The attention is called with ``attention_norm_output * attention_in_multiplier``, and
  ``head_outputs`` sum to its output projection's output, before ``attention_out_multiplier``. The
  embedding is multiplied by ``embedding_multiplier`` before block 0, and the logits by
  ``lm_head_multiplier``.
- GPT-NeoX-Japanese: GPT-NeoX's sequential block, whose last block's attention returns its output
  projection's bias apart (``dense_bias``), added to the projection's output inside the residual add's
  helper function: there ``attention_output`` is that sum, read at the operation inside the helper
  (``bias_dropout_add_0.x_0``); ``head_outputs`` sum to the projection's output, without the bias. The
  attention computes its scores in its own code, so the values inside it are unavailable.
"""

from dataclasses import replace

import torch
import transformers

from ..spec.identity import A, M, Name, Sum, X
from .base import OWN_ATTENTION, Family, output, pre_norm_block, stream_and_none
from .hybrid import is_attention, mixer_block


def _griffin_block(config, i):
    block = pre_norm_block(
        input_norm="temporal_pre_norm", attention="temporal_block", o_proj="temporal_block.o_proj",
        post_norm="channel_pre_norm", mlp="mlp_block", act="mlp_block.act_fn", down_proj="mlp_block.down_proj",
        identity=Sum(M + (A + X)),
    )
    return block if is_attention(config, i) else mixer_block(block, i, "temporal_block", "an RG-LRU recurrent block")


def _softcap(logits, config):
    cap = config.logits_soft_cap
    return torch.tanh(logits / cap) * cap


class _TemporalBlocks(Family):
    """RecurrentGemma's blocks hold attention or a recurrent block under one native name: ``self_attn`` names it on
    the attention blocks alone (an alias keyed by the attention's class), so on the others it says why it is
    unavailable."""

    def rename(self):
        from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaAttention

        names = {native: alias for native, alias in Family.rename(self).items() if native != self.attention}
        return {**names, RecurrentGemmaAttention: "self_attn"}


RECURRENT_GEMMA = _TemporalBlocks(
    name="RecurrentGemma", model_types=("recurrent_gemma",), layers="model.layers", embed_tokens="model.embed_tokens",
    ln_final="model.final_norm", attention="temporal_block", mlp="mlp_block", block=_griffin_block,
    logits_transform=_softcap,
    # blocks 0 and 1 recurrent, 2 local attention (a window of 3 tokens), 3 recurrent
    tiny_config=lambda: transformers.RecurrentGemmaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, lru_width=64, attention_window_size=3, block_types=["recurrent", "recurrent", "attention"],
        logits_soft_cap=3.0),
)


# the sum in the inner parentheses is mixer_output, the mixers' outputs the model adds before the residual add
_FALCON_H1 = Sum((X + (Name("mamba") * "ssm_out_multiplier" + A)) + M, note="(the inner sum: mixer_output)")


def _falcon_h1_block(config, i):
    block = pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj", post_norm="pre_ff_layernorm",
        mlp="feed_forward", act="feed_forward.act_fn", down_proj="feed_forward.down_proj", identity=_FALCON_H1,
        attention_output=output("", op="attention_hidden_states_0"),  # self_attn(...)[0] * attn_out_multiplier
        mixer_output=output("", op="hidden_states_1"),  # mamba_hidden_states + attention_hidden_states
    )
    return replace(block, extra={"mamba": output("mamba")})


FALCON_H1 = Family(
    name="Falcon-H1", model_types=("falcon_h1",), layers="model.layers", embed_tokens="model.embed_tokens",
    ln_final="model.final_layernorm", attention="self_attn", mlp="feed_forward", block=_falcon_h1_block,
    skip_output=lambda stream, block: (stream,),  # its blocks return (hidden,) and the model reads [0]
    logits_transform=lambda logits, config: logits * config.lm_head_multiplier,
    # every multiplier off 1, so a missing factor shows
    tiny_config=lambda: transformers.FalconH1Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=8, mamba_chunk_size=16, embedding_multiplier=3.0, lm_head_multiplier=0.375,
        attention_in_multiplier=0.7, attention_out_multiplier=0.3, ssm_in_multiplier=1.3, ssm_out_multiplier=0.6,
        key_multiplier=0.9, mlp_multipliers=[1.25, 0.55], ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.95]),
)


def _neox_japanese_block(config, i):
    # only the last block's attention has a bias, returned apart and added in the block's helper: x = x + bias
    bias = {"attention_output": output("", op="bias_dropout_add_0.x_0")} if i == config.num_hidden_layers - 1 else {}
    return pre_norm_block(
        input_norm="input_layernorm", attention="attention", o_proj="attention.dense", post_norm="post_attention_layernorm",
        mlp="mlp", act="mlp.act", down_proj="mlp.dense_4h_to_h", **bias)


GPT_NEOX_JAPANESE = Family(
    name="GPT-NeoX-Japanese", model_types=("gpt_neox_japanese",), layers="gpt_neox_japanese.layers",
    embed_tokens="gpt_neox_japanese.embed_in", ln_final="gpt_neox_japanese.final_layer_norm", attention="attention",
    mlp="mlp", lm_head="embed_out", block=_neox_japanese_block, attention_internals=OWN_ATTENTION,
    skip_output=stream_and_none,  # its blocks return (hidden, attention weights) and the model reads [0]
    tiny_config=lambda: transformers.GPTNeoXJapaneseConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_multiple_size=2, vocab_size=128,
        max_position_embeddings=64),
)
