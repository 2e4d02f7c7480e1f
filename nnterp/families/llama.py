"""Llama and the families that share its block: Mistral, Qwen2, Qwen3, SmolLM3, OLMo, Gemma.

Gemma scales the embedding by sqrt(hidden) inside ``embed_tokens``, so ``layer_input`` of block 0
is that module's output; OLMo's norms have no parameters.

Sequential pre-norm with a gated MLP: ``mlp_activation`` is ``act_fn(gate_proj(x))`` and
``mlp_neurons`` is ``act_fn(gate_proj(x)) * up_proj(x)``, what ``down_proj`` sums.
"""

import transformers

from .base import Family, pre_norm_block, qk_norms

# the types filed here whose up projection is not placed: not gated (Arcee, Jais-2, Nemotron: act(up_proj(x)), then
# down_proj), or with a norm between the product and the down projection (BitNet), which the proof's check of it does
# not cover
NOT_GATED = ("arcee", "jais2", "nemotron", "bitnet")

_SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
)


def _llama_like(name, model_types, tiny_config, qk_norm=False):
    """``qk_norm``: the attention norms each head's queries and keys (``q_norm``, ``k_norm``) before the rotary
    embedding (Qwen3)."""
    return Family(
        name=name,
        model_types=model_types,
        block=lambda config, i: pre_norm_block(
            input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
            post_norm="post_attention_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj",
            up=None if config.model_type in NOT_GATED else "mlp.up_proj", **(qk_norms() if qk_norm else {}),
        ),
        tiny_config=tiny_config,
    )


LLAMA = _llama_like("Llama", ("llama",), lambda: transformers.LlamaConfig(**_SMALL))
MISTRAL = _llama_like("Mistral", ("mistral",), lambda: transformers.MistralConfig(**_SMALL, sliding_window=4))
QWEN2 = _llama_like("Qwen2", ("qwen2",), lambda: transformers.Qwen2Config(**_SMALL))
QWEN3 = _llama_like("Qwen3", ("qwen3",), lambda: transformers.Qwen3Config(**_SMALL, head_dim=32), qk_norm=True)

SMOLLM3 = _llama_like("SmolLM3", ("smollm3",), lambda: transformers.SmolLM3Config(**_SMALL, pad_token_id=0))
OLMO = _llama_like("OLMo", ("olmo",), lambda: transformers.OlmoConfig(**_SMALL))
GEMMA = _llama_like("Gemma", ("gemma",), lambda: transformers.GemmaConfig(**_SMALL, head_dim=16))
