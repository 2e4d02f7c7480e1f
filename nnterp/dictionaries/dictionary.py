"""``Dictionary``: a sparse dictionary (an SAE, a transcoder) as one form whatever its producer, a ``torch.nn.Module``
with SAELens's names, and the standard value it reads (``site``)."""

from __future__ import annotations

import math

import torch

from ..spec.catalog import BY_NAME, PER_HEAD, value_named
from ..spec.errors import NNterpError
from .sites import Site, transformerlens_hook, transformerlens_site

ACTIVATIONS = ("relu", "jumprelu", "topk", "gated", "groupmax", "identity")
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "r_mag", "b_mag", "center", "W_skip")  # a Dictionary's


class DictionaryError(NNterpError, ValueError):
    """A dictionary that cannot be read, or cannot be used where it was asked to be; the message says why."""



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
