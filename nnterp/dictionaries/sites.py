"""Where a dictionary reads: producers' names of sites (TransformerLens's hook names as SAELens gives them,
sparsify's module paths, dictionary_learning's submodule names) translated to ``(layer, standard value)`` by one
table (``SITE_TABLE``, printed by ``site_table()``)."""

from __future__ import annotations

import re

from ..spec.catalog import ATTENTION_INTERNALS, TRANSFORMERLENS_COMPUTED, TRANSFORMERLENS_NAMES, transformerlens_tail

Site = tuple[int, str]

# TransformerLens's hook names no standard value holds on every family, with the reason (a dictionary's site can be
# given); the names themselves and what each records are the catalog's (TRANSFORMERLENS_NAMES, _COMPUTED)
TL_REFUSED: dict[str, str] = {
    "ln1.hook_normalized": "TransformerLens records it before the norm's weight and bias (x / scale), where the "
                           "model's norm output (attention_norm_output) has them",
    "ln2.hook_normalized": "TransformerLens records it before the norm's weight and bias (x / scale), where the "
                           "model's norm output (mlp_norm_output) has them",
    "attn.hook_q": "TransformerLens records the queries before the rotary embedding, nnterp's queries after it",
    "attn.hook_k": "TransformerLens records the keys before the rotary embedding, nnterp's keys after it",
    "attn.hook_v": "nnterp reads the values inside the attention computation, where it splices no dictionary",
    "attn.hook_attn_scores": "the attention scores are no vector per token",
    "attn.hook_pattern": "the attention pattern is no vector per token",
}
SPARSIFY_SUBMODULES: dict[str, str] = {
    "": "layer_output", "mlp": "mlp_output", "ffn": "mlp_output", "feed_forward": "mlp_output",
    "block_sparse_moe": "mlp_output", "self_attn": "attention_output", "attn": "attention_output",
    "attention": "attention_output", "self_attention": "attention_output",
}
# dictionary_learning's configs name the submodule freely; these are the names its releases and demos use
DICTIONARY_LEARNING_NAMES: dict[str, str] = {
    "resid_post": "layer_output", "resid_out": "layer_output", "resid_pre": "layer_input",
    "mlp_out": "mlp_output", "attn_out": "attention_output",
}


# the hooks a dictionary is placed at: TransformerLens records there the very tensor the standard value is (the
# catalog's table maps each of its names to the nearest standard value, for suggestions; a name it gains is a site
# only once it is checked to hold the same tensor and added here)
TL_SITES = ("resid_pre", "attn.hook_z", "attn_out", "resid_mid", "mlp_in", "mlp.hook_post", "mlp_out", "resid_post")


def _transformerlens_hooks() -> dict[str, str]:
    """``blocks.i.<tail>`` tail -> standard value, for the hooks a dictionary is placed at (``TL_SITES``), from the
    catalog's table."""
    return {transformerlens_tail(key): standard for key, standard in TRANSFORMERLENS_NAMES.items() if key in TL_SITES}


def transformerlens_site(hook: str) -> tuple[Site | None, str | None]:
    """``"blocks.5.hook_resid_post"`` -> ``((5, "layer_output"), None)``; ``(None, reason)`` for a name with no
    standard value."""
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", hook or "")
    if match is None:
        return None, f"the TransformerLens hook {hook!r} is not a value of a block (blocks.<layer>.<hook>)"
    layer, tail = int(match.group(1)), match.group(2)
    if tail in TL_REFUSED:
        return None, f"{hook} has no standard value: {TL_REFUSED[tail]}"
    standard = _transformerlens_hooks().get(tail)
    if standard is None:
        nearest = {transformerlens_tail(key): value for key, value in TRANSFORMERLENS_NAMES.items()}.get(tail)
        computed = TRANSFORMERLENS_COMPUTED.get(tail)
        if nearest in ATTENTION_INTERNALS:
            return None, (f"{hook} is {nearest}, which nnterp reads inside the attention computation, where it "
                          "splices no dictionary")
        if nearest is not None:
            return None, (f"{hook} is not a site nnterp places a dictionary at: its nearest standard value, {nearest}, "
                          "is not known to hold the tensor TransformerLens records there")
        if computed is not None:
            return None, f"{hook} has no standard value: it is {computed}, computed from the pass"
        return None, f"the TransformerLens hook {hook!r} has no standard value in nnterp's table (site_table())"
    return (layer, standard), None


