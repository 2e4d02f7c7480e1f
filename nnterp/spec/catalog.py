"""The standard values: declared once, here.

Everything else (envoy properties, ``order(i)``, availability listings, the shapes the proof
expects, the streams the lens and the identity read, docs, tests) is derived from this table and
the family specs: a value's shape is its ``dims``, named in ``DIMS``. ``rank`` is the forward order on a
sequential pre-norm block; ``StandardizedTransformer.order`` reports the order a
family really runs in.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from .sourced import sourced

# the dimensions a value's shape names (``Value.dims``): what each counts
DIMS: dict[str, str] = {
    "batch": "the prompts",
    "seq": "the positions",
    "query": "the positions that attend",
    "key": "the positions attended to",
    "hidden_size": "the stream's width",
    "num_heads": "the query heads",
    "num_key_value_heads": "the key and value heads",
    "head_dim": "a head's width",
    "intermediate_size": "the MLP's width",
    "num_experts": "the routed experts",
}
STREAM_DIMS = ("batch", "seq", "hidden_size")
PER_HEAD = ("batch", "seq", "num_heads", "head_dim")
PER_KV_HEAD = ("batch", "seq", "num_key_value_heads", "head_dim")
PATTERN = ("batch", "num_heads", "query", "key")
NEURONS = ("batch", "seq", "intermediate_size")
EXPERTS = ("batch", "seq", "num_experts")


@sourced
@dataclass(frozen=True)
class Value:
    name: str
    owner: str  # "block", "self_attn" or "mlp": the envoy the property lives on
    dims: tuple[str, ...]  # its shape, by dimension name (``DIMS``)
    rank: int
    meaning: str
    # its place in the residual identity: "input", "mid", "output" (the stream entering the block, after the token
    # mixer's add, leaving it) or "added" (what a sublayer adds to it); None: neither
    residual: str | None = None

    @property
    def shape(self) -> str:
        """Its shape as the docs show it: ``[batch, seq, hidden_size]``."""
        return f"[{', '.join(self.dims)}]"

    @property
    def key(self) -> str:
        """Name relative to the block, as ``order(i)`` prints it."""
        return self.name if self.owner == "block" else f"{self.owner}.{self.name}"


CATALOG: tuple[Value, ...] = (
    Value("layer_input", "block", STREAM_DIMS, 0, "the residual stream entering the block", "input"),
    Value("attention_norm_output", "block", STREAM_DIMS, 1,
          "the normed stream the attention reads (the token mixer, on a hybrid's other blocks)"),
    Value("query_norm_input", "self_attn", PER_HEAD, 2,
          "the queries entering the attention's own query norm, per head"),
    Value("query_norm_output", "self_attn", PER_HEAD, 3,
          "the queries leaving the attention's own query norm, per head (where the rotary embedding follows "
          "the norm, as on most families, queries is this rotated)"),
    Value("key_norm_input", "self_attn", PER_KV_HEAD, 4,
          "the keys entering the attention's own key norm, per key-value head"),
    Value("key_norm_output", "self_attn", PER_KV_HEAD, 5,
          "the keys leaving the attention's own key norm, per key-value head (where the rotary embedding follows "
          "the norm, keys is this rotated)"),
    Value("queries", "self_attn", PER_HEAD, 6,
          "the queries as the attention uses them (after q norms and rotary embeddings)"),
    Value("keys", "self_attn", PER_KV_HEAD, 6,
          "the keys as the attention uses them (after k norms and rotary embeddings)"),
    Value("values", "self_attn", PER_KV_HEAD, 6, "the values the heads mix"),
    Value("attention_scores", "self_attn", PATTERN, 7, "the scores before the softmax: scaled, softcapped, masked"),
    Value("attention_probabilities", "self_attn", PATTERN, 8, "the attention pattern, after the softmax"),
    Value("attention_premix", "self_attn", PER_HEAD, 9, "every head's output before the output projection"),
    Value("attention_output_before_norm", "self_attn", STREAM_DIMS, 10,
          "what the attention returns, before the norm a block with norms after its sublayers applies to it "
          "(attention_output where no norm follows the attention)"),
    Value("attention_output", "self_attn", STREAM_DIMS, 11, "what the attention adds to the stream", "added"),
    Value("mixer_output", "block", STREAM_DIMS, 11,
          "what the block's token mixer (attention, Mamba, linear attention or convolution) adds to the stream",
          "added"),
    Value("layer_mid", "block", STREAM_DIMS, 12, "the stream after the token mixer's add", "mid"),
    Value("mlp_norm_output", "block", STREAM_DIMS, 13, "the output of the norm before the MLP"),
    Value("mlp_input", "block", STREAM_DIMS, 14, "what the MLP is called with"),
    Value("router_logits", "mlp", EXPERTS, 15, "a routed mixture's router logits, one per expert, before any "
          "softmax or choice"),
    Value("mlp_pre_activation", "mlp", NEURONS, 16,
          "the input of the MLP's activation function (the gate projection's output on a gated MLP)"),
    Value("mlp_up_output", "mlp", NEURONS, 17,
          "a gated MLP's up projection output, which the activation's output multiplies: mlp_neurons is "
          "mlp_activation * mlp_up_output"),
    Value("mlp_activation", "mlp", NEURONS, 18, "the output of the MLP's activation function"),
    Value("mlp_neurons", "mlp", NEURONS, 19, "what the down projection sums"),
    Value("mlp_output_before_norm", "mlp", STREAM_DIMS, 20,
          "what the MLP returns, before the norm a block with norms after its sublayers applies to it "
          "(mlp_output where no norm follows the MLP)"),
    Value("mlp_output", "mlp", STREAM_DIMS, 21, "what the MLP adds to the stream", "added"),
    Value("layer_output", "block", STREAM_DIMS, 22, "the residual stream leaving the block", "output"),
)
BY_NAME: dict[str, Value] = {v.name: v for v in CATALOG}
OWNERS = ("block", "self_attn", "mlp")


def values_of(owner: str) -> tuple[Value, ...]:
    return tuple(v for v in CATALOG if v.owner == owner)


def _named(residual: tuple[str | None, ...]) -> tuple[str, ...]:
    return tuple(v.name for v in CATALOG if v.residual in residual)


# The residual stream itself, and what the sublayers add to it (the logit lens reads either).
STREAM, ADDED = _named(("input", "mid", "output")), _named(("added",))
# The terms of the residual identity: the stream entering the block, what is added, the stream leaving it.
IDENTITY_TERMS = _named(("input", "added", "output"))
# Values a block has only where its family has what computes them (a query or key norm, a router, a norm after a
# sublayer, an activation module): a family spec places them where it has; the block spec gives every other block
# the default (``families.base.Block``: unavailable with the reason, or the same place as the value they equal there)
QK_NORM_VALUES = ("query_norm_input", "query_norm_output", "key_norm_input", "key_norm_output")
WHERE_PRESENT = (*QK_NORM_VALUES,
                 "attention_output_before_norm", "router_logits", "mlp_pre_activation", "mlp_up_output",
                 "mlp_output_before_norm")
# Values inside the attention computation: read inside the model's eager attention when they are on.
ATTENTION_INTERNALS = ("queries", "keys", "values", "attention_scores", "attention_probabilities")
# The values of a block's attention: unavailable together on a hybrid's blocks that mix tokens otherwise.
ATTENTION_VALUES = tuple(v.name for v in values_of("self_attn"))


# TransformerLens's vocabulary, declared here once (the hook points, the cache keys, the dictionaries' sites and the
# graphs' transcoder hooks read it): its hook names (``blocks.i.<name>``, with or without ``hook_``) -> the nearest
# standard value, for suggestions. ``hook_post`` is what the down projection sums (after a gated MLP's product); ``hook_mlp_in`` is a
# copy of ``resid_mid``. Three are near, not equal: ``hook_normalized`` is before the norm's weight and bias, and
# ``hook_q``/``hook_k`` before rotary embeddings (``nnterp.dictionaries`` refuses those as sites, with the reason).
TRANSFORMERLENS_NAMES: dict[str, str] = {
    "resid_pre": "layer_input", "ln1.hook_normalized": "attention_norm_output", "attn.hook_q": "queries",
    "attn.hook_k": "keys", "attn.hook_v": "values", "attn.hook_attn_scores": "attention_scores",
    "attn.hook_pattern": "attention_probabilities", "attn.hook_z": "attention_premix", "attn_out": "attention_output",
    "resid_mid": "layer_mid", "ln2.hook_normalized": "mlp_norm_output", "mlp_in": "layer_mid",
    "mlp.hook_post": "mlp_neurons", "mlp_out": "mlp_output", "resid_post": "layer_output",
    "attn.hook_rot_q": "queries", "attn.hook_rot_k": "keys",
}
# ... and those whose TransformerLens value no standard value holds: computed from the live values of the pass
# (``nnterp.tools.hook_points`` serves them, read-only where computed), each with how TransformerLens defines it.
# ``hook_q`` and ``hook_k`` are the queries and keys themselves on a family without rotary embeddings.
TRANSFORMERLENS_COMPUTED: dict[str, str] = {
    "ln1.hook_scale": "the attention norm's scale, sqrt(mean(x^2) + eps) of its (centred) input, [batch, seq, 1]",
    "ln2.hook_scale": "the MLP norm's scale, sqrt(mean(x^2) + eps) of its (centred) input, [batch, seq, 1]",
    "ln1.hook_normalized": "the attention norm's input, centred where it centres, divided by its scale: before the "
                           "norm's weight and bias",
    "ln2.hook_normalized": "the MLP norm's input, centred where it centres, divided by its scale: before the norm's "
                           "weight and bias",
    "attn.hook_q": "the queries before the rotary embedding (the query projection's output, per head)",
    "attn.hook_k": "the keys before the rotary embedding (the key projection's output, per key-value head)",
    "attn.hook_result": "each head's output through its columns of the output projection, without its bias, "
                        "[batch, seq, heads, hidden_size]",
    "mlp.hook_pre": "the input of the MLP's activation function (the gate projection's output on a gated MLP)",
    "mlp.hook_pre_linear": "a gated MLP's up projection output, which multiplies the activation",
    "hook_q_input": "the stream entering the block, one copy per query head, [batch, seq, heads, hidden_size], after "
                    "model.set_use_split_qkv_input(True): an edit of a head's copy changes that head's queries",
    "hook_k_input": "the stream entering the block, one copy per key-value head, after "
                    "model.set_use_split_qkv_input(True): an edit of a head's copy changes that head's keys",
    "hook_v_input": "the stream entering the block, one copy per key-value head, after "
                    "model.set_use_split_qkv_input(True): an edit of a head's copy changes that head's values",
}


# TransformerLens's hook points of the model, outside the blocks, in forward order (embeddings first, readout last)
TRANSFORMERLENS_MODEL_HOOKS = ("hook_embed", "hook_pos_embed", "ln_final.hook_scale", "ln_final.hook_normalized",
                               "unembed.hook_in", "unembed.hook_out")
# TransformerBridge's names of a block's input and output (``get_act_name("in", 5)``: ``blocks.5.hook_in``)
TRANSFORMERLENS_BRIDGE_ALIASES = {"hook_in": "hook_resid_pre", "hook_out": "hook_resid_post"}
# TransformerLens's block norms, by the standard value each one's output is (``ln1`` before the attention)
TRANSFORMERLENS_NORMS: dict[str, str] = {key.partition(".")[0]: standard for key, standard
                                         in TRANSFORMERLENS_NAMES.items() if key.endswith(".hook_normalized")}


def transformerlens_tail(key: str) -> str:
    """A key of the tables above as the end of a block's hook name: ``"resid_pre"`` -> ``"hook_resid_pre"``,
    ``"attn.hook_z"`` as it is."""
    return key if "." in key or key.startswith("hook_") else f"hook_{key}"


def transformerlens_spellings(key: str) -> tuple[str, ...]:
    """The ways a block's hook name is written, by its key in the tables above: ``"attn.hook_pattern"`` is also
    ``"pattern"`` and ``"hook_pattern"``; ``"resid_pre"`` is also ``"hook_resid_pre"``."""
    short = key.rpartition(".")[2].removeprefix("hook_")
    return tuple(dict.fromkeys((key, transformerlens_tail(key), short, f"hook_{short}")))


def transformerlens_value(name: str) -> str | None:
    """The standard value a TransformerLens hook name means (``"blocks.5.hook_resid_post"``, ``"resid_post"``,
    ``"attn.hook_pattern"``, ``"pattern"``), or None."""
    tail = name.split(".", 2)[2] if name.startswith("blocks.") and name.count(".") >= 2 else name
    for hook, standard in TRANSFORMERLENS_NAMES.items():
        if tail in transformerlens_spellings(hook):
            return standard
    return None



def suggestion(name: str) -> Value | None:
    """The standard value a mistyped or TransformerLens name most likely means, or None."""
    standard = transformerlens_value(name)
    if standard is None:
        close = difflib.get_close_matches(name.rpartition(".")[2], BY_NAME, n=1, cutoff=0.75)
        standard = close[0] if close else None
    return BY_NAME.get(standard) if standard else None


def value_named(value: str) -> Value:
    """``"mlp.mlp_output"`` or ``"mlp_output"``: the catalog entry; a clear error for an unknown value."""
    name = value.rpartition(".")[2]
    if name not in BY_NAME:
        guess = suggestion(value)
        hint = f"Did you mean {guess.name!r} ({guess.meaning})? " if guess else ""
        raise ValueError(f"Unknown standard value {value!r}. {hint}The values are: {', '.join(BY_NAME)}.")
    return BY_NAME[name]
