"""OpenAI GPT (the first GPT): post-norm blocks, and no final norm.

Each block norms the stream after each residual add, and the head reads the last block's output as it is:

    n = ln_1(layer_input + attention_output)     (layer_mid: what the MLP reads, and the second add's residual)
    layer_output = ln_2(n + mlp_output)

No norm sits before either sublayer: the attention reads ``layer_input`` and the MLP reads ``layer_mid``, so
``attention_norm_output`` and ``mlp_norm_output`` are unavailable. ``mlp_input`` is a copy of ``layer_mid`` handed
to the MLP alone: an edit of it reaches the MLP and not the stream, while an edit of ``layer_mid`` reaches both.
The identity recomputes the two norms with their own modules' forward, bit for bit. ``model.ln_final`` does not
exist; ``project_on_vocab`` is the head alone. The blocks return a list, not a tuple. The attention computes in
its own ``_attn`` method: queries, keys and values are read where the fused projection is split (the keys before
the model transposes them), the scores and the probabilities inside ``_attn``.
"""

from dataclasses import dataclass

import torch
from transformers import OpenAIGPTConfig

from .base import At, Block, EagerAttention, Family, Unavailable, input, output

FORMULA = "layer_output = ln_2(ln_1(layer_input + attention_output) + mlp_output)"


@dataclass(frozen=True)
class OwnAttention(EagerAttention):
    """The attention's own code: ``c_attn``'s output split into queries, keys and values (``x_split_0``), each
    ``[batch, seq, hidden]`` viewed per head; then ``_attn`` scales, masks and softmaxes the scores and mixes the
    values with the probabilities."""

    call: str = "self__attn_0"
    probabilities: str = "torch_matmul_1"

    def locations(self, attention: str) -> dict[str, At]:
        def split(i):
            return At(attention, "output", op="x_split_0", index=i, heads=True)

        return {
            "queries": split(0), "keys": split(1), "values": split(2),
            "attention_scores": At(attention, self.scores_side, op=f"{self.call}.{self.scores}"),
            "attention_probabilities": At(attention, "input", op=f"{self.call}.{self.probabilities}"),
        }


def _native(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm's own forward, called past nnsight's instrumentation (recomputing, not serving a value)."""
    return type(norm).forward(norm, x)


def _mid(t, block):
    return _native(block.ln_1, t["layer_input"] + t["attention_output"])


def _post_norm(t, block):
    return _native(block.ln_2, _mid(t, block) + t["mlp_output"])


def _block(config, i):
    return Block(
        values={
            "layer_input": input("", arg=0),
            "attention_norm_output": Unavailable(
                "a post-norm block: the attention reads layer_input itself, and the block norms the stream after the "
                "attention's add (ln_1, whose output is layer_mid)"),
            "attention_premix": input("attn.c_proj", heads=True),
            "attention_output": output("attn", index=0),
            # the normed stream: what the MLP reads and the residual of the second add
            "layer_mid": output("ln_1"),
            "mlp_norm_output": Unavailable(
                "a post-norm block: no norm sits on the MLP's branch alone; the MLP reads the stream after ln_1 "
                "(layer_mid), which is also the residual of the MLP's add"),
            # what the MLP reads is also the residual: edits of what the MLP receives go to a copy
            "mlp_input": input("mlp", copy=True),
            "mlp_activation": output("mlp", op="self_act_0"),
            "mlp_neurons": input("mlp.c_proj"),
            "mlp_output": output("mlp"),
            "layer_output": output("", index=0),
        },
        formula=FORMULA,
        combine=_post_norm,
        mid=_mid,  # the proof checks layer_mid is ln_1's output of the first add
    )


OPENAI_GPT = Family(
    name="OpenAI GPT",
    model_types=("openai-gpt",),
    layers="transformer.h",
    embed_tokens="transformer.tokens_embed",
    ln_final=None,
    attention="attn",
    mlp="mlp",
    block=_block,
    attention_internals=OwnAttention(),
    # the model reads a block's output as ``outputs[0]``: a skipped block hands on a list
    skip_output=lambda stream, block: [stream],
    tiny_config=lambda: OpenAIGPTConfig(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64),
)
