"""nnterp 1.x names on ``StandardizedTransformer``, kept working: each warns once per call site with a
``DeprecationWarning`` naming the new spelling.

The core does not import this module: ``nnterp/__init__.py`` installs it onto the class. The 1.x
module paths (``nnterp.nnsight_utils``, ``nnterp.rename_utils``, ``nnterp.utils``, ``nnterp.display``,
``nnterp.prompt_utils``, the 1.x names in ``nnterp.interventions``) build on it. Where 1.x was wrong,
the correct value is kept (``docs/migrating.md`` lists the differences).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from .edits import skip_layers as _skip_layers


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is nnterp 1.x's spelling: use {new}.", DeprecationWarning, stacklevel=stacklevel)


class ValueList:
    """One standard value across the blocks, indexed by layer (1.x ``layers_output[i]``): read, assign, iterate."""

    def __init__(self, model, name: str):
        self._model, self._name = model, name

    def __len__(self) -> int:
        return self._model.num_layers

    def __getitem__(self, layer: int):
        return self._model.read_value(layer, self._name)

    def __setitem__(self, layer: int, value) -> None:
        self._model.write_value(layer, self._name, value)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class AttentionProbabilities(ValueList):
    """1.x ``model.attention_probabilities[i]``: the standard ``attention_probabilities``, with 1.x's switches."""

    def __init__(self, model):
        ValueList.__init__(self, model, "attention_probabilities")

    @property
    def enabled(self) -> bool:
        return self._model._nnterp_attention_on

    def enable(self) -> None:
        self._model.enable_attention_values()

    def disable(self) -> None:
        self._model.disable_attention_values()

    def print_source(self, layer: int = 0, allow_dispatch: bool = True) -> None:
        """Where the probabilities are read (1.x printed the hooked source)."""
        print(self._model.availability(layer)["self_attn.attention_probabilities"])

    def check_source(self, *args, **kwargs) -> None:
        """1.x checked its hook by hand; the location is proven at load on a miniature of the config."""


class ModuleList:
    """1.x ``attentions[i]`` / ``mlps[i]``: the sublayer envoys by layer."""

    def __init__(self, model, owner: str):
        self._model, self._owner = model, owner

    def __len__(self) -> int:
        return self._model.num_layers

    def __getitem__(self, layer: int):
        return getattr(self._model.layers[layer], self._owner)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class AttentionInputs(ModuleList):
    """1.x ``attentions_input[i]``: what the attention module is called with (its hidden states)."""

    def __init__(self, model):
        ModuleList.__init__(self, model, "self_attn")

    def __getitem__(self, layer: int):
        return ModuleList.__getitem__(self, layer).input

    def __setitem__(self, layer: int, value) -> None:
        ModuleList.__getitem__(self, layer).input = value


LEGACY_VALUE_LISTS = {"layers_input": "layer_input", "layers_output": "layer_output",
                      "attentions_output": "attention_output", "mlps_input": "mlp_input", "mlps_output": "mlp_output"}


def _value_list(old: str, name: str) -> property:
    def get(self):
        deprecated(f"model.{old}[i]", f"model.layers[i].{'self_attn.' if 'attention' in name else ''}"
                                      f"{'mlp.' if name == 'mlp_output' else ''}{name}")
        return ValueList(self, name)
    return property(get, doc=f"1.x name: ``{old}[i]`` is the standard ``{name}``.")


def _attention_probabilities(self):
    deprecated("model.attention_probabilities[i]", "model.layers[i].self_attn.attention_probabilities")
    return AttentionProbabilities(self)


def _attentions(self):
    deprecated("model.attentions[i]", "model.layers[i].self_attn")
    return ModuleList(self, "self_attn")


def _mlps(self):
    deprecated("model.mlps[i]", "model.layers[i].mlp")
    return ModuleList(self, "mlp")


def _attentions_input(self):
    deprecated("model.attentions_input[i]", "model.layers[i].self_attn.input (or attention_norm_output)")
    return AttentionInputs(self)


def _token_embeddings_get(self):
    deprecated("model.token_embeddings", "model.embed_tokens.output")
    return self.embed_tokens.output


