"""Hybrids: blocks that mix tokens with attention on some layers and with another mixer on the others.

Every block is a sequential pre-norm block; only its token mixer changes with the layer
(``config.layer_types``). ``mixer_output`` is what the block's token mixer adds to the stream:
on an attention block it is ``self_attn.attention_output``, on the others the mixer module's
output, where the attention's values (and ``layers[i].self_attn`` itself) are unavailable with
the reason. The identity of those blocks is written with ``mixer_output``.
``attention_norm_output`` and ``layer_mid`` are the normed stream the mixer reads and the
stream after its add, on every block.

- Jamba: Mamba (``mamba``) or attention; ``feed_forward`` after ``pre_ff_layernorm``, a routed
  mixture on the layers the config gives experts. Its Mamba runs a pure-PyTorch scan where the
  ``mamba_ssm`` kernels are not installed (CPU).
- Bamba: Mamba-2 (``mamba``) or attention, the same block as Jamba's with a dense MLP.
- Granite-4.0-H (``granitemoehybrid``): Mamba-2 or attention on Granite's block, which adds both sublayers'
  outputs times ``residual_multiplier``: the contributions are those products (as on Granite). The MLP contribution is the experts' output plus the shared MLP's,
  summed in the block's own code: ``mlp_output`` is read there, at the operation nnsight's
  ``.source`` names; ``mlp_input`` is the norm's output, which both are called with, and
  ``layers[i].mlp`` is the shared MLP. The logits are the head's divided by ``logits_scaling``.
- Qwen3-Next, Qwen3.5 (dense), Qwen3.5-MoE, Lara-Mini: Gated DeltaNet linear attention
  (``linear_attn``) or attention on the Llama / Qwen-MoE block. Qwen's attention is gated (each
  head's output is multiplied by a sigmoid gate before ``o_proj``). Qwen3.5 checkpoints carry an
  image-text config; the causal LM built from it is the text model.
- OLMo-Hybrid: Gated DeltaNet blocks are pre-norm; its attention blocks are OLMo-2's (no norm before
  the sublayers; the contributions are the outputs of the norms after them).
- LFM2, LFM2-MoE: a short convolution (``conv``) or attention after ``operator_norm``, the MLP
  ``w2(silu(w1(x)) * w3(x))`` (or a mixture, after ``num_dense_layers``) after ``ffn_norm``; the
  mixer's output is added to the stream first, ``(a + x) + m``. The final norm is
  ``model.embedding_norm``.
- LFM3: LFM2's block with norms after the sublayers (``post_operator_norm``, ``post_ffn_norm``,
  whose outputs are the contributions) and a gated attention.
"""

import transformers

from ..spec.catalog import ATTENTION_VALUES
from ..spec.identity import A, M, Sum, X
from .base import (
    ROUTED,
    Block,
    Family,
    SameAs,
    Unavailable,
    added_times,
    output,
    pre_norm_block,
    qk_norms,
    router,
    stream_and_none,
)
from .moe import routed_layer

ATTENTION_LAYERS = ("full_attention", "sliding_attention")


def is_attention(config, i) -> bool:
    """Whether block ``i`` mixes tokens with attention, by the config's own list of layer types."""
    return config.layer_types[i] in ATTENTION_LAYERS


def mixer_block(base: Block, layer: int, mixer: str, kind: str) -> Block:
    """``base`` (built with the mixer module where an attention block has its attention) on a block that mixes
    tokens with ``kind``: the mixer's output is ``mixer_output``, the attention's values are unavailable."""
    reason = Unavailable(f"block {layer} mixes tokens with {kind}, not attention: its contribution "
                         "is mixer_output")
    return Block(
        values={**base.values, "mixer_output": base.values["attention_output"], **dict.fromkeys(ATTENTION_VALUES, reason)},
        identity=base.identity.renamed({"attention_output": "mixer_output"}),
        extra=base.extra,
        ulps=base.ulps,
    )


