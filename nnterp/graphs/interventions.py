"""Editing a graph's features while the model runs: each transcoder spliced (``nnterp.splice``) at its layer.

A feature of ``graph.active_features`` is ``(layer, pos, feature)``; ``feature_intervention`` sets it to a new
activation (0 turns it off, ``k * activation`` scales it) in the model's own forward pass: the MLP's output at that
layer and position changes by ``(new - activation) * W_dec[feature]``, everything else runs as the model does (the
error kept, the later MLPs the model's own, attention not frozen). ``feature_intervention_generate`` edits the prompt
this way and generates on from it (the edited prompt's keys and values are what the new tokens attend to).
"""

from __future__ import annotations

from collections.abc import Iterable

import nnsight
import torch
from nnsight.modeling.transformers import TransformersModel

from ..dictionaries import Dictionary
from ..dictionaries.splicing import splice
from .transcoders import TranscoderError, Transcoders


def transcoder_dictionary(model, transcoders: Transcoders, layer: int) -> Dictionary:
    """Layer ``layer``'s transcoder as a ``Dictionary`` that ``nnterp.splice`` places on ``model`` (it reads
    ``input_value`` and writes ``output_value`` of that layer). A transcoder that reads ``ln2.hook_normalized``
    (the MLP norm's output before its weight and bias) reads ``mlp_norm_output`` here, the norm's weight and bias
    folded into its encoder and skip connection (the same features, of the norm's output). Refused for a
    cross-layer transcoder: a feature writes to every later layer, which one splice per layer cannot edit."""
    if transcoders.cross_layer:
        raise TranscoderError("A cross-layer transcoder's feature writes to every later layer's MLP output: one "
                              "splice per layer cannot edit it; feature interventions take per-layer transcoders.")
    if not 0 <= layer < transcoders.n_layers:
        raise IndexError(f"Layer {layer} is out of range: the transcoders cover {transcoders.n_layers} layers.")
    W_enc, b_enc, b_dec, W_skip = (transcoders.W_enc[layer], transcoders.b_enc[layer], transcoders.b_dec[layer],
                                   transcoders.W_skip[layer])
    if transcoders.normalized_input:
        W_enc, b_enc, b_dec, W_skip = _weighted(model, layer, W_enc, b_enc, b_dec, W_skip)
    threshold = transcoders.threshold[layer]
    return Dictionary(W_enc, b_enc, transcoders.W_dec[layer], b_dec,
                      activation="relu" if threshold is None else "jumprelu", threshold=threshold, W_skip=W_skip,
                      site=(layer, transcoders.input_value), out_site=(layer, transcoders.output_value),
                      transcoder=True)


def _weighted(model, layer: int, W_enc, b_enc, b_dec, W_skip):
    """The encoder and skip connection of ``x = (y - bias) / gain`` rewritten as ones of the norm's output ``y``:
    ``x @ W_enc = y @ (W_enc / gain[:, None]) - (bias / gain) @ W_enc`` (the skip's constant goes to ``b_dec``)."""
    from ..analysis import AnalysisUnavailable
    from ..analysis.norms import _norm_form
    from .replacement import _site

    norm, _, _ = _site(model, layer, "mlp_norm_output")
    try:
        offset = _norm_form(model, norm, W_enc.new_zeros(1, 1, W_enc.shape[0]), f"block {layer}'s MLP norm")[1]
    except AnalysisUnavailable as error:
        raise TranscoderError(f"The transcoders read ln2.hook_normalized, and {str(error).partition(': ')[2]}") from None
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    gain = W_enc.new_ones(W_enc.shape[0]) if weight is None else weight.detach().to(W_enc) + offset
    if not gain.all():
        raise TranscoderError(f"Block {layer}'s MLP norm has a zero weight, so its normalized input "
                              "(ln2.hook_normalized) cannot be read off its output.")
    shift = W_enc.new_zeros(W_enc.shape[0]) if bias is None else bias.detach().to(W_enc) / gain
    b_enc = b_enc - shift @ W_enc
    if W_skip is not None:
        b_dec, W_skip = b_dec - shift @ W_skip.T, W_skip / gain
    return W_enc / gain[:, None], b_enc, b_dec, W_skip


