"""LongCat-Flash: each block runs two attention-MLP pairs in sequence, plus a routed shortcut.

``layers[i]`` holds ``self_attn[0]``, ``mlps[0]``, ``self_attn[1]``, ``mlps[1]`` (each after its own norm,
``input_layernorm[k]`` / ``post_attention_layernorm[k]``, four adds to the stream) and a routed mixture of experts
``mlp`` (the shortcut) that reads the first pair's normed stream before ``mlps[0]`` and is added last:

    layer_output = ((((layer_input + attn0) + mlp0) + attn1) + mlp1) + shortcut

One attention_output and one mlp_output per block cannot name two pairs and a shortcut, so every value between
``layer_input`` and ``layer_output`` is unavailable, with where it lives natively. That includes
``attention_norm_output``: two norms feed an attention (``input_layernorm[0]`` and ``[1]``), and naming the first
would make it the first pair's value while the other values of that pair are unavailable. The identity is checked on
the five contributions, read at their modules (``extra``). The standard ``self_attn`` is the native list of both
attentions (its values say why they are unavailable) and ``mlp`` the native shortcut MoE, whose standard values say
why they are unavailable too: neither stands for one of the pairs.
"""

import transformers

from ..spec.identity import Name, Sum, X
from .base import Block, Family, Unavailable, input, output

IDENTITY = Sum(((((X + Name("attn0")) + Name("mlp0")) + Name("attn1")) + Name("mlp1")) + Name("shortcut"),
               note="(attnk = self_attn[k].output[0], mlpk = mlps[k].output, shortcut = mlp.output: the routed MoE "
                    "of post_attention_layernorm[0]'s output)")


def _two_pairs(what: str) -> Unavailable:
    return Unavailable(
        f"each block holds two attention-MLP pairs and a routed shortcut MoE, so {what}: read "
        "model.layers[i].self_attn[0] / [1], mlps[0] / [1], their norms input_layernorm[0] / [1] and "
        "post_attention_layernorm[0] / [1], and the shortcut mlp natively")


# two norms before an attention (input_layernorm[0] and [1]), two before an MLP, two streams after an attention
PAIRED = _two_pairs("the block has two of this value (one per pair)")
ADDED_MLPS = _two_pairs("three MLPs add to the stream (mlps[0], mlps[1] and the shortcut mlp)")


def _block(config, i):
    values = {
        "layer_input": input("", arg=0),
        **dict.fromkeys(("attention_norm_output", "attention_premix", "attention_output", "mixer_output", "layer_mid",
                         "mlp_norm_output", "mlp_input", "mlp_activation", "mlp_neurons"), PAIRED),
        "mlp_output": ADDED_MLPS,
        "layer_output": output("", index=0),
    }
    return Block(
        values=values,
        identity=IDENTITY,
        extra={"attn0": output("self_attn.0", index=0), "mlp0": output("mlps.0"), "shortcut": output("mlp"),
               "attn1": output("self_attn.1", index=0), "mlp1": output("mlps.1")},
    )


LONGCAT_FLASH = Family(
    name="LongCat-Flash",
    model_types=("longcat_flash",),
    layers="model.layers", embed_tokens="model.embed_tokens", ln_final="model.norm",
    attention="self_attn",  # the list of both attentions: its standard values say why they are unavailable
    mlp="mlp",  # the shortcut MoE, natively: its standard values say why there is no one MLP
    block=_block,
    attention_internals=Unavailable("each block holds two attentions (self_attn[0] and [1]), so the values inside "
                                    "'the' attention of a block have no single place"),
    tiny_config=lambda: transformers.LongcatFlashConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=64,
        ffn_hidden_size=96, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8,
        v_head_dim=16, moe_topk=2, n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32,
        routed_scaling_factor=2.5),
)
