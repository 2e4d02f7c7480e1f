"""Recurrent and state-space models: blocks whose token mixer is not attention, on every layer.

No block has attention: ``mixer_output`` is what the block's token mixer adds to the stream,
``attention_norm_output`` the normed stream it reads, and the attention's values (and
``layers[i].self_attn``) are unavailable with the reason.

- Mamba, Mamba-2, Falcon-Mamba: ``backbone.layers[i]`` is ``x + mixer(norm(x))``, one token mixer and
  its residual add, no MLP (the MLP's values and ``layers[i].mlp`` are unavailable); ``layer_mid``, the
  stream after the mixer's add, is ``layer_output``. With ``residual_in_fp32`` (the default) the block
  adds the mixer's output to the stream cast to float32, so in a bfloat16 model the stream is float32
  after the first block; the final norm reads it as it is and the head reads the norm's output cast
  to the head's dtype; the logits are float32. The mixers run a pure-PyTorch scan where the
  ``mamba_ssm`` kernels are not installed (CPU).
"""

from __future__ import annotations

import torch
from transformers import FalconMambaConfig, Mamba2Config, MambaConfig

from ..catalog import ATTENTION_VALUES
from .base import Block, Family, SameAs, Unavailable, input, output

NO_ATTENTION = Unavailable("no block of this model has attention: each mixes tokens with a recurrent mixer, whose "
                           "contribution is mixer_output")
MLP_VALUES = ("mlp_norm_output", "mlp_input", "mlp_activation", "mlp_neurons", "mlp_output")


def not_attention(layer: int, kind: str) -> dict[str, Unavailable]:
    """The attention's values of block ``layer``, which mixes tokens with ``kind``: unavailable, with the reason."""
    return dict.fromkeys(ATTENTION_VALUES, Unavailable(
        f"block {layer} mixes tokens with {kind}, not attention: its contribution is mixer_output"))


def _float32_residual(t, block):
    return (t["layer_input"].to(torch.float32) if block.residual_in_fp32 else t["layer_input"]) + t["mixer_output"]


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
            formula=("layer_output = float32(layer_input) + mixer_output  (residual_in_fp32)"
                     if config.residual_in_fp32 else "layer_output = layer_input + mixer_output"),
            combine=_float32_residual,
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
MAMBA = _mamba("Mamba", "mamba", lambda: MambaConfig(**_SMALL, time_step_rank=4))
MAMBA2 = _mamba("Mamba-2", "mamba2", lambda: Mamba2Config(
    **_SMALL, num_heads=8, head_dim=16, n_groups=2, chunk_size=16))
FALCON_MAMBA = _mamba("Falcon-Mamba", "falcon_mamba", lambda: FalconMambaConfig(
    **_SMALL, time_step_rank=4))
