"""Gemma-3n (text): AltUp streams, a LAuReL branch, per-layer inputs and keys and values shared between layers.

The model keeps ``altup_num_inputs`` streams, stacked as ``[streams, batch, seq, hidden]``; ``layer_input`` and
``layer_output`` view that tensor as ``[batch, seq, streams, hidden]`` (the layout of other parallel streams, so
``[:, -1]`` is the last token). Each block

- predicts every stream from the incoming ones (``altup.predict``): ``P = layer_input + layer_input @ A``, with
  ``A`` the per-token mixing ``altup.prediction_coefs`` gives;
- runs a Gemma sandwich block on the active stream ``P[0]`` (``altup_active_idx``): the attention and the MLP each
  between two norms, and the LAuReL branch (``laurel``, reading ``input_layernorm``'s output as the attention does,
  returning it plus a low-rank update) added with the attention, scaled by 1/sqrt(2):
  ``layer_mid = ((P[0] + attention_output) + laurel) / sqrt(2)``, the MLP's residual;
- corrects every stream with the innovation ``layer_mid + mlp_output - P[0]``, weighted per stream by
  ``altup.correction_coefs``' output plus one, and adds the per-layer-input branch (``post_per_layer_input_norm``'s
  output) to every stream but the first.

The values between the norms are the active stream's, exact where the code computes them; ``attention_norm_output``
is ``input_layernorm``'s output, which the LAuReL branch reads too (an edit of it reaches both). After the last block
the model maps streams 1.. back (``altup_unembed_projections``, rescaled to stream 0's magnitude) and averages the
streams before the final norm: ``project_on_vocab`` does the same to a ``[batch, seq, streams, hidden]`` stream and
refuses a single ``[batch, seq, hidden]`` one (a contribution, or ``layer_mid``), which the model never reads out.
From layer ``num_hidden_layers - num_kv_shared_layers`` on, the attentions reuse the keys and values of the last
earlier layer of their type: there ``keys`` and ``values`` are read as copies, so an edit reaches that layer's
attention alone (not the shared tensor every reusing layer holds); on the layer that stores them, an edit reaches
the reusing layers too, as the model shares them.
"""

import dataclasses
import math

import torch
import transformers

from ..spec.errors import NNterpError
from ..spec.identity import Custom
from .base import STANDARD, Block, Family, input, output, pre_norm_block, shared_kv_qk_norms, softcap_logits

FORMULA = ("layer_output = P + (((P[0] + attention_output) + laurel) / sqrt(2) + mlp_output - P[0]) * (C + 1), "
           "then + per_layer on every stream but the first, where P = layer_input + layer_input @ A "
           "(A, C: altup.prediction_coefs' and altup.correction_coefs' outputs; laurel: laurel's output; "
           "per_layer: post_per_layer_input_norm's output; P[0]: the active stream; the streams on the first axis, "
           "as the model stacks them)")

STREAM = dict(streams_first=True)


def _combine(t, block):
    """The block's arithmetic in the model's order, from the stacked stream ``[streams, batch, seq, hidden]``."""
    x = t["layer_input"].movedim(2, 0)
    k, active = x.shape[0], block.config.altup_active_idx
    coefs = t["A"].reshape(*t["A"].shape[:-1], k, k).permute(0, 1, 3, 2)
    predictions = (torch.matmul(x.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2) + x).contiguous()
    mid = ((predictions[active] + t["attention_output"]) + t["laurel"]) / math.sqrt(2)
    innovation = ((mid + t["mlp_output"]) - predictions[active]).repeat(k, 1, 1, 1)
    corrected = torch.mul(innovation, (t["C"] + 1.0).permute(2, 0, 1).unsqueeze(-1)) + predictions
    return torch.cat((corrected[:1], corrected[1:] + t["per_layer"])).movedim(0, 2)


# a layer that reuses an earlier layer's keys and values reads them as copies: an edit reaches its own attention, not
# the storing layer's tensor that every reusing layer (and the cache) holds
_REUSED = {name: dataclasses.replace(location, copy=True)
           for name, location in STANDARD.locations("self_attn").items() if name in ("keys", "values")}


def _block(config, i):
    base = pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="pre_feedforward_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj",
        layer_input=input("", arg=0, **STREAM), layer_output=output("", **STREAM),
        attention_output=output("post_attention_layernorm"), mlp_output=output("post_feedforward_layernorm"),
        **(_REUSED if config.kv_sharing_modes[i] == "reuse" else {}),
        **shared_kv_qk_norms(config, i),
    )
    return Block(
        values=base.values,
        identity=Custom(FORMULA, _combine, reads=("layer_input", "attention_output", "mlp_output", "A", "C", "laurel", "per_layer")),
        extra={"A": output("altup.prediction_coefs"), "laurel": output("laurel"),
               "C": output("altup.correction_coefs"), "per_layer": output("post_per_layer_input_norm")},
    )


class Gemma3nError(NNterpError, ValueError):
    """A request Gemma-3n's blocks cannot serve: a readout of one stream, a skip of a layer others read keys from."""


def _altup_readout(hidden, model):
    """What the model does to the last block's streams before the final norm: streams 1.. mapped back by
    ``altup_unembed_projections`` and rescaled to stream 0's magnitude, then all averaged."""
    k = model.config.altup_num_inputs
    if hidden.dim() != 4 or hidden.shape[2] != k:
        raise Gemma3nError(
            f"Gemma-3n reads out its {k} AltUp streams together (mapped back and averaged before the final norm), so "
            f"project_on_vocab takes a [batch, seq, {k}, hidden] stream (layer_input, layer_output), not a tensor of "
            f"shape {list(hidden.shape)}: a single stream or a contribution has no readout in this model.")
    streams = hidden.movedim(2, 0)
    target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
    out = [streams[0]]
    for i in range(1, k):
        mapped = model.model.altup_unembed_projections[i - 1](streams[i]).to(dtype=streams[0].dtype)
        magnitude = torch.sqrt(torch.mean(mapped**2, dim=-1, keepdim=True).clamp(min=1e-5))
        out.append(mapped * target / magnitude)
    return torch.mean(torch.stack(out), dim=0)


def _skip(stream, block):
    """A skipped block hands on the streams in the model's layout; a layer whose keys later layers reuse cannot be
    skipped (they would have none to read)."""
    if block._module.self_attn.store_full_length_kv:
        raise Gemma3nError(f"{block.path} stores the keys and values that later layers reuse (Gemma-3n's KV sharing): "
                           "skipping it leaves them nothing to read. Skip other layers, or edit this one's outputs.")
    return stream.movedim(2, 0)  # the model's [streams, batch, seq, hidden]


GEMMA3N = Family(
    name="Gemma-3n",
    model_types=("gemma3n_text",),
    layers="model.layers", embed_tokens="model.embed_tokens", ln_final="model.norm", attention="self_attn", mlp="mlp",
    block=_block,
    before_final_norm=_altup_readout,
    logits_transform=softcap_logits,
    skip_output=_skip,
    tiny_config=lambda: transformers.Gemma3nTextConfig(
        hidden_size=32, intermediate_size=[64, 64, 48, 64, 64], num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=128, vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8, laurel_rank=8, altup_num_inputs=3, num_kv_shared_layers=3, sliding_window=4,
        max_position_embeddings=64, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0, 0.0],
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                     "sliding_attention"]),
)
