"""Qwen4-Exp: a widened stream of ``hc_count`` copies, gated hyper-connections, and per-layer token mixers.

The stream entering and leaving a block is ``[batch, seq, hc_count * hidden]``. Each sublayer
reads a gated mix of the normed copies (``attn_hyper_connection`` / ``mlp_hyper_connection``,
whose outputs are the mix, the stream itself and per-copy injection weights ``w``), and its
``[batch, seq, hidden]`` output is injected into every copy with its weight:

    layer_mid    = stream + (mixer_output[..., None, :] * attn_w[..., None]).flatten(-2)
    layer_output = layer_mid + (mlp_output[..., None, :] * mlp_w[..., None]).flatten(-2)

where ``stream`` is ``layer_input``, plus the per-layer n-gram embedding branch ``P`` (``ple``) on the
layers ``ple_layer_ids`` names. The token mixer is Gated DeltaNet linear attention (``linear_attn``) or
gated attention with a learned token selection (``self_attn``, ``config.layer_types``); the MLP is a
routed mixture with a gated shared expert. There is no final norm: ``model.hyper_connection_mixer``
(normed, gated mix of the copies) reads the last block's output for the head, so it is ``ln_final``.
Qwen4-Exp checkpoints carry an image-text config; the causal LM built from it is the text model.
"""

import transformers

from ..spec.identity import Custom
from .base import ROUTED, Block, Family, input, output, pre_norm_block, qk_norms, router
from .hybrid import mixer_block

_INJECTIONS = ("(attention_output[..., None, :] * attn_w[..., None]).flatten(-2); "
               "layer_output = layer_mid + (mlp_output[..., None, :] * mlp_w[..., None]).flatten(-2) "
               "(attn_w, mlp_w: element 2 of the hyper-connections' outputs")
FORMULA = f"layer_mid = (layer_input + P) + {_INJECTIONS}; P: the ple branch, on its layers)"
NO_PLE = f"layer_mid = layer_input + {_INJECTIONS})"  # the layers without the ple branch


def _inject(stream, branch, weights):
    return stream + (branch.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


def _block(config, i):
    has_ple = i + 1 in config.ple_layer_ids
    attention = config.layer_types[i] != "linear_attention"
    base = pre_norm_block(
        input_norm="", attention="self_attn" if attention else "linear_attn", o_proj="self_attn.o_proj",
        post_norm="", mlp="mlp", act="", down_proj="", mlp_activation=ROUTED, mlp_neurons=ROUTED, **router("mlp.gate"),
        attention_norm_output=output("attn_hyper_connection", index=0),
        layer_mid=input("mlp_hyper_connection", shared=True),  # the gated residual keeps it as the stream
        mlp_norm_output=output("mlp_hyper_connection", index=0),
        # each head's queries and keys normed, [batch, seq, heads, head_dim] (not the indexer's own norms)
        **(qk_norms() if attention else {}),
        identity=Custom(
            FORMULA if has_ple else NO_PLE,
            lambda t, _: _inject(_inject(t["layer_input"] + t["P"] if has_ple else t["layer_input"],
                                         t["attention_output"], t["attn_w"]), t["mlp_output"], t["mlp_w"]),
            reads=("layer_input", "attention_output", "mlp_output", "attn_w", "mlp_w") + (("P",) if has_ple else ())),
    )
    block = Block(values=base.values, identity=base.identity,
                  extra={"attn_w": output("attn_hyper_connection", index=2),
                         "mlp_w": output("mlp_hyper_connection", index=2),
                         **({"P": output("ple")} if has_ple else {})})
    return block if attention else mixer_block(block, i, "linear_attn", "a Gated DeltaNet linear attention")


QWEN4_EXP = Family(
    name="Qwen4-Exp", model_types=("qwen4_exp_text", "qwen4_exp"),
    layers="model.layers", embed_tokens="model.embed_tokens", ln_final="model.hyper_connection_mixer",
    attention="self_attn", mlp="mlp", block=_block,
    premix_is_not_mixed_values="each head's output is multiplied by a sigmoid gate (from q_proj) before o_proj",
    tiny_config=lambda: transformers.Qwen4ExpTextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        hc_count=2, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=16, ngram_size=2, heads_per_ngram=2,
        ngram_vocab_size_base=1000, split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
        indexer_budget=4, indexer_compress_ratio=2, full_attention_interval=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2),
)
