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

import transformers

from ..spec.sourced import sourced
from .base import At, EagerAttention, Family, input, output, post_norm_block


@sourced
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


def _block(config, i):
    return post_norm_block(
        first_norm="ln_1", second_norm="ln_2", attention="attn", o_proj="attn.c_proj",
        mlp_input=input("mlp", copy=True), mlp_activation=output("mlp", op="self_act_0"),
        mlp_neurons=input("mlp.c_proj"), mlp_output=output("mlp"))


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
    tiny_config=lambda: transformers.OpenAIGPTConfig(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64),
)
