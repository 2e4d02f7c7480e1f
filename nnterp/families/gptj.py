"""GPT-J: a parallel block with one shared norm.

``y = (attention_output + mlp_output) + layer_input``: attention and MLP both read
``ln_1(x)``, so ``mlp_norm_output`` is ``attention_norm_output`` and there is no
stream between the sublayers (no ``layer_mid``). The plain sum
``layer_input + attention_output + mlp_output`` adds in another order and is within
one ulp of ``layer_output``.
"""

from transformers import GPTJConfig

from .base import Block, Family, SameAs, Unavailable, input, output

PARALLEL_NO_MID = Unavailable(
    "a parallel block: the attention and the MLP both read the block input, so no stream exists between them"
)


def _block(config, i):
    return Block(
        values={
            "layer_input": input("", arg=0),
            "attention_norm_output": output("ln_1"),
            "attention_premix": input("attn.out_proj", heads=True),
            "attention_output": output("attn", index=0),
            "layer_mid": PARALLEL_NO_MID,
            "mlp_norm_output": SameAs("attention_norm_output"),
            "mlp_input": input("mlp"),
            "mlp_activation": output("mlp.act"),
            "mlp_neurons": input("mlp.fc_out"),
            "mlp_output": output("mlp"),
            "layer_output": output(""),
        },
        formula="layer_output = (attention_output + mlp_output) + layer_input",
        combine=lambda t, _: (t["attention_output"] + t["mlp_output"]) + t["layer_input"],
        ulps=1,
    )


GPTJ = Family(
    name="GPT-J",
    model_types=("gptj",),
    layers="transformer.h",
    embed_tokens="transformer.wte",
    ln_final="transformer.ln_f",
    attention="attn",
    mlp="mlp",
    block=_block,
    tiny_config=lambda: GPTJConfig(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64, rotary_dim=8),
)
