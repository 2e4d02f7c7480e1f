"""Recurrent and state-space models, whose blocks mix tokens with something else than attention, and blocks
of one sublayer.

On a block without attention ``mixer_output`` is what the block's token mixer adds to the stream,
``attention_norm_output`` the normed stream it reads, and the attention's values (and
``layers[i].self_attn``) are unavailable with the reason; on a block without an MLP so are the MLP's
values (and ``layers[i].mlp``).

- Mamba, Mamba-2, Falcon-Mamba: ``backbone.layers[i]`` is ``x + mixer(norm(x))``, one token mixer and
  its residual add, no MLP (the MLP's values and ``layers[i].mlp`` are unavailable); ``layer_mid``, the
  stream after the mixer's add, is ``layer_output``. With ``residual_in_fp32`` (the default) the block
  adds the mixer's output to the stream cast to float32, so in a bfloat16 model the stream is float32
  after the first block; the final norm reads it as it is and the head reads the norm's output cast
  to the head's dtype; the logits are float32. The mixers run a pure-PyTorch scan where the
  ``mamba_ssm`` kernels are not installed (CPU).
- RWKV: ``rwkv.blocks[i]`` is ``h = x + attention(ln1(x)); y = h + feed_forward(ln2(h))``. ``attention`` is
  the time mixing, a linear recurrence over the tokens (``mixer_output``, not attention); ``feed_forward``
  the channel mixing, the MLP: ``value(relu(key(x'))²)`` times ``sigmoid(receptance(x''))``, where ``x'`` and
  ``x''`` mix each normed token with the one before, so ``mlp_activation`` is the squared ReLU, which is
  what ``value`` sums (``mlp_neurons``). Block 0 norms the embeddings with ``pre_ln`` before its adds:
  its ``layer_input`` is ``pre_ln``'s output, the stream the residual adds start from (which exists only
  while block 0 runs: skipping block 0 takes the stream to hand on, ``skip_layers(model, 0, stream=...)``).
  In eval mode the model halves the stream after every ``rescale_every``-th block (its weights scaled to
  match, once, on the first forward): there ``layers[i + 1].layer_input`` is ``layers[i].layer_output / 2``,
  and a stream read out after the last block is halved first where the model does so. The model ignores
  the attention mask: in a padded batch the pad tokens enter the recurrence.
- xLSTM: ``backbone.blocks[i]`` is ``h = x + mlstm_layer(norm_mlstm(x)); y = h + ffn(norm_ffn(h))``: the
  mLSTM layer (a matrix-memory recurrence) is the token mixer, ``ffn`` the gated MLP
  ``proj_down(silu(proj_up_gate(x)) * proj_up(x))``. The final norm is ``backbone.out_norm``; the
  logits are the head's in float32, soft-capped: ``cap * tanh(logits / cap)``, ``cap =
  output_logit_soft_cap``. Its mLSTM runs the pure-PyTorch kernels where the ``xlstm`` package is not
  installed; the recurrent state's cache is sized from ``hidden_size * qk_dim_factor`` (and
  ``v_dim_factor``) rounded up to a multiple of 64, so the model runs where those products are
  multiples of 64 (the default config, and its miniature).
- Nemotron-H: each block of ``model.layers`` is one sublayer, ``x + mixer(norm(x))``, whose ``mixer`` is,
  by ``layers_block_type``, a Mamba-2 mixer (``linear_attention``: ``mixer_output``), an attention
  (``full_attention``: the attention's values), an MLP (``mlp``: ``up_proj``, squared ReLU, ``down_proj``)
  or a routed mixture of experts with shared experts (``moe``). A block has the values of its sublayer
  alone: on a token-mixing block ``layer_mid`` is ``layer_output`` and the MLP's values are unavailable;
  on an MLP block ``mlp_norm_output`` is the norm's output, ``layer_mid`` (the stream before the MLP's add)
  is ``layer_input``, and the token mixer's values are unavailable. ``layers[i].self_attn`` is the mixer
  of an attention block, ``layers[i].mlp`` that of an MLP block. The logits are the head's in float32.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers

from ..spec.catalog import ATTENTION_VALUES
from ..spec.errors import UnsupportedConfig
from ..spec.identity import MIXER, A, Custom, M, Sum, X
from .base import ROUTED, Block, Family, SameAs, Unavailable, input, output, pre_norm_block, router
from .hybrid import mixer_block

NO_ATTENTION = Unavailable("no block of this model has attention: each mixes tokens with a recurrent mixer, whose "
                           "contribution is mixer_output")
MLP_VALUES = ("mlp_norm_output", "mlp_input", "mlp_activation", "mlp_neurons", "mlp_output")


def not_attention(layer: int, kind: str) -> dict[str, Unavailable]:
    """The attention's values of block ``layer``, which mixes tokens with ``kind``: unavailable, with the reason."""
    return dict.fromkeys(ATTENTION_VALUES, Unavailable(
        f"block {layer} mixes tokens with {kind}, not attention: its contribution is mixer_output"))


