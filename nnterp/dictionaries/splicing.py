"""Splicing a dictionary into a trace, and the tools on top: a feature's top-activating tokens.

nnsight runs a trace's body while the model waits at the value last read, so an edit reaches the model only
if it is made before the body asks for anything later. A splice makes that window explicit::

    with model.trace(prompt):
        with nnterp.splice(model, sae) as features:   # the site's value, encoded
            features[..., 7] = 0                       # edits in place (or splice.features = new)
        logits = nnsight.save(model.logits)            # the model went on with decode(features) + error

On entering, the splice reads the dictionary's site and encodes it; on leaving, it writes
``decode(features) + error`` back, where ``error = value - decode(original features)``. It is computed as
``value + decode(features) - decode(original features)``, so an unedited splice changes nothing, bit for bit,
and an edit adds exactly what it changes in the decoder's output. ``splice.error`` is editable inside the block too
(the model then goes on with ``decode(features) + error`` as edited: zeroed, the reconstruction alone). A vector the dictionary cannot encode (a zero
vector it normalizes, as at a left-padded batch's pad positions) keeps its value, its features zero. Reading a
later value of the model inside the ``with`` block moves the model past the site, where the edit can no longer
go: refused when the block ends.
Several dictionaries splice in one pass one ``with`` block after another, in forward order. A transcoder reads
its input site and writes its output site (the MLP it stands for replaced by its features, the error kept).
The splice reads and writes through ``model.read_value`` and ``model.write_value`` and ships the dictionary's
tensors with the request, so it runs with ``remote=True`` too.
"""

from __future__ import annotations

from collections.abc import Sequence

import nnsight
import torch
from nnsight.intervention.interleaver import Mediator

from ..core.refusals import refuse_unsupported
from ..core.tokens import visible
from ..spec.catalog import BY_NAME
from ..spec.errors import ValueUnavailable
from ..spec.locations import At, envoy_at
from . import Dictionary, DictionaryError


def splice(model, dictionary: Dictionary, *, keep_error: bool = True) -> Splice:
    """Inside a trace: ``with splice(model, dictionary) as features:`` gives the live feature activations at the
    dictionary's site; when the block ends the model goes on with ``decode(features) + error``, so edits of the
    features (in place, or ``splice.features = ...``) reach it. ``keep_error=False`` drops the error: the model
    goes on with the reconstruction alone. After the block, ``.error`` and ``.reconstruction`` are readable. Where
    the dictionary cannot encode the value (``.unencoded``: a zero vector it normalizes, a non-finite result), the
    features are zero and the model goes on with the value as it was."""
    refuse_unsupported(model, "splice")
    return Splice(model, dictionary, keep_error)


