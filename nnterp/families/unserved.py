"""The causal-LM model types of transformers that no family serves, each with its category and the reason.

A type that transformers adds is neither served nor listed here until someone reads its blocks: the census
(``nnterp.proof.coverage``, tests/unit/test_coverage.py) fails until it is served or classified here. ``family_of`` refuses
a listed type with its reason.
"""

from __future__ import annotations

# category -> what it means (the Coverage page's headings, in this order)
CATEGORIES: dict[str, str] = {
    "encoder": "An encoder with a language-model head: bidirectional BERT-style blocks whose norms come after "
               "the residual adds, so no residual identity holds.",
    "decoder half": "The decoder half of an encoder-decoder: its blocks cross-attend to an encoder's output, a "
                    "third sublayer with no standard name.",
    "multimodal": "An image, speech or music model whose language model is not served as such here.",
    "package": "Needs a package that is not installed with nnterp.",
    "not yet served": "A decoder whose blocks need a spec of their own, not yet written and proven against hooks: "
                      "the reason says what its blocks do that no existing spec does.",
}

# category -> what a type of it is, in a sentence (the error that refuses the type)
_WHAT: dict[str, str] = {
    "encoder": "an encoder",
    "decoder half": "the decoder half of an encoder-decoder",
    "multimodal": "a multimodal model whose language model is not served as such",
    "package": "a model that needs a package not installed with nnterp",
    "not yet served": "a decoder not yet served",
}

_BERT = ("encoder", "BERT-style encoder blocks (attention, intermediate, output), norms after the adds")
_SEQ2SEQ = ("decoder half", "decoder blocks with encoder_attn between self-attention and the MLP")

# model type -> (category, reason)
EXCLUDED: dict[str, tuple[str, str]] = {
    **{t: _BERT for t in ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                          "megatron-bert", "rembert", "roberta", "roc_bert", "roformer", "xlm-roberta",
                          "xlm-roberta-xl", "xmod")},
    "roberta-prelayernorm": ("encoder", "a bidirectional RoBERTa encoder (pre-norm) trained as a masked LM"),
    "xlm": ("encoder", "attention and MLP as two parallel ModuleLists, norms after the adds"),
    "xlnet": ("encoder", "a permutation LM with two-stream relative attention"),
    **{t: _SEQ2SEQ for t in ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp",
                             "pegasus", "plbart", "trocr", "whisper")},
    "prophetnet": ("decoder half", "a decoder with n-gram prediction streams and cross-attention"),
    "gemma3n": ("package", "Gemma3nForConditionalGeneration needs timm and Pillow"),
    "blt": ("multimodal", "a byte latent transformer: patcher, local encoder and decoder with cross-attention"),
    "git": ("multimodal", "an image encoder with a BERT-style text decoder"),
    "mllama": ("multimodal", "MllamaForCausalLM is the text decoder alone: its cross-attention blocks "
                             "(config.cross_attention_layers) are skipped on text input, so they have no values, and "
                             "given image states they add tanh(gate) · cross_attn and tanh(gate) · mlp, terms at no "
                             "module boundary"),
    "musicgen": ("multimodal", "an audio-codebook decoder with cross-attention"),
    "musicgen_melody": ("multimodal", "an audio-codebook decoder over [batch * codebooks, seq]"),
    "gemma4_assistant": ("multimodal", "a speculative-decoding assistant: its layers read the target model's keys "
                                       "and values"),
    "gemma4_unified_assistant": ("multimodal", "a speculative-decoding assistant: its layers read the target model's "
                                               "keys and values"),
    "ergo": ("not yet served", "after each sublayer's norm, a learned gate per dimension mixes the branch into a "
                               "rescaled stream (x <- sigmoid(w) * branch + sqrt(1 + sigmoid(w)) * exp(-softplus(w) / 2) "
                               "* x, ErgoResidualGate): the stream itself is scaled at each add, an identity of its own"),
    "kolibri1_1": ("not yet served", "Kolibri-1's blocks, but each returns (stream, index pool) and its indexed-attention "
                                     "layers read keys and values and a pool of candidate keys that earlier blocks "
                                     "computed, masked by a top-k selection"),
}

# the causal-LM types of a transformers newer than the one the suite runs on (constraints.txt), by the version that
# added them: served or classified above, though the installed transformers may not have them
SINCE: dict[str, str] = {"ergo": "5.25", "kolibri1_1": "5.25", "minicpm5_moe": "5.25", "param2moe": "5.25"}


WHERE_SERVED = "docs/coverage.md lists the served types (in code: nnterp.proof.coverage.served_types())"


def why_not_served(model_type: str) -> str | None:
    """Why ``model_type`` is not served, in one line (None: the table does not exclude it)."""
    if model_type not in EXCLUDED:
        return None
    category, reason = EXCLUDED[model_type]
    return f"{_WHAT[category]}: {reason}"