def _token_embeddings_set(self, value):
    deprecated("model.token_embeddings", "model.embed_tokens.output")
    self.embed_tokens.output = value


def _input_ids(self):
    deprecated("model.input_ids", "model.inputs[1]['input_ids']")
    return self.inputs[1]["input_ids"]


def _attention_mask(self):
    deprecated("model.attention_mask", "model.inputs[1]['attention_mask']")
    return self.inputs[1]["attention_mask"]


def _input_size(self):
    deprecated("model.input_size", "model.inputs[1]['input_ids'].shape")
    return self.inputs[1]["input_ids"].shape


def _attn_probs_available(self) -> bool:
    deprecated("model.attn_probs_available", "model.availability(i)['self_attn.attention_probabilities']")
    return self._nnterp_attention_on


def _add_prefix_false_tokenizer(self):
    """The tokenizer without a prefix space (1.x used it for first tokens); the model's own one otherwise."""
    deprecated("model.add_prefix_false_tokenizer", "nnterp.first_tokens(model.tokenizer, word)")
    from transformers import AutoTokenizer

    cached = self.__dict__.get("_nnterp_no_prefix_tokenizer")
    if cached is None:
        try:
            cached = AutoTokenizer.from_pretrained(self.tokenizer.name_or_path, add_prefix_space=False)
        except (OSError, ValueError, TypeError):
            cached = self.tokenizer
        self.__dict__["_nnterp_no_prefix_tokenizer"] = cached
    return cached


def get_topk_closest_tokens(self, hidden_state: torch.Tensor, k: int = 5) -> dict[str, float] | list[dict[str, float]]:
    """The ``k`` most likely tokens of a stream vector (``[hidden]`` or ``[batch, hidden]``) through the readout."""
    deprecated("model.get_topk_closest_tokens(h)", "nnterp.top_tokens(model, model.project_on_vocab(h).softmax(-1))")
    if hidden_state.shape[-1] != self.hidden_size:
        raise ValueError(f"Hidden state shape {tuple(hidden_state.shape)} does not match model hidden size "
                         f"{self.hidden_size}.")
    probs = self.project_on_vocab(hidden_state).softmax(-1)
    top = probs.topk(k, dim=-1)
    if probs.dim() == 1:
        return self.probs_to_dict(top.indices, top.values)
    return [self.probs_to_dict(indices, values) for indices, values in zip(top.indices, top.values)]


def probs_to_dict(self, tokens: torch.Tensor, probs: torch.Tensor) -> dict[str, float]:
    return {token: float(p) for token, p in zip(self.tokenizer.convert_ids_to_tokens(tokens), probs)}


def detect_layer_output_type(self) -> None:
    """1.x needed this before skipping layers; the family spec knows each block's output type."""


def steer(self, layers, steering_vector: torch.Tensor, factor: float = 1.0, positions=None, token_positions=None,
          batch_index=None, value: str = "layer_output") -> None:
    """Inside a trace: add ``factor * steering_vector`` to ``value`` at ``layers`` (``positions`` is 1.x's name)."""
    deprecated("model.steer(layers, vector, factor, token_positions, batch_index)",
               "nnterp.add_to(model, layers, vector, value, factor, positions, batch)")
    if positions is not None:
        deprecated("steer(positions=...)", "steer(token_positions=...) or nnterp.add_to(..., positions=...)")
        if token_positions is not None:
            raise ValueError("Pass token_positions only (positions is its deprecated 1.x name).")
        token_positions = positions
    from .edits import add_to

    add_to(self, layers, steering_vector, value, factor, token_positions, batch_index)


def skip_layers(self, start: int, end: int | None = None, skip_with: torch.Tensor | None = None,
                layer_returns_tuple: bool | None = None) -> None:
    """Inside a trace: blocks ``start`` to ``end`` (inclusive) hand on ``skip_with`` (default: block ``start``'s input)."""
    deprecated("model.skip_layers(start, end, skip_with)", "nnterp.skip_layers(model, start, end, stream)")
    _skip_layers(self, start, end, skip_with)


def skip_layer(self, layer: int, skip_with: torch.Tensor | None = None) -> None:
    deprecated("model.skip_layer(layer, skip_with)", "nnterp.skip_layers(model, layer, layer, stream)")
    _skip_layers(self, layer, layer, skip_with)