class Splice:
    """One dictionary spliced at its site in one forward pass (see ``splice``). A context manager, entered once."""

    def __init__(self, model, dictionary: Dictionary, keep_error: bool = True):
        if not isinstance(dictionary, Dictionary):
            raise TypeError(f"splice(model, dictionary): a Dictionary (nnterp.load_dictionary), not "
                            f"{type(dictionary).__name__}.")
        self.model, self.dictionary, self.keep_error = model, dictionary, keep_error
        self.site = place(model, dictionary, "site")
        self.out_site = place(model, dictionary, "out_site") if dictionary.transcoder else None
        self._copy_into = None if self.out_site else mlp_in_copy(model, dictionary, self.site)
        if self.out_site is not None and _rank(model, self.out_site) <= _rank(model, self.site):
            raise DictionaryError(f"The transcoder reads layers[{self.site[0]}].{self.site[1]} and writes "
                                  f"layers[{self.out_site[0]}].{self.out_site[1]}, which the model computes before it.")
        self.features = None
        self._error = self._error_read = None  # the error, once read inside the block (editable there)
        self._written = None
        self._state = "new"

    def __enter__(self) -> torch.Tensor:
        if self._state != "new":
            raise DictionaryError("A splice is entered once: call nnterp.splice(model, dictionary) again for another.")
        _position("nnterp.splice")  # inside a trace, said as such
        self._state = "open"
        layer, value = self.site
        live = self.model.read_value(layer, value)
        flat = flatten_heads(live, self.dictionary.d_in, self.site)
        # of the live value: gradients reach the features
        features, self._scale, self._encoded = self.dictionary._encode(flat)
        self._input = flat.detach().clone()
        self._original = features.detach().clone()
        self._live, self._mark = live, _position("nnterp.splice")
        self.features = features
        return features

    def __exit__(self, error_type, error, traceback) -> bool:
        if error_type is not None:
            self._state = "failed"
            return False
        if _position("nnterp.splice") != self._mark:
            self._state = "failed"
            layer, value = self.site
            raise DictionaryError(
                f"nnterp.splice: the trace read a later value of the model inside the with block, so the model "
                f"went on past layers[{layer}].{value} before the edited features could be written there. Read "
                "nothing else from the model inside the block: edit the features there, read later values after it "
                "(several dictionaries: one with block after another, in forward order).")
        dictionary = self.dictionary
        layer, value = self.out_site or self.site
        live = self.model.read_value(layer, value) if self.out_site else self._live
        target = flatten_heads(live, dictionary.d_out, (layer, value))
        features = self.features
        if not isinstance(features, torch.Tensor) or features.shape != self._original.shape:
            raise DictionaryError(f"splice.features is the features tensor {list(self._original.shape)}; it was "
                                  f"set to {getattr(features, 'shape', type(features).__name__)}.")
        error_edited = self._error is not None and not torch.equal(self._error, self._error_read)
        if error_edited and not self.keep_error:
            self._state = "failed"
            raise DictionaryError("splice.error was edited, but this splice drops the error (keep_error=False), so "
                                  "the edit would not reach the model: splice(model, dictionary) keeps it, edited.")
        if error_edited:  # the reconstruction of the features, plus the error as edited
            new = (dictionary._decode(features, self._scale) + dictionary.skip(self._input)
                   + self._error.to(dictionary.dtype)).to(target.dtype)
        elif self.keep_error:  # value + decode(features) - decode(original): no change, nothing added
            new = target + dictionary._delta(features - self._original, self._scale).to(target.dtype)
        else:
            new = (dictionary._decode(features, self._scale) + dictionary.skip(self._input)).to(target.dtype)
        # what the dictionary could not encode keeps its value: no NaN of a zero vector's norm spread by attention
        new = new.where(self._encoded.to(new.device), target)
        self._output = target.detach().clone()
        self._written = new.reshape(live.shape)
        if self._copy_into is not None:  # the MLP's norm reads what the dictionary gives; the stream is kept
            envoy_at(self.model, self._copy_into).input = self._written
        else:
            self.model.write_value(layer, value, self._written)
        self._state = "closed"
        return False

    @property
    def written(self) -> torch.Tensor:
        """What the model went on with at the site (a transcoder's: its output site), in the value's own shape
        (SAELens's ``hook_sae_output``); readable after the block."""
        self._require("closed")
        return self._written

    @property
    def unencoded(self) -> torch.Tensor:
        """Where the dictionary could not encode the site's value, ``[batch, seq]``, True there: a zero vector of a
        dictionary that normalizes its input by its norm (a left-padded batch's pad positions, where attention has
        nothing to attend to), a constant one where it normalizes by its spread, a non-finite result. The features
        there are zero, and the model goes on with the value as it was, edited or not."""
        self._require("open", "closed")
        return ~self._encoded[..., 0]

    @property
    def reconstruction(self) -> torch.Tensor:
        """The dictionary's reconstruction of the site's value from the original features (a transcoder's
        prediction of its output site), ``[..., d_out]``."""
        self._require("open", "closed")
        return self.dictionary._decode(self._original, self._scale) + self.dictionary.skip(self._input)

    @property
    def error(self) -> torch.Tensor:
        """What the reconstruction misses: the value minus ``reconstruction`` (a transcoder's: of its output
        site, readable once the block has ended). Inside the block it is editable (in place, or
        ``splice.error = new``): the model goes on with ``decode(features) + error`` as edited, so zeroing it
        drops the error where it is zeroed (all of it: ``keep_error=False``). After the block: the error the model
        went on with."""
        if self._error is not None:
            return self._error
        self._require("closed") if self.out_site else self._require("open", "closed")
        target = self._output if self.out_site else self._input
        error = target.to(self.dictionary.dtype) - self.reconstruction
        if self._state == "open":  # kept, and what it was, to tell an edit at the end of the block
            self._error, self._error_read = error, error.clone()
        return error

    @error.setter
    def error(self, new: torch.Tensor) -> None:
        if self._state != "open" or self.out_site:
            raise DictionaryError("splice.error is set inside the splice's with block, and for a dictionary whose "
                                  "site is its output (a transcoder's error is known only after its block).")
        original = self.error  # read first: what an edit is told from
        if not isinstance(new, torch.Tensor) or new.shape != original.shape:
            raise DictionaryError(f"splice.error is the error tensor {list(original.shape)}; it was set to "
                                  f"{getattr(new, 'shape', type(new).__name__)}.")
        self._error = new

    def _require(self, *states: str) -> None:
        if self._state not in states:
            when = "after its with block" if states == ("closed",) else "inside or after its with block"
            raise DictionaryError(f"This splice's value is read {when} (the splice is {self._state}).")