def _hybrid(*, mixer: str, kind: str, is_routed=lambda config, i: False, o_proj="self_attn.o_proj",
            attention_block=None, attention_values=None, router_path=None, **modules):
    """A block function: ``pre_norm_block(**modules)`` around attention (or ``attention_block``) or around
    ``mixer``, layer by layer. ``attention_values``: values placed on the attention blocks alone (their q/k
    norms). ``router_path``: the router of a routed block, whose first output is its logits."""
    def block(config, i):
        routed = {"mlp_activation": ROUTED, "mlp_neurons": ROUTED, **(router(router_path) if router_path else {})}
        values = {**modules, **(routed if is_routed(config, i) else {})}
        if is_attention(config, i):
            if attention_block:
                return attention_block(config, i)
            return pre_norm_block(attention="self_attn", o_proj=o_proj, **values, **(attention_values or {}))
        return mixer_block(pre_norm_block(attention=mixer, o_proj="", **values), i, mixer, kind)
    return block


def _never(config, i):
    return False


def _always(config, i):
    return True


_JAMBA_MODULES = dict(input_norm="input_layernorm", post_norm="pre_ff_layernorm", mlp="feed_forward",
                      act="feed_forward.act_fn", down_proj="feed_forward.down_proj")
_FEED_FORWARD = dict(layers="model.layers", embed_tokens="model.embed_tokens", ln_final="model.final_layernorm",
                     attention="self_attn", mlp="feed_forward")
_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)

JAMBA = Family(
    name="Jamba", model_types=("jamba",), **_FEED_FORWARD,
    block=_hybrid(mixer="mamba", kind="a Mamba layer", is_routed=lambda config, i: config.layers_num_experts[i] > 1,
                  router_path="feed_forward.router", **_JAMBA_MODULES),
    # blocks 0 and 2 Mamba with experts, 1 attention, 3 Mamba
    tiny_config=lambda: transformers.JambaConfig(
        **_SMALL, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=8),
)
BAMBA = Family(
    name="Bamba", model_types=("bamba",), **_FEED_FORWARD,
    block=_hybrid(mixer="mamba", kind="a Mamba-2 layer", **_JAMBA_MODULES),
    skip_output=stream_and_none,  # its blocks return (hidden, attention weights)
    tiny_config=lambda: transformers.BambaConfig(**_SMALL, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8,
                                                 mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16),
)


# Granite-4.0-H: Granite's residual multiplier r on both contributions; the MLP contribution is the mixture of
# experts and the shared MLP summed in the block's code (read there, at the name nnsight's .source gives the sum).
_GRANITE = Sum((X + A * "residual_multiplier") + M * "residual_multiplier")


def _granite_block(config, i):
    experts = config.num_local_experts > 0
    return added_times(_hybrid(
        mixer="mamba", kind="a Mamba-2 layer", is_routed=lambda config, i: experts, input_norm="input_layernorm",
        router_path="block_sparse_moe.router",
        post_norm="post_attention_layernorm", mlp="shared_mlp", act="shared_mlp.activation",
        down_proj="shared_mlp.output_linear", identity=_GRANITE,
        mlp_input=SameAs("mlp_norm_output"),  # both the experts and the shared MLP are called with it
        **({"mlp_output": output("", op="hidden_states_4")} if experts else {}),
    )(config, i), "residual_multiplier")


GRANITE_MOE_HYBRID = Family(
    name="Granite-MoE-Hybrid", model_types=("granitemoehybrid",), mlp="shared_mlp",
    block=_granite_block, logits_transform=lambda logits, config: logits / config.logits_scaling,
    tiny_config=lambda: transformers.GraniteMoeHybridConfig(
        **_SMALL, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], shared_intermediate_size=128,
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16, num_local_experts=4,
        num_experts_per_tok=2, residual_multiplier=0.22, embedding_multiplier=12.0, logits_scaling=8.0,
        attention_multiplier=0.0625),
)


