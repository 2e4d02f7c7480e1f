"""RecurrentGemma (Griffin): an RG-LRU recurrent block or local attention at one path, then an MLP.

``temporal_pre_norm`` → ``temporal_block`` → add, ``channel_pre_norm`` → ``mlp_block`` → add. The temporal block
is an RG-LRU recurrent block or local attention, at the same path, by the config's ``block_types``: on the
recurrent blocks ``mixer_output`` is the temporal block's output and the attention's values are unavailable (the
hybrids' shape). The code adds the mixer's output to the stream first, ``mixer + x``, then the MLP's output to
that, ``m + mid``: the same bits as ``(mixer_output + layer_input) + mlp_output`` (a floating-point add commutes).
The embedding is multiplied by ``sqrt(hidden_size)`` (rounded to bfloat16) before block 0, and the logits are
softcapped, ``tanh(logits / logits_soft_cap) * logits_soft_cap``.
"""

import torch
import transformers

from ..spec.identity import A, M, Sum, X
from .base import Family, pre_norm_block
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