def transformerlens_hook(layer: int, value: str) -> str | None:
    """The TransformerLens hook name of ``layers[layer].value`` (``(5, "layer_output")`` ->
    ``"blocks.5.hook_resid_post"``), the first in the table that reads it; None where no hook name does."""
    for tail, standard in _transformerlens_hooks().items():
        if standard == value:
            return f"blocks.{layer}.{tail}"
    return None


def sparsify_site(hookpoint: str, transcode: bool) -> tuple[Site | None, Site | None, str | None]:
    """sparsify's hookpoint (a module path of the base model, ``layers.5`` or ``layers.5.mlp``) ->
    ``(site, out_site, reason)``. A transcoder reads the module's input and predicts its output."""
    match = re.fullmatch(r"(?:\w+\.)*?(?:layers|h|blocks|layer)\.(\d+)(?:\.(\w+))?", hookpoint)
    if match is None:
        return None, None, f"sparsify's hookpoint {hookpoint!r} is not a block or a sublayer of one"
    layer, sub = int(match.group(1)), match.group(2) or ""
    standard = SPARSIFY_SUBMODULES.get(sub)
    if standard is None:
        return None, None, f"sparsify's hookpoint {hookpoint!r} reads module {sub!r}, which is no block, MLP or attention"
    if not transcode:
        return (layer, standard), None, None
    inputs = {"layer_output": "layer_input", "mlp_output": "mlp_input"}
    if standard not in inputs:
        return None, None, f"a transcoder at {hookpoint!r} reads the attention's input, which is no standard value"
    return (layer, inputs[standard]), (layer, standard), None


def dictionary_learning_site(names: list[str], layer: int | None, io: str) -> tuple[Site | None, str | None]:
    """The site a dictionary_learning dictionary names (its ``submodule_name``, or its folders, e.g.
    ``resid_out_layer3``), or ``(None, reason)``."""
    for name in names:
        match = re.search(r"(resid_post|resid_out|resid_pre|mlp_out|attn_out)_?layer_?(\d+)", name or "")
        if match:
            if io != "out":
                return None, f"the dictionary read the {io!r} side of {match.group(0)}, which nnterp cannot name"
            return (int(match.group(2)), DICTIONARY_LEARNING_NAMES[match.group(1)]), None
    shown = ", ".join(repr(n) for n in names if n) or "none"
    return None, (f"dictionary_learning records the layer ({layer}) but not which submodule the dictionary read "
                  f"(names seen: {shown})")


SITE_TABLE: list[tuple[str, str, str, str]] = [
    *(("SAELens (TransformerLens)", f"blocks.N.{tail}", f"(N, {standard!r})",
       "TransformerLens copies resid_mid there for ln2 alone: a dictionary there gives its output to the MLP's norm, the "
       "stream kept (unavailable on a parallel block)"
       if tail == "hook_mlp_in" else "unavailable on a parallel block" if standard == "layer_mid" else
       "viewed as [batch, seq, heads * head_dim] (reshape_activations='hook_z')" if tail == "attn.hook_z" else "")
      for tail, standard in _transformerlens_hooks().items() if tail not in TL_REFUSED),
    *(("SAELens (TransformerLens)", f"blocks.N.{tail}", "refused", reason) for tail, reason in TL_REFUSED.items()),
    *(("sparsify", "`, `".join(f"layers.N{'.' + sub if sub else ''}" for sub, value in SPARSIFY_SUBMODULES.items()
                                if value == standard), f"(N, {standard!r})",
       "the block list may be named h, blocks or layer; checked on the model: the module's output is the value"
       + {"layer_output": "; a transcoder reads the block's input (layer_input)",
          "mlp_output": "; a transcoder reads the MLP's input (mlp_input)"}.get(standard, ""))
      for standard in dict.fromkeys(SPARSIFY_SUBMODULES.values())),
    *(("dictionary_learning", f"{name}_layerN", f"(N, {standard!r})", "from submodule_name or the folder's name")
      for name, standard in DICTIONARY_LEARNING_NAMES.items()),
]


def site_table() -> str:
    """The translation of producers' site names to standard values, as a Markdown table."""
    parts = []
    for producer in dict.fromkeys(row[0] for row in SITE_TABLE):  # one table per producer, in the table's order
        rows = [f"**{producer}**", "", "| name | site | note |", "|---|---|---|"]
        rows += [f"| `{name}` | {site if site == 'refused' else f'`{site}`'} | {note} |"
                 for who, name, site, note in SITE_TABLE if who == producer]
        parts.append("\n".join(rows))
    return "\n\n".join(parts)