def place(model, dictionary: Dictionary, which: str = "site") -> tuple[int, str]:
    """The dictionary's ``site`` (or ``out_site``) on ``model``, checked: a clear error where it has no meaning."""
    site = getattr(dictionary, which)
    hook = dictionary.out_hook if which == "out_site" else dictionary.hook
    if site is None:
        fix = "site=(layer, value)" + (", out_site=(layer, value)" if dictionary.transcoder else "")
        raise DictionaryError(
            f"{dictionary!r} cannot be placed on the model: {dictionary.site_reason or 'it does not say where it reads'}"
            f". Say which standard value it was trained on: load_dictionary(path, {fix}), or set dictionary.{which}.")
    layer, value = site
    if not -model.num_layers <= layer < model.num_layers:
        raise DictionaryError(f"{dictionary!r} reads layer {layer}; the model has {model.num_layers} layers.")
    named = f" (its {dictionary.format} site {hook})" if hook else ""
    try:
        location = model.location(layer, value)
    except ValueUnavailable as error:
        raise DictionaryError(f"{dictionary!r} reads layers[{layer}].{value}{named}, which has no meaning on this "
                              f"model: {error}") from None
    module = dictionary.module_paths.get(which)
    if module is not None:
        _check_module(model, dictionary, layer, value, location, *module)
    return layer % model.num_layers, value


def mlp_in_copy(model, dictionary: Dictionary, site) -> str | None:
    """TransformerLens's ``hook_mlp_in`` is a copy of the stream (``layer_mid``) that only the MLP's norm reads: a
    dictionary trained there (its SAELens hook name) gives its output to that norm, not to the stream. The norm's
    native path, or None for any other dictionary."""
    hook = dictionary.hook
    if not (isinstance(hook, str) and hook.endswith(".hook_mlp_in") and site[1] == "layer_mid"):
        return None
    location = model.block_spec(site[0]).resolve("mlp_norm_output")
    if not (isinstance(location, At) and location.side == "output" and not location.op and not location.views):
        raise DictionaryError(f"{dictionary!r} reads {hook}, TransformerLens's copy of the stream that only the MLP's "
                              f"norm reads; on {model.family.name} the MLP's norm is no module of its own, so the copy "
                              "has no place to be written. Attach it at hook_resid_mid to splice the stream itself.")
    return model.block_path(site[0], location.path)


