"""Dictionaries (sparse autoencoders, transcoders) read from their producers' files, keyed by standard value.

``load_dictionary(folder)`` reads the three common formats with nnterp's own reader (the producer
library is not needed): SAELens (``cfg.json`` + ``sae_weights.safetensors``), EleutherAI's sparsify
(``cfg.json`` + ``sae.safetensors``, one folder per hookpoint) and dictionary_learning (``ae.pt`` +
``config.json``). Every architecture is brought to one form: features are
``activation((x - center) @ W_enc + b_enc)`` (after the input's normalization, where the format has one),
the reconstruction is ``features @ W_dec + b_dec`` (normalization undone), plus ``x @ W_skip.T`` for a
transcoder with a skip connection. Producers' rescalings that do not change what a dictionary computes
(SAELens's top-k decoder-norm rescaling, its finetuning scale, a folded norm scaling factor) are folded
into the weights, as the producers do themselves. A ``Dictionary`` is a ``torch.nn.Module`` with the names of
SAELens's ``SAE`` (``W_enc``, ``b_dec``, ``cfg.d_sae``, ``cfg.metadata.hook_name``), and the model's
``run_with_saes`` and ``run_with_cache_with_saes`` (``nnterp.compat.transformer_lens.saes``) splice it as SAELens does.

``dictionary.site`` is ``(layer, standard value)``, translated from the producer's name by one table
(``SITE_TABLE``, printed by ``site_table()``): TransformerLens hook names (SAELens) through the catalog's
``TRANSFORMERLENS_NAMES``, sparsify's module paths, dictionary_learning's submodule names. A name whose
meaning is not a standard value's, or not on every family, says why when the dictionary is spliced in.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from ..spec import catalog
from ..spec.catalog import ATTENTION_INTERNALS, BY_NAME, PER_HEAD, TRANSFORMERLENS_NAMES, value_named
from ..spec.errors import NNterpError

Site = tuple[int, str]
ACTIVATIONS = ("relu", "jumprelu", "topk", "gated", "groupmax", "identity")
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "r_mag", "b_mag", "center", "W_skip")  # a Dictionary's


class DictionaryError(NNterpError, ValueError):
    """A dictionary that cannot be read, or cannot be used where it was asked to be; the message says why."""


# readers of dictionary folders of kinds another module defines, which that module adds here when it is imported
# (nnterp.tools.tuned_lens, imported by the package: its lens is read by its own code, and imports this module)
FOLDER_KINDS: dict[str, Callable] = {}


class Dictionary(torch.nn.Module):
    """A sparse dictionary: an encoder to features and a decoder back, and the standard value it reads.

    Built by ``load_dictionary``; ``Dictionary(W_enc, b_enc, W_dec, b_dec, ...)`` builds one from tensors
    (``W_enc`` is ``[d_in, d_sae]``, ``W_dec`` is ``[d_sae, d_out]``). ``activation`` is ``"relu"``,
    ``"jumprelu"`` (ReLU, zero where the pre-activation is at most ``threshold``), ``"topk"`` (the ``k``
    largest pre-activations of each token, through a ReLU), ``"gated"`` (``b_enc`` is the gate's bias; the
    magnitude path reads ``W_enc * exp(r_mag)`` and ``b_mag``) or ``"groupmax"`` (the largest of each of
    ``k`` groups), or ``"identity"`` (the pre-activations themselves: a tuned lens's translator,
    ``TunedLens.dictionary``). ``center`` is subtracted from the input before encoding (``center=b_dec``, the same
    tensor, is SAELens's ``apply_b_dec_to_input``), ``normalize`` is ``"none"``, ``"constant_norm_rescale"`` or
    ``"layer_norm"`` (SAELens's), undone by the decoder. ``site`` and ``out_site`` (a transcoder's output) are
    ``(layer, value)``, or None with ``site_reason`` saying why the producer's name has no standard value.

    A ``torch.nn.Module`` as SAELens's ``SAE`` is: its tensors are parameters (``parameters()``, ``state_dict()``,
    ``load_state_dict``; ``.to(device, dtype)`` converts it in place), created without gradients
    (``requires_grad_()`` to train them), and ``cfg`` says what SAELens's ``sae.cfg`` says (``d_in``, ``d_sae``,
    ``dtype``, ``device``, ``metadata.hook_name``, ``architecture()``). A dictionary read at a per-head value
    (SAELens's ``hook_z``, nnterp's ``attention_premix``) takes ``[..., heads, head_dim]`` as well as
    ``[..., heads * head_dim]``, and ``forward`` gives the shape it was given. ``use_error_term`` is what
    ``model.add_sae(dictionary)`` uses when it is not told. Its classes' methods are hand-written: it travels with a
    remote request as it is.
    """

    def __init__(self, W_enc, b_enc, W_dec, b_dec, *, activation: str = "relu", k: int | None = None,
                 threshold=None, r_mag=None, b_mag=None, center=None, W_skip=None, normalize: str = "none",
                 site: Site | None = None, out_site: Site | None = None, transcoder: bool = False,
                 hook: str | None = None, out_hook: str | None = None, site_reason: str | None = None,
                 modules: dict | None = None, format: str = "", architecture: str = "", config: dict | None = None):
        torch.nn.Module.__init__(self)
        if activation not in ACTIVATIONS:
            raise DictionaryError(f"Unknown activation {activation!r}: one of {', '.join(ACTIVATIONS)}.")
        if normalize not in NORMALIZATIONS:
            raise DictionaryError(f"Unknown input normalization {normalize!r}: one of {', '.join(NORMALIZATIONS)}.")
        if activation in ("topk", "groupmax") and not k:
            raise DictionaryError(f"A {activation} dictionary needs k, its number of active features per token.")
        if W_enc.dim() != 2 or W_dec.dim() != 2 or W_enc.shape[1] != W_dec.shape[0]:
            raise DictionaryError(f"W_enc is [d_in, d_sae] and W_dec [d_sae, d_out]: got {list(W_enc.shape)} and "
                                  f"{list(W_dec.shape)}.")
        # SAELens subtracts b_dec itself: one parameter, so an edit of b_dec (or a loaded state dict) moves both
        self.apply_b_dec_to_input = center is not None and center is b_dec
        tensors = {"W_enc": W_enc, "b_enc": b_enc, "W_dec": W_dec, "b_dec": b_dec, "threshold": threshold,
                   "r_mag": r_mag, "b_mag": b_mag, "W_skip": W_skip}
        if not self.apply_b_dec_to_input:
            tensors["center"] = center
        for name, tensor in tensors.items():
            self.register_parameter(name, None if tensor is None else
                                    torch.nn.Parameter(tensor.detach(), requires_grad=False))
        self.activation, self.k, self.normalize = activation, k, normalize
        self.transcoder = transcoder or out_site is not None
        self.site = None if site is None else _checked_site(site)
        self.out_site = None if out_site is None else _checked_site(out_site)
        self.hook, self.out_hook, self.site_reason = hook, out_hook, site_reason
        # where sparsify's module paths read, checked against the model's own spec when spliced
        self.module_paths = dict(modules or {})
        self.format, self.architecture, self.config = format, architecture, dict(config or {})
        self.use_error_term = False

    def __getattr__(self, name: str):
        if name == "center" and self.__dict__.get("apply_b_dec_to_input"):
            return torch.nn.Module.__getattr__(self, "b_dec")
        if name == "b_gate" and self.__dict__.get("activation") == "gated":  # SAELens's name of the gate's bias
            return torch.nn.Module.__getattr__(self, "b_enc")
        return torch.nn.Module.__getattr__(self, name)

    @property
    def cfg(self) -> DictionaryConfig:
        """What SAELens's ``sae.cfg`` says: ``d_in``, ``d_sae``, ``dtype``, ``device``, ``apply_b_dec_to_input``,
        ``normalize_activations``, ``reshape_activations``, ``metadata.hook_name`` (and ``hook_name`` at the top, as
        SAELens 5 spelled it), ``architecture()``, ``to_dict()``. Read-only: set ``dictionary.site`` to move it."""
        return DictionaryConfig(self)

    @property
    def hook_name(self) -> str | None:
        """The TransformerLens hook name of the site: the producer's (SAELens's ``cfg.metadata.hook_name``), or the one
        that reads the site's standard value; None where no hook name does."""
        if self.format == "saelens" and self.hook and (self.site is None or transformerlens_site(self.hook)[0]
                                                        == self.site):
            return self.hook
        return None if self.site is None else transformerlens_hook(*self.site)

    @property
    def hook_name_out(self) -> str | None:
        """A transcoder's output hook name (SAELens's ``cfg.metadata.hook_name_out``), as ``hook_name``."""
        if not self.transcoder:
            return None
        if self.format == "saelens" and self.out_hook and (self.out_site is None or
                                                            transformerlens_site(self.out_hook)[0] == self.out_site):
            return self.out_hook
        return None if self.out_site is None else transformerlens_hook(*self.out_site)

    @property
    def reads_heads(self) -> bool:
        """Whether it reads a per-head value flattened (SAELens's ``reshape_activations="hook_z"``)."""
        if self.config.get("reshape_activations") == "hook_z" or (self.hook or "").endswith("hook_z"):
            return True
        return self.site is not None and BY_NAME[self.site[1]].dims == PER_HEAD

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def __repr__(self) -> str:
        kind = "transcoder" if self.transcoder else "dictionary"
        where = f"site={self.site}" + (f", out_site={self.out_site}" if self.transcoder else "")
        named = f" ({self.hook})" if self.hook else ""
        return (f"Dictionary({self.format or 'tensors'} {self.architecture or self.activation} {kind}, d_in={self.d_in}, "
                f"d_sae={self.d_sae}" + (f", d_out={self.d_out}" if self.transcoder else "") + f", {where}{named})")

    # -- the math ---------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The features of ``x`` (``[..., d_in]``; a per-head dictionary's ``[..., heads, head_dim]`` too),
        ``[..., d_sae]``, in the dictionary's dtype; zero at the vectors it cannot encode, where the producer's math
        gives NaN or features of nothing: a zero vector of a dictionary that normalizes by the norm
        (constant_norm_rescale), a constant one (zero too) of one that normalizes by the spread (layer_norm), and any
        vector whose features are not finite."""
        return self._encode(x)[0]

    def decode(self, features: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """``features @ W_dec + b_dec``, the input's normalization undone (which needs the input ``x`` that was
        encoded, where the dictionary normalizes it), ``[..., d_out]``, or the ``[..., heads, head_dim]`` of ``x``
        where ``x`` was given so. A transcoder's skip connection is ``forward``'s."""
        if self.normalize != "none" and x is None:
            raise DictionaryError(f"This dictionary normalizes its input ({self.normalize}): decode(features, x) needs "
                                  "the input x that was encoded, to undo it.")
        decoded = self._decode(features, self._scale(self._cast(x)) if self.normalize != "none" else None)
        return decoded if x is None else self._as_given(decoded, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reconstruction of ``x`` (a transcoder's prediction of its output site, skip connection included), in
        the shape ``x`` was given (a per-head value's ``[..., heads, head_dim]``)."""
        features, scale, _ = self._encode(x)
        return self._as_given(self._decode(features, scale) + self.skip(x), x)

    def skip(self, x: torch.Tensor) -> torch.Tensor | int:
        """A transcoder's skip connection ``x @ W_skip.T`` (0 without one)."""
        return 0 if self.W_skip is None else self._cast(x) @ self._on(self.W_skip, x).T

    def _as_given(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (``[..., d]``) as the per-head ``[..., heads, head_dim]`` of ``x``, where ``x`` was given so."""
        if x.shape[-1] != self.d_in and out.shape[-1] == x.shape[-2] * x.shape[-1]:
            return out.unflatten(-1, tuple(x.shape[-2:]))
        return out

    def direction(self, feature: int, x: torch.Tensor | None = None) -> torch.Tensor:
        """What one unit of ``feature`` adds at the output site, ``decode(e_f, x) - decode(0, x)``: the decoder's row
        ``W_dec[feature]`` (``[d_out]``, the producer's rescalings folded in: a norm scaling factor, a finetuning
        scale), which ``steered_generate(model, prompts, layer, d.direction(f), value=d.site[1], factor=...)``
        steers with. A dictionary that normalizes its input and undoes it in the decoder (``normalize``, not a
        transcoder: SAELens's transcoders do not undo it) multiplies the row by each vector's own statistic, its
        norm over ``sqrt(d_in)`` (constant_norm_rescale) or its standard deviation (layer_norm): no one vector is
        what a unit adds, so ``direction(feature)`` is refused there and ``direction(feature, x)`` gives it at the
        input ``x`` (``[..., d_out]``; zero where ``x`` is a zero or constant vector)."""
        self._feature(feature)
        if self.normalize == "none" or self.transcoder:
            return self.W_dec[feature]
        if x is None:
            raise DictionaryError(
                f"This dictionary normalizes its input ({self.normalize}) and its decoder undoes it, so what one unit "
                f"of feature {feature} adds is W_dec[{feature}] times a statistic of each input vector ("
                + ("its norm / sqrt(d_in)" if self.normalize == "constant_norm_rescale" else "its standard deviation")
                + "), no one vector: direction(feature, x) gives it at the input x; to add a feature where the model "
                "runs, splice the dictionary and edit the feature (nnterp.splice); W_dec[feature] is the decoder's row.")
        x = self._cast(x)
        return self._unscale(self._on(self.W_dec, x)[feature], self._scale(x), shift=False)

    def _feature(self, feature: int) -> int:
        """``feature``, checked: a clear IndexError for a feature the dictionary does not have."""
        if not -self.d_sae <= feature < self.d_sae:
            raise IndexError(f"Feature {feature} is out of range: the dictionary has {self.d_sae} features.")
        return feature

    def _on(self, tensor, like):
        """``tensor`` on the device of ``like`` (a dictionary spliced into a model on another device, or remotely)."""
        return tensor if tensor is None or tensor.device == like.device else tensor.to(like.device)

    def _cast(self, x):
        if x is None:
            return None
        if x.shape[-1] != self.d_in and x.dim() >= 2 and x.shape[-2] * x.shape[-1] == self.d_in and self.reads_heads:
            x = x.flatten(-2)  # TransformerLens's hook_z, [..., heads, head_dim]
        if x.shape[-1] != self.d_in:
            raise DictionaryError(f"The dictionary reads vectors of {self.d_in} features; this tensor has "
                                  f"{x.shape[-1]} (shape {list(x.shape)}).")
        return x.to(self.dtype)

    def _scale(self, x):
        """What the input's normalization divides by (and subtracts), per vector: undone by the decoder."""
        if self.normalize == "constant_norm_rescale":  # SAELens: x * sqrt(d_in) / |x|
            return (x.norm(dim=-1, keepdim=True) / math.sqrt(self.d_in), None)
        if self.normalize == "layer_norm":  # SAELens: (x - mean) / (std + 1e-5), std unbiased
            mean = x.mean(dim=-1, keepdim=True)
            return (None, mean, (x - mean).std(dim=-1, keepdim=True))
        return None

    def _encode(self, x):
        """``(features, scale, encoded)``: ``encoded`` (``[..., 1]``) is False at the vectors the dictionary cannot
        encode, a zero (or, for layer_norm, constant) vector it normalizes or a non-finite result; their features
        are zero, and a splice keeps their value."""
        x, scale, encoded = self._processed(x)
        features = self._activate(x, self._pre(x))
        finite = features.isfinite().all(dim=-1, keepdim=True)
        encoded = finite if encoded is None else encoded & finite
        return features.where(encoded, 0), scale, encoded

    def _processed(self, x):
        """``(x as the encoder reads it, scale, encoded)``: normalized and centered (SAELens's ``process_sae_in``);
        ``encoded`` (None without a normalization) False where the normalization has no direction to keep."""
        x = self._cast(x)
        scale = self._scale(x)
        encoded = None
        if self.normalize != "none":  # the divisor: |x| / sqrt(d_in), or the spread; zero has no direction
            divisor = scale[0] if self.normalize == "constant_norm_rescale" else scale[2]
            encoded = divisor.isfinite() & (divisor > 0)
        if self.normalize == "constant_norm_rescale":
            x = x / divisor.where(encoded, 1)  # not 0 / 0, whose NaN would reach the gradients too
        elif self.normalize == "layer_norm":
            x = (x - scale[1]) / (scale[2] + 1e-5)
        if self.center is not None:
            x = x - self._on(self.center, x)
        return x, scale, encoded

    def _pre(self, x):
        """The pre-activations of a processed input (SAELens's ``hook_sae_acts_pre``: a gated one's magnitudes)."""
        W_enc = self._on(self.W_enc, x)
        if self.activation == "gated":
            return x @ (W_enc * self._on(self.r_mag, x).exp()) + self._on(self.b_mag, x)
        return x @ W_enc + self._on(self.b_enc, x)

    def _activate(self, x, pre):
        if self.activation == "gated":
            gate = (x @ self._on(self.W_enc, x) + self._on(self.b_enc, x)) > 0
            return gate.to(x.dtype) * torch.relu(pre)
        if self.activation == "identity":
            return pre
        if self.activation == "relu":
            return torch.relu(pre)
        if self.activation == "jumprelu":
            return torch.relu(pre) * (pre > self._on(self.threshold, x)).to(pre.dtype)
        if self.activation == "topk":
            top = pre.topk(self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, top.indices, top.values.relu())
        groups = torch.relu(pre).unflatten(-1, (self.k, -1)).max(dim=-1)  # groupmax: the largest of each group
        dense = torch.zeros_like(pre).unflatten(-1, (self.k, -1))
        return dense.scatter_(-1, groups.indices.unsqueeze(-1), groups.values.unsqueeze(-1)).flatten(-2)

    def _decode(self, features, scale):
        return self._unscale(self._recons(features), scale)

    def _recons(self, features):
        """``features @ W_dec + b_dec``, before the input's normalization is undone (SAELens's ``hook_sae_recons``)."""
        return features.to(self.dtype) @ self._on(self.W_dec, features) + self._on(self.b_dec, features)

    def _unscale(self, out, scale, shift: bool = True):
        if self.transcoder:  # its prediction is of another site: SAELens does not undo the input's normalization
            return out
        if self.normalize == "constant_norm_rescale":
            return out * scale[0]
        if self.normalize == "layer_norm":
            return out * scale[2] + (scale[1] if shift else 0)
        return out

    def _delta(self, change, scale):
        """What a change of the features changes the reconstruction by: exactly zero for no change."""
        return self._unscale(change.to(self.dtype) @ self._on(self.W_dec, change), scale, shift=False)


class DictionaryConfig:
    """A dictionary's ``cfg``, read as SAELens's ``SAEConfig`` is (``d_in``, ``d_sae``, ``dtype``, ``device``,
    ``apply_b_dec_to_input``, ``normalize_activations``, ``reshape_activations``, ``metadata``, ``architecture()``,
    ``to_dict()``), from the dictionary itself: it follows ``.to()`` and ``dictionary.site``. Read-only."""

    def __init__(self, dictionary: Dictionary):
        object.__setattr__(self, "_dictionary", dictionary)

    def __setattr__(self, name, value):
        raise AttributeError(f"A dictionary's cfg is read from the dictionary: cfg.{name} cannot be set (set "
                             "dictionary.site to move it, .to(...) to convert it).")

    @property
    def d_in(self) -> int:
        return self._dictionary.d_in

    @property
    def d_sae(self) -> int:
        return self._dictionary.d_sae

    @property
    def d_out(self) -> int:
        return self._dictionary.d_out

    @property
    def k(self) -> int | None:
        return self._dictionary.k

    @property
    def dtype(self) -> str:
        return str(self._dictionary.dtype).removeprefix("torch.")

    @property
    def device(self) -> str:
        return str(self._dictionary.device)

    @property
    def apply_b_dec_to_input(self) -> bool:
        return self._dictionary.apply_b_dec_to_input

    @property
    def normalize_activations(self) -> str:
        """SAELens's: a norm scaling factor (``expected_average_only_in``) is folded into the weights, as SAELens folds
        it, so it reads ``"none"`` then."""
        return self._dictionary.normalize

    @property
    def reshape_activations(self) -> str:
        return "hook_z" if self._dictionary.reads_heads else "none"

    @property
    def metadata(self) -> DictionaryMetadata:
        return DictionaryMetadata(self._dictionary)

    @property
    def hook_name(self) -> str | None:
        """SAELens 5's spelling of ``metadata.hook_name``."""
        return self._dictionary.hook_name

    def architecture(self) -> str:
        """SAELens's architecture name (``standard``, ``topk``, ``jumprelu``, ``gated``, a transcoder's), or the
        producer's class for another format."""
        return self._dictionary.architecture or self._dictionary.activation

    def to_dict(self) -> dict:
        names = ("d_in", "d_sae", "dtype", "device", "apply_b_dec_to_input", "normalize_activations",
                 "reshape_activations")
        found = {name: getattr(self, name) for name in names}
        if self.k:
            found["k"] = self.k
        if self._dictionary.transcoder:
            found["d_out"] = self.d_out
        return {**found, "metadata": self.metadata.to_dict(), "architecture": self.architecture()}

    def __repr__(self) -> str:
        return f"DictionaryConfig({self.to_dict()})"


class DictionaryMetadata:
    """``cfg.metadata``, as SAELens's ``SAEMetadata``: ``hook_name`` (and ``hook_name_out``), the TransformerLens hook
    name of the site; the producer's other metadata as it wrote it (``model_name``, ...); None for what it lacks."""

    def __init__(self, dictionary: Dictionary):
        saved = dictionary.config.get("metadata")
        found = dict(saved) if isinstance(saved, dict) else {}
        found.update(hook_name=dictionary.hook_name, hook_name_out=dictionary.hook_name_out)
        object.__setattr__(self, "_found", found)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._found.get(name)

    def __setattr__(self, name, value):
        raise AttributeError(f"A dictionary's cfg.metadata is read from the dictionary: {name} cannot be set.")

    def __getitem__(self, name):
        return self._found.get(name)

    def get(self, name, default=None):
        return self._found.get(name, default)

    def to_dict(self) -> dict:
        return dict(self._found)

    def __repr__(self) -> str:
        return f"DictionaryMetadata({self._found})"


def _checked_site(site) -> Site:
    try:
        layer, value = site
    except (TypeError, ValueError):
        raise DictionaryError(f"A site is (layer, standard value), e.g. (5, 'layer_output'), not {site!r}.") from None
    if not isinstance(layer, int):
        raise DictionaryError(f"A site's layer is an int, not {layer!r}.")
    return layer, value_named(value).name


# -- the site table ----------------------------------------------------------------------------------

# TransformerLens's hook names whose meaning is not the catalog's suggestion (TRANSFORMERLENS_NAMES maps a name to
# the value a user most likely means): what the hook records, from TransformerLens's own blocks.
TL_CORRECTIONS: dict[str, str] = {
    # TransformerBlock: mlp_in = hook_mlp_in(resid_mid.clone()); normalized = ln2(mlp_in): the stream before ln2
    "mlp_in": "layer_mid",
}
# ... and those no standard value holds on every family, with the reason (a dictionary's site can be given)
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


def _tail(key: str) -> str:
    """A key of the catalog's table as the tail of a block's hook name: ``resid_pre`` -> ``hook_resid_pre``."""
    return key if "." in key or key.startswith("hook_") else f"hook_{key}"


def _transformerlens_hooks() -> dict[str, str]:
    """``blocks.i.<tail>`` tail -> standard value, for the hooks a dictionary is placed at (``TL_SITES``), from the
    catalog's table with the corrections above."""
    return {_tail(key): TL_CORRECTIONS.get(key, standard) for key, standard in TRANSFORMERLENS_NAMES.items()
            if key in TL_SITES}


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
        nearest = {_tail(key): value for key, value in TRANSFORMERLENS_NAMES.items()}.get(tail)
        computed = getattr(catalog, "TRANSFORMERLENS_COMPUTED", {}).get(tail)
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


# -- reading the formats ----------------------------------------------------------------------------

def load_dictionary(name: str | os.PathLike, *, folder: str | None = None, site: Site | None = None,
                    out_site: Site | None = None, scaling_factor: float | None = None, device=None,
                    dtype: torch.dtype | None = None) -> Dictionary:
    """A dictionary from a local folder in SAELens's, sparsify's or dictionary_learning's format, or from a
    Hugging Face repository (``name`` is ``org/repo``, ``folder`` the dictionary's folder in it). A tuned lens's
    folder (tuned-lens's ``config.json`` + ``params.pt``) holds one translator per layer: ``site`` picks one,
    as ``load_tuned_lens(name).dictionary(layer, value)`` gives it.

    ``site`` (and a transcoder's ``out_site``), ``(layer, standard value)``, say where it reads where the
    producer's name does not (or overrides it). ``scaling_factor`` is SAELens's norm scaling factor of a
    dictionary saved with ``normalize_activations="expected_average_only_in"`` before it was folded (a
    checkpoint folder's ``activation_scaler.json`` gives it too). ``device`` and ``dtype`` move the tensors.
    """
    path = _local_folder(name, folder)
    if (path / "cfg.json").is_file() and (path / "sae_weights.safetensors").is_file():
        dictionary = _read_saelens(path, scaling_factor)
    elif (path / "cfg.json").is_file() and (path / "sae.safetensors").is_file():
        dictionary = _read_sparsify(path)
    elif (path / "ae.pt").is_file():
        dictionary = _read_dictionary_learning(path)
    elif (path / "params.pt").is_file() and (path / "config.json").is_file():
        return FOLDER_KINDS["tuned_lens"](path, site, out_site, device, dtype)
    else:
        inside = sorted(p.name for p in path.iterdir())[:12]
        several = [p for p in inside if (path / p / "cfg.json").is_file() or (path / p / "ae.pt").is_file()]
        hint = (f" It holds dictionaries in {', '.join(several)}: load one of them (folder=...)." if several else "")
        raise DictionaryError(
            f"{str(path)!r} holds no dictionary nnterp reads: SAELens's cfg.json + sae_weights.safetensors, "
            f"sparsify's cfg.json + sae.safetensors, dictionary_learning's ae.pt + config.json, or a tuned lens's "
            f"config.json + params.pt (it has: "
            f"{', '.join(inside) or 'nothing'}).{hint}")
    if site is not None:
        dictionary.site, dictionary.site_reason, dictionary.module_paths = _checked_site(site), None, {}
    if out_site is not None:
        dictionary.out_site, dictionary.transcoder = _checked_site(out_site), True
        dictionary.module_paths = {}
    moved = {key: value for key, value in (("device", device), ("dtype", dtype)) if value is not None}
    return dictionary.to(**moved) if moved else dictionary


def _local_folder(name, folder: str | None) -> Path:
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / folder if folder else path
        if not path.is_dir():
            raise DictionaryError(f"No folder {folder!r} in {str(name)!r}.")
        return path
    text = str(name)
    if text.startswith(("/", "./", "../", "~")) or text.count("/") != 1 or os.path.exists(text):
        raise DictionaryError(f"No dictionary folder at {text!r}: {'not a folder' if os.path.exists(text) else 'no such path'}"
                              ". Pass a local folder, or a Hugging Face repository as org/repo (folder=... inside it).")
    from huggingface_hub import constants, snapshot_download

    patterns = [f"{folder}/*"] if folder else None
    offline = constants.HF_HUB_OFFLINE
    if not offline:  # said at once, where the hub client would retry for half a minute
        import socket

        try:
            socket.create_connection((constants.ENDPOINT.split("://")[-1].split("/")[0], 443), timeout=5).close()
        except OSError as error:
            raise OSError(f"Could not load the dictionary {text!r}: it is not a local folder, and the hub cannot be "
                          f"reached ({error}). Set HF_HUB_OFFLINE=1 to read dictionaries already in the Hugging Face "
                          "cache, or pass a local folder.") from None
    try:
        root = snapshot_download(text, allow_patterns=patterns, local_files_only=offline)
    except Exception as error:  # noqa: BLE001 - the hub client's errors vary by cause; each is reported as it is
        cause = ("HF_HUB_OFFLINE is set and the Hugging Face cache does not hold it" if offline else
                 "the hub could not provide it (no network, or no such repository)")
        raise OSError(f"Could not load the dictionary {text!r}: it is not a local folder, and {cause}. Pass a local "
                      f"folder, or a hub name with network access. Cause: {type(error).__name__}: {error}") from None
    return _local_folder(root, folder)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _read_saelens(path: Path, scaling_factor: float | None) -> Dictionary:
    """SAELens 6 (``metadata.hook_name``, ``architecture``) and earlier (``hook_name`` or ``hook_point`` at the top,
    ``activation_fn_str``), as ``handle_pre_6_0_config`` reads them."""
    cfg = json.loads((path / "cfg.json").read_text())
    scaler = path / "activation_scaler.json"
    if scaling_factor is None and scaler.is_file():  # a training checkpoint's
        scaling_factor = json.loads(scaler.read_text()).get("scaling_factor")
    return _saelens_dictionary(cfg, _tensors(path / "sae_weights.safetensors"), scaling_factor, str(path),
                               "that its folder does not hold: pass it, load_dictionary(path, scaling_factor=...)")


def from_saelens(sae, scaling_factor: float | None = None) -> Dictionary:
    """The ``Dictionary`` of a SAELens ``SAE`` object (``SAE.from_pretrained(...)``, a trained one), read as
    ``load_dictionary`` reads the folder its ``save_model`` writes; its tensors are the SAE's own, not copies.
    ``scaling_factor``: as ``load_dictionary``'s, for an SAE whose norm scaling factor is not folded yet."""
    cfg, weights = sae.cfg.to_dict(), sae.state_dict()
    dictionary = _saelens_dictionary(cfg, weights, scaling_factor, f"the SAELens SAE {type(sae).__name__}",
                                     "that the SAE does not hold: pass it, from_saelens(sae, scaling_factor=...)")
    dictionary.use_error_term = bool(getattr(sae, "use_error_term", False))
    return dictionary


def _saelens_dictionary(cfg: dict, weights: dict, scaling_factor: float | None, where: str, missing: str
                        ) -> Dictionary:
    """A SAELens config and state dict as a ``Dictionary`` (``where`` names them in errors; ``missing`` says how to
    give a norm scaling factor they lack)."""
    meta = {**cfg, **(cfg.get("metadata") or {})}
    dtype = _dtype(cfg.get("dtype", "float32"))
    weights = {name: tensor.to(dtype) for name, tensor in weights.items()}
    activation_fn = meta.get("activation_fn", meta.get("activation_fn_str", "relu"))
    architecture = cfg.get("architecture") or ("topk" if activation_fn == "topk" else "standard")
    known = ("standard", "gated", "jumprelu", "topk", "transcoder", "skip_transcoder", "jumprelu_transcoder",
             "jumprelu_skip_transcoder")
    if architecture not in known:
        raise DictionaryError(f"{where}: SAELens architecture {architecture!r} is not one nnterp reads "
                              f"({', '.join(known)}).")
    if architecture in ("standard", "transcoder", "skip_transcoder") and activation_fn not in ("relu", None):
        raise DictionaryError(f"{where}: SAELens activation function {activation_fn!r} is not one nnterp reads (relu).")
    if meta.get("hook_head_index") is not None:
        raise DictionaryError(f"{where}: the dictionary reads one head (hook_head_index={meta['hook_head_index']}) "
                              "of its hook, which nnterp does not splice.")
    W_enc, W_dec, b_dec = weights["W_enc"], weights["W_dec"], weights["b_dec"]
    b_enc = weights.get("b_enc", weights.get("b_gate"))
    transcoder = "transcoder" in architecture
    normalize = cfg.get("normalize_activations", "none")
    normalize = {True: "expected_average_only_in", False: "none", None: "none"}.get(normalize, normalize)
    if normalize == "expected_average_only_in":
        if scaling_factor is None:
            raise DictionaryError(
                f"{where}: the dictionary was trained on activations scaled by a norm scaling factor "
                f"(normalize_activations='expected_average_only_in') {missing}, as SAELens folds it (W_enc * s, "
                "W_dec / s, b_dec / s).")
        W_enc, W_dec, b_dec, normalize = W_enc * scaling_factor, W_dec / scaling_factor, b_dec / scaling_factor, "none"
    scale = weights.get("scaling_factor", weights.get("finetuning_scaling_factor"))
    if scale is not None and not torch.equal(scale, torch.ones_like(scale)):
        W_dec = W_dec * scale[:, None]  # (features * s) @ W_dec, SAELens 5's finetuning scale
    k = cfg.get("k", (meta.get("activation_fn_kwargs") or {}).get("k"))
    if architecture == "topk" and cfg.get("rescale_acts_by_decoder_norm"):
        norms = W_dec.norm(dim=-1)  # topk of pre * |W_dec|, decoded divided by it: folded, as SAELens saves it
        W_enc, b_enc, W_dec = W_enc * norms, b_enc * norms, W_dec / norms[:, None]
    activation = {"gated": "gated", "jumprelu": "jumprelu", "topk": "topk", "jumprelu_transcoder": "jumprelu",
                  "jumprelu_skip_transcoder": "jumprelu"}.get(architecture, "relu")
    hook, out_hook = meta.get("hook_name", meta.get("hook_point")), meta.get("hook_name_out")
    site, reason = transformerlens_site(hook)
    out_site, out_reason = transformerlens_site(out_hook) if transcoder else (None, None)
    if transcoder and out_site is None:
        reason = reason or out_reason
    return Dictionary(
        W_enc, b_enc, W_dec, b_dec, activation=activation, k=k, threshold=weights.get("threshold"),
        r_mag=weights.get("r_mag"), b_mag=weights.get("b_mag"), normalize=normalize,
        center=b_dec if cfg.get("apply_b_dec_to_input", True) and not transcoder else None,
        W_skip=weights.get("W_skip"), site=site, out_site=out_site, transcoder=transcoder, hook=hook,
        out_hook=out_hook, site_reason=reason, format="saelens", architecture=architecture, config=cfg)


def _read_sparsify(path: Path) -> Dictionary:
    """sparsify's ``SparseCoder.save_to_disk``: ``cfg.json`` (its config and ``d_in``) and ``sae.safetensors``
    (``encoder.weight`` ``[d_sae, d_in]``, ``encoder.bias``, ``W_dec`` ``[d_sae, d_out]``, ``b_dec``, ``W_skip``);
    the folder is named after the hookpoint, its parent holds the run's ``config.json``."""
    cfg = json.loads((path / "cfg.json").read_text())
    weights = _tensors(path / "sae.safetensors")
    transcode = bool(cfg.get("transcode", False))
    activation = cfg.get("activation", "topk")
    if activation not in ("topk", "groupmax"):
        raise DictionaryError(f"{path}: sparsify activation {activation!r} is not one nnterp reads (topk, groupmax).")
    b_dec = weights["b_dec"]
    hookpoint = path.name
    site, out_site, reason = sparsify_site(hookpoint, transcode)
    modules = {}
    if site is not None:
        modules = {"site": (hookpoint, "input" if transcode else "output")}
        if transcode:
            modules["out_site"] = (hookpoint, "output")
    return Dictionary(
        weights["encoder.weight"].T, weights["encoder.bias"], weights["W_dec"], b_dec, activation=activation,
        k=cfg["k"], center=None if transcode else b_dec, W_skip=weights.get("W_skip"), site=site, out_site=out_site,
        transcoder=transcode, hook=hookpoint, out_hook=hookpoint if transcode else None, site_reason=reason,
        modules=modules, format="sparsify", architecture="transcoder" if transcode else activation, config=cfg)


def _read_dictionary_learning(path: Path) -> Dictionary:
    """dictionary_learning's ``ae.pt`` (a state dict; a training backup holds it under ``"ae"``) and
    ``config.json`` (``trainer.dict_class``, ``layer``, ``submodule_name``; ``buffer.io``), read as its
    ``utils.load_dictionary`` reads them."""
    state = torch.load(path / "ae.pt", map_location="cpu", weights_only=True)
    state = state["ae"] if isinstance(state.get("ae"), dict) else state
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    trainer = config.get("trainer", {})
    kind = trainer.get("dict_class") or ("AutoEncoder" if {"bias", "encoder.weight", "decoder.weight"} <= set(state)
                                         else None)
    float_state = {name: t.float() if t.is_floating_point() else t for name, t in state.items()}
    if kind == "AutoEncoder":  # from_pretrained normalizes the decoder's columns, scaling the encoder to match
        encoder, bias, decoder = float_state["encoder.weight"], float_state["encoder.bias"], float_state["decoder.weight"]
        norms = decoder.norm(dim=0)
        if not torch.allclose(norms, torch.ones_like(norms)):
            decoder, encoder, bias = decoder / norms, encoder * norms[:, None], bias * norms
        parts = dict(W_enc=encoder.T, b_enc=bias, W_dec=decoder.T, b_dec=float_state["bias"],
                     center=float_state["bias"], activation="relu")
    elif kind == "AutoEncoderNew":
        parts = dict(W_enc=float_state["encoder.weight"].T, b_enc=float_state["encoder.bias"],
                     W_dec=float_state["decoder.weight"].T, b_dec=float_state["decoder.bias"], activation="relu")
    elif kind == "GatedAutoEncoder":
        bias = float_state["decoder_bias"]
        parts = dict(W_enc=float_state["encoder.weight"].T, b_enc=float_state["gate_bias"],
                     W_dec=float_state["decoder.weight"].T, b_dec=bias, center=bias, activation="gated",
                     r_mag=float_state["r_mag"], b_mag=float_state["mag_bias"])
    elif kind == "JumpReluAutoEncoder":  # apply_b_dec_to_input is False unless set after loading
        parts = dict(W_enc=float_state["W_enc"], b_enc=float_state["b_enc"], W_dec=float_state["W_dec"],
                     b_dec=float_state["b_dec"], threshold=float_state["threshold"], activation="jumprelu")
    elif kind in ("AutoEncoderTopK", "BatchTopKSAE", "MatryoshkaBatchTopKSAE"):
        linear = "encoder.weight" in float_state
        W_enc = float_state["encoder.weight"].T if linear else float_state["W_enc"]
        b_enc = float_state["encoder.bias"] if linear else float_state["b_enc"]
        W_dec = float_state["decoder.weight"].T if linear else float_state["W_dec"]
        b_dec = float_state["b_dec"]
        if kind == "AutoEncoderTopK":  # encode's default: each token's top k
            k = int(trainer.get("k", state["k"]))
            parts = dict(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec, center=b_dec, activation="topk", k=k)
        else:  # encode's default (use_threshold=True): relu(pre) where it exceeds the learned threshold
            threshold = float_state["threshold"].expand(W_enc.shape[1])
            parts = dict(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec, center=b_dec, activation="jumprelu",
                         threshold=threshold)
    else:
        raise DictionaryError(f"{path}: dictionary_learning class {kind!r} is not one nnterp reads (AutoEncoder, "
                              "AutoEncoderNew, GatedAutoEncoder, JumpReluAutoEncoder, AutoEncoderTopK, BatchTopKSAE, "
                              "MatryoshkaBatchTopKSAE).")
    names = [trainer.get("submodule_name"), *(part for part in reversed(path.parts[-3:]))]
    site, reason = dictionary_learning_site(names, trainer.get("layer"), config.get("buffer", {}).get("io", "out"))
    return Dictionary(**parts, site=site, hook=trainer.get("submodule_name"), site_reason=reason,
                      format="dictionary_learning", architecture=kind, config=config)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DictionaryError(f"Unknown dtype {name!r} in the dictionary's config.")
    return dtype


__all__ = ["Dictionary", "DictionaryConfig", "DictionaryError", "DictionaryMetadata", "SITE_TABLE", "from_saelens",
           "load_dictionary", "site_table"]