_GATED = "each head's output is multiplied by a sigmoid gate (from q_proj) before o_proj"
_DELTANET = dict(
    **_SMALL, num_hidden_layers=4, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
_EXPERTS = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def _deltanet(name, model_types, is_routed, tiny_config, gated=_GATED):
    """Gated DeltaNet linear attention or attention on the Llama / Qwen-MoE block."""
    return Family(
        name=name, model_types=model_types,
        block=_hybrid(mixer="linear_attn", kind="a Gated DeltaNet linear attention", is_routed=is_routed,
                      router_path="mlp.gate", input_norm="input_layernorm", post_norm="post_attention_layernorm", mlp="mlp",
                      act="mlp.act_fn", down_proj="mlp.down_proj",
                      # each head's queries (the q_proj half that is not the gate) and keys, [batch, seq, heads,
                      # head_dim], before the rotary embedding
                      attention_values=qk_norms()),
        premix_is_not_mixed_values=gated, tiny_config=tiny_config,
    )


QWEN3_NEXT = _deltanet("Qwen3-Next", ("qwen3_next",), routed_layer, lambda: transformers.Qwen3NextConfig(
    **_DELTANET, **_EXPERTS, decoder_sparse_step=1, mlp_only_layers=[2]))
QWEN3_5 = _deltanet("Qwen3.5", ("qwen3_5_text", "qwen3_5"), _never, lambda: transformers.Qwen3_5TextConfig(**_DELTANET))
QWEN3_5_MOE = _deltanet("Qwen3.5-MoE", ("qwen3_5_moe_text", "qwen3_5_moe"), _always,
                        lambda: transformers.Qwen3_5MoeTextConfig(**_DELTANET, **_EXPERTS))
LARA_MINI = _deltanet("Lara-Mini", ("lara_mini",), _always, lambda: transformers.LaraMiniConfig(
    **{**_DELTANET, "layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
    **_EXPERTS, sliding_window=2), gated=None)


def _olmo_hybrid_attention(config, i):
    from .sandwich import _olmo2_block

    return _olmo2_block(config, i)


OLMO_HYBRID = Family(
    name="OLMo-Hybrid", model_types=("olmo_hybrid",),
    block=_hybrid(mixer="linear_attn", kind="a Gated DeltaNet linear attention", attention_block=_olmo_hybrid_attention,
                  input_norm="input_layernorm", post_norm="post_attention_layernorm", mlp="mlp", act="mlp.act_fn",
                  down_proj="mlp.down_proj"),
    tiny_config=lambda: transformers.OlmoHybridConfig(**_DELTANET, pad_token_id=0),
)


_LFM2 = Sum((A + X) + M)


def _lfm(name, model_type, tiny_config, is_routed=_never, o_proj="self_attn.out_proj", gated=None, qk=("q_layernorm", "k_layernorm"),
         **overrides):
    """LFM2 and its kin: a short convolution or attention after operator_norm, feed_forward after ffn_norm."""
    return Family(
        name=name, model_types=(model_type,), layers="model.layers", embed_tokens="model.embed_tokens",
        ln_final="model.embedding_norm", attention="self_attn", mlp="feed_forward",
        block=_hybrid(mixer="conv", kind="a short convolution", is_routed=is_routed, o_proj=o_proj,
                      router_path="feed_forward.gate",
                      input_norm="operator_norm", post_norm="ffn_norm", mlp="feed_forward", act="",
                      down_proj="feed_forward.w2", mlp_activation=output("feed_forward", op="F_silu_0"),
                      # each head's queries and keys normed, [batch, seq, heads, head_dim], before the rotary embedding
                      attention_values=qk_norms(q=qk[0], k=qk[1]), **overrides),
        tiny_config=tiny_config, premix_is_not_mixed_values=gated,
    )


_CONV = dict(**_SMALL, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])
LFM2 = _lfm("LFM2", "lfm2", lambda: transformers.Lfm2Config(**_CONV),
            identity=_LFM2)
LFM2_MOE = _lfm("LFM2-MoE", "lfm2_moe", lambda: transformers.Lfm2MoeConfig(
    **_CONV, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_dense_layers=1),
    is_routed=lambda config, i: i >= config.num_dense_layers,
    identity=_LFM2)
LFM3 = _lfm("LFM3", "lfm3", lambda: transformers.Lfm3Config(
    **{**_CONV, "layer_types": ["conv", "sliding_attention", "full_attention"]}, sliding_window=2, use_sandwich_norm=True,
    pad_token_id=0),
    o_proj="self_attn.o_proj", qk=("q_norm", "k_norm"), gated="with use_attention_gate (the default) each head's output is multiplied by a sigmoid gate (g_proj) "
    "before o_proj", attention_output=output("post_operator_norm"), mlp_output=output("post_ffn_norm"))
