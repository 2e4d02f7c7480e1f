"""HRM-Text: two stacks of blocks, looped for several cycles in each forward pass.

HRM-Text has two stacks of Llama-style blocks, ``model.L_module.layers`` and ``model.H_module.layers``:
``model.layers`` is the L stack's blocks then the H stack's. Each of ``H_cycles`` cycles runs the L stack
``L_cycles`` times, then the H stack once; a stack's first block receives the sum of the two stacks' last outputs
(``low + high``, or ``high + low`` for the H stack), and each stack ends with its weightless ``final_norm``. The
H stack's ``final_norm`` is ``ln_final`` (the model reads its last output with it): its native ``.output`` is the
first cycle's.

Each block's values are read per run (``layers[i].run(k)``; ``model.schedule`` lists the calls in forward
order), with the sequential identity on every run.
"""

import transformers

from .base import Family, pre_norm_block


def _hrm_block(config, i):
    return pre_norm_block(input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
                          post_norm="post_attention_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj")


def _hrm_schedule(config):
    low, high = range(config.num_layers_per_stack), range(config.num_layers_per_stack, 2 * config.num_layers_per_stack)
    return tuple(config.H_cycles * ([*low] * config.L_cycles + [*high]))


HRM_TEXT = Family(
    name="HRM-Text", model_types=("hrm_text",), layers="model.L_module.layers", stacks=("model.H_module.layers",),
    embed_tokens="model.embed_tokens", ln_final="model.H_module.final_norm", attention="self_attn", mlp="mlp",
    block=_hrm_block, schedule=_hrm_schedule,
    premix_is_not_mixed_values="each head's output is multiplied by a sigmoid gate (gate_proj) before o_proj",
    tiny_config=lambda: transformers.HrmTextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
        H_cycles=2, L_cycles=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
)
