"""ModernBERT-decoder: Llama's sequential pre-norm block under other names, and a head of two modules.

``attn_norm`` / ``attn`` / ``mlp_norm`` / ``mlp``; the MLP is gated, ``Wo(act(x₁) * x₂)`` with both halves
from one ``Wi`` (``mlp_activation`` is ``act``'s output, ``mlp_neurons`` ``Wo``'s input). Block 0 has
no norm before its attention (``attn_norm`` is an ``Identity``), so there ``attention_norm_output``
is unavailable: the attention reads ``layer_input``. The model reads the final norm's output through
its head ``lm_head`` (dense, activation, norm: its output is hidden-sized) and then ``decoder``, the
projection on the vocabulary; ``project_on_vocab`` runs both.
"""

import transformers

from .base import Family, Unavailable, pre_norm_block

_NO_NORM = Unavailable("block 0 has no norm before its attention (its attn_norm is an Identity): the attention "
                       "reads layer_input")


def _block(config, i):
    return pre_norm_block(
        input_norm="attn_norm", attention="attn", o_proj="attn.Wo", post_norm="mlp_norm", mlp="mlp", act="mlp.act",
        down_proj="mlp.Wo", **({"attention_norm_output": _NO_NORM} if i == 0 else {}))


MODERNBERT_DECODER = Family(
    name="ModernBERT-decoder", model_types=("modernbert-decoder",), layers="model.layers",
    embed_tokens="model.embeddings.tok_embeddings", ln_final="model.final_norm", attention="attn", mlp="mlp",
    vocab_projection="decoder", block=_block,
    tiny_config=lambda: transformers.ModernBertDecoderConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=128,
        max_position_embeddings=64, sliding_window=4, local_attention=8, pad_token_id=0, eos_token_id=2,
        bos_token_id=1, cls_token_id=1, sep_token_id=2,
        layer_types=["full_attention", "sliding_attention", "full_attention"]),
)
