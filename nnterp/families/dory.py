"""Dory: a looped section of blocks, and a stream on the unit sphere.

A block of the looped section has its values per run: ``model.layers[i].run(k).layer_output``, run ``k`` from 0 to
``model.runs_of(i) - 1``, and ``model.schedule`` lists every block call in forward order. Reading a looped block's
value without a run raises ``RunNotChosen``. The native modules are shared by the runs: ``model.layers[i]``'s own
``.output`` is the first run's, as nnsight binds it.

Dory (nNGPT-style) keeps its stream on the unit sphere. Each block L2-normalises the stream it receives
(``input_layernorm``) and moves it towards the normalised attention output at a learned per-channel rate
``|λ1·s|``, then does the same with the MLP:

    n1 = input_layernorm(layer_input)                    (attention_norm_output)
    layer_mid = n1 + |λ1·s| · (attention_output - n1)
    n2 = pre_feedforward_layernorm(layer_mid)            (mlp_norm_output)
    layer_output = n2 + |λ2·s| · (mlp_output - n2)

``attention_output`` and ``mlp_output`` are the sublayers' normalised outputs (``post_attention_layernorm``,
``post_feedforward_layernorm``), the points the stream moves towards. The layers split into an input section
(``n_input_layers``), a recurrent section run ``n_recurrent_loops`` times and an output section; each loop starts
from ``norm(stream) + norm(input section's output)``, so a loop's first block receives that sum. ``model.norm``
(``ln_final``) also runs at those restarts: its native ``.output`` is the first restart's, not the readout's.
"""

import transformers

from ..spec.identity import Custom
from .base import Block, Family, input, native, output, qk_norms

FORMULA = ("layer_output = n2 + |λ2·s|·(mlp_output - n2), n2 = norm(layer_mid), "
           "layer_mid = n1 + |λ1·s|·(attention_output - n1), n1 = norm(layer_input) "
           "(L2 norms: input_layernorm, pre_feedforward_layernorm; λ1, λ2: lambda_1, lambda_2; s: lambda_scale)")


def _mid(t, block):
    n1 = native(block.input_layernorm, t["layer_input"])
    return n1 + (block.lambda_1 * block.lambda_scale).abs() * (t["attention_output"] - n1)


def _interpolated(block, t):
    n2 = native(block.pre_feedforward_layernorm, _mid(t, block))
    return n2 + (block.lambda_2 * block.lambda_scale).abs() * (t["mlp_output"] - n2)


def _dory_block(config, i):
    return Block(
        values={
            "layer_input": input("", arg=0),
            "attention_norm_output": output("input_layernorm"),
            "attention_premix": input("self_attn.o_proj", heads=True),
            "attention_output": output("post_attention_layernorm"),
            "layer_mid": input("pre_feedforward_layernorm"),
            "mlp_norm_output": output("pre_feedforward_layernorm"),
            # the normed stream is also the base the MLP's interpolation starts from: mlp_input is read as a copy swapped
            # in for the MLP alone, so an edit of it is the MLP's (an edit of mlp_norm_output reaches both)
            "mlp_input": input("mlp", copy=True),
            "mlp_activation": output("mlp.act_fn"),
            "mlp_neurons": input("mlp.down_proj"),
            "mlp_output": output("post_feedforward_layernorm"),
            "layer_output": output(""),
            # each head's queries and keys L2-normalised, [batch, seq, heads, head_dim]
            **qk_norms(),
        },
        identity=Custom(FORMULA, lambda t, block: _interpolated(block, t), mid=_mid, reads=("layer_input", "attention_output", "mlp_output")),
    )


def _dory_schedule(config):
    start = config.n_input_layers
    looped = range(start, start + config.n_recurrent_layers)
    last = range(config.num_hidden_layers - config.n_output_layers, config.num_hidden_layers)
    return (*range(start), *(list(looped) * config.n_recurrent_loops), *last)


DORY = Family(
    name="Dory", model_types=("dory",), block=_dory_block, schedule=_dory_schedule,
    premix_is_not_mixed_values="each head's output is gated by a sigmoid, and the heads together are L2-normalised "
    "(attn_sub_norm), before o_proj",
    tiny_config=lambda: transformers.DoryConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, n_input_layers=1, n_output_layers=1, n_recurrent_loops=3,
        sliding_window=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
)