# 1.x constructor options: what each becomes, or why it is refused
UNSUPPORTED_OPTIONS = {
    "rename_config": "a RenameConfig",
    "attn_rename": "attn_rename",
    "rename": "a rename dict",
}


def translate_options(kwargs: dict) -> dict:
    """1.x ``StandardizedTransformer`` options, in today's terms (a warning names each new spelling)."""
    kwargs = dict(kwargs)
    if "enable_attention_probs" in kwargs:
        deprecated("enable_attention_probs=", "attention_values=", stacklevel=4)
        kwargs["attention_values"] = kwargs.pop("enable_attention_probs")
    if "check_renaming" in kwargs:
        deprecated("check_renaming=", "validate= (the spec is proven on a miniature of the config)", stacklevel=4)
        kwargs["validate"] = kwargs.pop("check_renaming")
    if "allow_dispatch" in kwargs:
        deprecated("allow_dispatch=", "dispatch= (validation never loads the weights)", stacklevel=4)
        kwargs.pop("allow_dispatch")
    if kwargs.pop("remote", False):
        deprecated("StandardizedTransformer(..., remote=True)", "dispatch=False, then trace(..., remote=True)",
                   stacklevel=4)
        kwargs["dispatch"] = False
    for option in ("check_attn_probs_with_trace", "allow_multimodal"):
        if option in kwargs:
            deprecated(f"{option}=", "nothing (it has no effect)", stacklevel=4)
            kwargs.pop(option)
    tokenizer_kwargs = kwargs.pop("tokenizer_kwargs", None)
    if tokenizer_kwargs:
        deprecated("tokenizer_kwargs=", "tokenizer=AutoTokenizer.from_pretrained(name, **kwargs)", stacklevel=4)
        if kwargs.get("tokenizer") is None and isinstance(kwargs.get("model"), (str, os.PathLike)):
            from transformers import AutoTokenizer

            kwargs["tokenizer"] = AutoTokenizer.from_pretrained(kwargs["model"], **tokenizer_kwargs)
    for option, what in UNSUPPORTED_OPTIONS.items():
        if kwargs.get(option) is not None:
            raise TypeError(
                f"StandardizedTransformer no longer takes {what} ({option}=): modules are placed by a family spec, "
                "proven on a miniature of the config. Load a covered family, or add a spec for your architecture "
                "(docs: Migrating from 1.x)."
            )
        kwargs.pop(option, None)
    return kwargs


def install(cls) -> None:
    """Put the 1.x names on the model class (called by ``nnterp/__init__.py``)."""
    for old, name in LEGACY_VALUE_LISTS.items():
        setattr(cls, old, _value_list(old, name))
    properties = {
        "attention_probabilities": property(_attention_probabilities),
        "attentions": property(_attentions),
        "mlps": property(_mlps),
        "attentions_input": property(_attentions_input),
        "token_embeddings": property(_token_embeddings_get, _token_embeddings_set),
        "input_ids": property(_input_ids),
        "attention_mask": property(_attention_mask),
        "input_size": property(_input_size),
        "attn_probs_available": property(_attn_probs_available),
        "add_prefix_false_tokenizer": property(_add_prefix_false_tokenizer),
    }
    for name, value in properties.items():
        setattr(cls, name, value)
    for function in (get_topk_closest_tokens, probs_to_dict, detect_layer_output_type, steer, skip_layers,
                     skip_layer):
        setattr(cls, function.__name__, function)
    init = cls.__init__
    if not getattr(init, "_nnterp_legacy", False):
        @functools.wraps(init)
        def __init__(self, model, tokenizer=None, **kwargs):  # noqa: N807
            padding_side = (kwargs.get("tokenizer_kwargs") or {}).get("padding_side")
            kwargs = translate_options({"model": model, "tokenizer": tokenizer, **kwargs})
            init(self, kwargs.pop("model"), kwargs.pop("tokenizer"), **kwargs)
            if padding_side:  # nnsight sets left padding on the tokenizer it is given; 1.x's option wins
                self.tokenizer.padding_side = padding_side

        __init__._nnterp_legacy = True
        cls.__init__ = __init__