def _check_module(model, dictionary, layer: int, value: str, location, path: str, side: str) -> None:
    """A dictionary named by a module path (sparsify's hookpoint, relative to the base model) reads the module's
    own input or output: it is the value only where the family reads the value there, as it is."""
    hf = model._module
    prefix = hf.base_model_prefix if hf.base_model is not hf else ""
    expected = ".".join(filter(None, (prefix, path)))
    viewed = bool(location.views) or location.join
    if location.op or location.side != side or model.block_path(layer, location.path) != expected or viewed or (
            side == "output" and location.index != 0):
        raise DictionaryError(
            f"{dictionary!r} reads the {side} of module {expected} (its {dictionary.format} hookpoint {path}), taken "
            f"for layers[{layer}].{value}; on {model.family.name} that value is read at {location.describe()}, so "
            "the module's tensor has another meaning here. If you know which standard value the dictionary was "
            "trained on, give it: load_dictionary(path, site=(layer, value)).")


def _rank(model, site) -> tuple[int, int]:
    layer, value = site
    return layer, model.order(layer, aliases=True, where_present=True)[BY_NAME[value].key]


def flatten_heads(tensor: torch.Tensor, width: int, site) -> torch.Tensor:
    """A per-head value ``[..., heads, head_dim]`` as the ``[..., heads * head_dim]`` a dictionary reads there
    (SAELens's ``hook_z`` reshaping); other values as they are."""
    if tensor.shape[-1] != width and tensor.dim() == 4 and tensor.shape[-2] * tensor.shape[-1] == width:
        return tensor.flatten(-2)
    if tensor.shape[-1] != width:
        raise DictionaryError(f"layers[{site[0]}].{site[1]} has shape {list(tensor.shape)}; the dictionary reads "
                              f"vectors of {width} features there: it was trained on another model or site.")
    return tensor


def _position(what: str) -> int:
    """How far the model has run in this trace: the number of its module boundaries reached so far (the model
    waits while the trace's body runs, so this changes only when the body asks for a later value)."""
    try:
        mediator = Mediator.current(what)
    except ValueError:
        raise DictionaryError(f"{what} works inside a trace: with model.trace(...): with nnterp.splice(model, d) as "
                              "features: ...") from None
    return sum(mediator.interleaver.counts.values()) if mediator.interleaver is not None else 0


# -- tools on top ------------------------------------------------------------------------------------

def top_activations(model, dictionary: Dictionary, prompts: str | Sequence[str], feature: int, k: int = 10,
                    batch_size: int = 16, remote: bool | str = False) -> list[tuple[float, int, int, str]]:
    """The ``k`` tokens of ``prompts`` where ``feature`` is most active, most active first:
    ``(activation, prompt index, position among the prompt's own tokens, token)`` (the token shown readable)."""
    refuse_unsupported(model, "top_activations")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    layer, value = place(model, dictionary, "site")
    dictionary._feature(feature)  # a clear IndexError for a feature the dictionary does not have
    found = []
    for start in range(0, len(prompts), batch_size):
        inputs = model.tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True)
        with torch.no_grad(), model.trace(inputs, remote=remote) as tracer:
            hidden = flatten_heads(model.read_value(layer, value), dictionary.d_in, (layer, value))
            activations = nnsight.save(dictionary.encode(hidden)[..., feature].float().cpu())
            tracer.stop()
        mask = inputs.attention_mask.bool()
        own = mask.long().cumsum(dim=1) - 1  # each column's position among its prompt's own tokens
        for row, column in mask.nonzero().tolist():
            token = model.tokenizer.decode(int(inputs.input_ids[row, column]))
            found.append((float(activations[row, column]), start + row, int(own[row, column]), visible(token)))
    return sorted(found, key=lambda item: -item[0])[:k]


__all__ = ["Splice", "flatten_heads", "mlp_in_copy", "place", "splice", "top_activations"]