def _plan(transcoders: Transcoders, edits, n_pos: int) -> dict[int, list[tuple[int, int, float]]]:
    """``{layer: [(pos, feature, value)]}``, checked, layers in forward order."""
    plan: dict[int, list] = {}
    for edit in edits:
        if len(edit) != 4:
            raise ValueError(f"An edit is (layer, pos, feature, new activation), e.g. (*graph.active_features[k], 0.0); "
                             f"got {edit!r}.")
        layer, pos, feature, value = (int(edit[0]), int(edit[1]), int(edit[2]), float(edit[3]))
        if not 0 <= layer < transcoders.n_layers:
            raise IndexError(f"Edit {edit!r}: the transcoders have layers 0..{transcoders.n_layers - 1}.")
        if not 0 <= feature < transcoders.width(layer):
            raise IndexError(f"Edit {edit!r}: layer {layer}'s transcoder has features 0..{transcoders.width(layer) - 1}.")
        if not 0 <= pos < n_pos:
            raise IndexError(f"Edit {edit!r}: the prompt has positions 0..{n_pos - 1}.")
        plan.setdefault(layer, []).append((pos, feature, value))
    if not plan:
        raise ValueError("feature_intervention: no edits given.")
    return dict(sorted(plan.items()))


def _ids(model, prompt) -> torch.Tensor:
    """The graph's tokens (``graph.input_tokens``) or a prompt's, as ``attribution_graph`` reads them."""
    from .graph import Graph, _input_ids

    return (prompt.input_tokens if isinstance(prompt, Graph) else _input_ids(model, prompt))[None]


def _splice_edits(model, dictionaries: dict[int, Dictionary], plan) -> None:
    """Inside a trace: each layer's transcoder spliced, its edited features set (one splice after another, in
    forward order)."""
    for layer, edits in plan.items():
        with splice(model, dictionaries[layer]) as features:
            for pos, feature, value in edits:
                features[0, pos, feature] = value


def _prepared(model, prompt, transcoders: Transcoders, edits):
    ids = _ids(model, prompt)
    plan = _plan(transcoders, edits, ids.shape[1])
    parameter = next(model._module.parameters())
    transcoders = transcoders.to(parameter.device, parameter.dtype)
    return ids.to(parameter.device), plan, {layer: transcoder_dictionary(model, transcoders, layer) for layer in plan}


def feature_intervention(model, prompt, transcoders: Transcoders,
                         edits: Iterable[tuple[int, int, int, float]], remote: bool | str = False) -> torch.Tensor:
    """The model's logits ``[n_pos, vocab]`` on ``prompt`` (a graph: its tokens; a string or ids: tokenized as
    ``attribution_graph`` does, so the positions are the graph's) with each edit ``(layer, pos, feature, value)``
    setting that transcoder feature's activation to ``value`` (0: off; ``k * activation``: scaled). A trace: it runs
    with ``remote=True`` too (the transcoders travel with the request)."""
    ids, plan, dictionaries = _prepared(model, prompt, transcoders, edits)
    with torch.no_grad(), model.trace(ids, remote=remote):
        _splice_edits(model, dictionaries, plan)
        logits = nnsight.save(model.logits[0])
    return logits


def feature_intervention_generate(model, prompt, transcoders: Transcoders,
                                  edits: Iterable[tuple[int, int, int, float]], max_new_tokens: int = 10,
                                  remote: bool | str = False, **generate_kwargs) -> torch.Tensor:
    """Greedy generation (unless ``generate_kwargs`` say otherwise) from ``prompt`` with ``feature_intervention``'s
    edits made on the prompt's forward pass: the token ids ``[n_pos + max_new_tokens]``, prompt included."""
    ids, plan, dictionaries = _prepared(model, prompt, transcoders, edits)
    generate_kwargs.setdefault("do_sample", False)
    with torch.no_grad(), TransformersModel.generate(model, ids, max_new_tokens=max_new_tokens, remote=remote,
                                                     min_new_tokens=max_new_tokens, **generate_kwargs) as tracer:
        _splice_edits(model, dictionaries, plan)  # the first step: the prompt's pass
        out = nnsight.save(tracer.result)
    return out[0]


__all__ = ["feature_intervention", "feature_intervention_generate", "transcoder_dictionary"]