def _float32_residual(t, block):
    return t["layer_input"].to(torch.float32) + t["mixer_output"]


def _mamba_block(name: str):
    def block(config, i):
        no_mlp = Unavailable(f"block {i} has no MLP: a {name} block is one token mixer and its residual add")
        return Block(
            values={
                "layer_input": input("", arg=0),
                "attention_norm_output": output("norm"),
                "mixer_output": output("mixer"),
                "layer_mid": SameAs("layer_output"),  # the stream after the mixer's add is the block's output
                **dict.fromkeys(MLP_VALUES, no_mlp),
                "layer_output": output(""),
                **not_attention(i, f"a {name} mixer"),
            },
            identity=(Custom("layer_output = float32(layer_input) + mixer_output  (residual_in_fp32)", _float32_residual,
                             reads=("layer_input", "mixer_output"))
                      if config.residual_in_fp32 else Sum(X + MIXER)),
        )
    return block


def _float_logits(logits, config):
    return logits.float()


def _as_it_is(hidden, model):
    return hidden


def _mamba(name: str, model_type: str, tiny_config) -> Family:
    return Family(
        name=name, model_types=(model_type,), layers="backbone.layers", embed_tokens="backbone.embeddings",
        ln_final="backbone.norm_f", attention=None, mlp=None, block=_mamba_block(name), tiny_config=tiny_config,
        attention_internals=NO_ATTENTION, before_final_norm=_as_it_is, logits_transform=_float_logits,
        variants=(("`residual_in_fp32=True` (the default)", {}), ("`residual_in_fp32=False`", {"residual_in_fp32": False})),
    )


_SMALL = dict(hidden_size=64, num_hidden_layers=3, vocab_size=128, state_size=8, conv_kernel=4, expand=2)
MAMBA = _mamba("Mamba", "mamba", lambda: transformers.MambaConfig(**_SMALL, time_step_rank=4))
MAMBA2 = _mamba("Mamba-2", "mamba2", lambda: transformers.Mamba2Config(
    **_SMALL, num_heads=8, head_dim=16, n_groups=2, chunk_size=16))
FALCON_MAMBA = _mamba("Falcon-Mamba", "falcon_mamba", lambda: transformers.FalconMambaConfig(
    **_SMALL, time_step_rank=4))


# RWKV: time mixing (a linear recurrence over the tokens, at `attention`) after ln1, channel mixing (the MLP,
# `feed_forward`: value(relu(key(x'))²) gated by sigmoid(receptance(x'')), x' and x'' mixes of each token with the
# one before) after ln2. Block 0 norms the embeddings first with pre_ln: the residual adds start from its output.
def _rwkv_block(config, i):
    base = pre_norm_block(
        input_norm="ln1", attention="attention", o_proj="", post_norm="ln2", mlp="feed_forward", act="",
        down_proj="feed_forward.value",
        mlp_activation=SameAs("mlp_neurons"),  # relu(key(x'))², the value projection's input: no gate before it
        **({"layer_input": output("pre_ln")} if i == 0 else {}),
    )
    block = mixer_block(base, i, "attention", "RWKV's time mixing, a linear recurrence")
    if i == 0:
        block = dataclasses.replace(block, identity=block.identity.noted("(layer_input = pre_ln(embeddings) on block 0)"))
    return block


def _rwkv_readout(hidden, model):
    """In eval mode the model halves the stream after every ``rescale_every``-th block: after the last one too, where
    the number of blocks is a multiple of it."""
    every = model.config.rescale_every
    if model.rwkv.layers_are_rescaled and every > 0 and model.config.num_hidden_layers % every == 0:
        return hidden / 2
    return hidden


RWKV = Family(
    name="RWKV", model_types=("rwkv",), layers="rwkv.blocks", embed_tokens="rwkv.embeddings", ln_final="rwkv.ln_out",
    lm_head="head", attention=None, mlp="feed_forward", block=_rwkv_block, attention_internals=NO_ATTENTION,
    before_final_norm=_rwkv_readout,
    skip_output=lambda stream, block: (stream, block.inputs[1].get("state"), None),  # (hidden, state, attentions)
    # blocks 1 and 3 are followed by a halving of the stream (rescale_every=2), block 3's before the final norm
    tiny_config=lambda: transformers.RwkvConfig(
        hidden_size=64, attention_hidden_size=64, intermediate_size=128, num_hidden_layers=4, vocab_size=128,
        context_length=64, rescale_every=2),
)


def _xlstm_block(config, i):
    return mixer_block(pre_norm_block(
        input_norm="norm_mlstm", attention="mlstm_layer", o_proj="", post_norm="norm_ffn", mlp="ffn",
        act="ffn.act_fn", down_proj="ffn.proj_down"), i, "mlstm_layer", "an mLSTM layer, a matrix-memory recurrence")


def _xlstm_logits(logits, config):
    """The head's logits in float32, soft-capped as the model does."""
    cap = config.output_logit_soft_cap
    logits = logits.float()
    return logits if cap is None else cap * torch.tanh(logits / cap)


XLSTM = Family(
    name="xLSTM", model_types=("xlstm",), layers="backbone.blocks", embed_tokens="backbone.embeddings",
    ln_final="backbone.out_norm", attention=None, mlp="ffn", block=_xlstm_block, attention_internals=NO_ATTENTION,
    logits_transform=_xlstm_logits, skip_output=lambda stream, block: (stream, block.inputs[0][1]),  # (hidden, state)
    # the default factors (qk 0.5, v 1.0): hidden_size 128 makes both widths multiples of 64, as the cache needs
    tiny_config=lambda: transformers.xLSTMConfig(
        hidden_size=128, num_hidden_layers=3, num_heads=4, vocab_size=128, chunk_size=16),
)


_NEMOTRON_H_SUBLAYERS = {"linear_attention": "a Mamba-2 mixer", "full_attention": "an attention", "mlp": "an MLP",
                         "moe": "a routed mixture of experts"}


def _check_nemotron_h(config):
    unknown = sorted(set(config.layers_block_type) - set(_NEMOTRON_H_SUBLAYERS))
    if unknown:
        raise UnsupportedConfig(f"Nemotron-H blocks of type {', '.join(unknown)} are not placed by the family spec "
                                f"(it places {', '.join(_NEMOTRON_H_SUBLAYERS)}).")


def _nemotron_h_block(config, i):
    kind = config.layers_block_type[i]
    sublayer = _NEMOTRON_H_SUBLAYERS[kind]
    alone = f"a Nemotron-H block has one sublayer, here {sublayer}"
    stream = {"layer_input": input("", arg=0), "layer_output": output("")}
    if kind in ("mlp", "moe"):
        no_mixer = Unavailable(f"block {i} mixes no tokens: {alone}")
        routed = kind == "moe"
        return Block(
            values={**stream, **dict.fromkeys(("attention_norm_output", "mixer_output", *ATTENTION_VALUES), no_mixer),
                    "layer_mid": SameAs("layer_input"),  # no token mixer's add before the MLP's
                    "mlp_norm_output": output("norm"), "mlp_input": input("mixer"),
                    "mlp_activation": ROUTED if routed else output("mixer.act_fn"),
                    "mlp_neurons": ROUTED if routed else input("mixer.down_proj"), "mlp_output": output("mixer"),
                    **(router("mixer.gate") if routed else {})},
            identity=Sum(X + M),
        )
    no_mlp = Unavailable(f"block {i} has no MLP: {alone}")
    values = {**stream, "attention_norm_output": output("norm"), "layer_mid": SameAs("layer_output"),
              **dict.fromkeys(MLP_VALUES, no_mlp)}
    if kind == "full_attention":
        values |= {"attention_premix": input("mixer.o_proj", heads=True), "attention_output": output("mixer", index=0)}
        return Block(values=values, identity=Sum(X + A))
    values |= {"mixer_output": output("mixer"), **not_attention(i, "a Mamba-2 mixer")}
    return Block(values=values, identity=Sum(X + MIXER))


def _nemotron_h_sublayers():
    from transformers.models.nemotron_h import modeling_nemotron_h as modeling

    return {modeling.NemotronHAttention: "self_attn", modeling.NemotronHMLP: "mlp", modeling.NemotronHMoE: "mlp"}


NEMOTRON_H = Family(
    name="Nemotron-H", model_types=("nemotron_h",), layers="model.layers", embed_tokens="model.embeddings",
    ln_final="model.norm_f", attention="mixer", mlp="mixer", sublayer_classes=_nemotron_h_sublayers,
    block=_nemotron_h_block, logits_transform=_float_logits, check_config=_check_nemotron_h,
    tiny_config=lambda: transformers.NemotronHConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
        intermediate_size=128, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        ssm_state_size=8, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, chunk_size=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32),
)
