"""Tuned lenses read from tuned-lens's files: one affine translator of the stream per layer.

tuned-lens's ``TunedLens.save(folder)`` writes ``config.json`` (its ``TunedLensConfig``: ``d_model``,
``num_hidden_layers``, ``bias``, ``unembed_hash``, ``lens_type``, ``base_model_name_or_path``) and ``params.pt``
(the state dict of its ``layer_translators``, one ``nn.Linear(d_model, d_model)`` per layer: ``"{i}.weight"``,
``"{i}.bias"``). Translator ``i`` reads ``hidden_states[i]`` of the model's forward (the embeddings for ``i = 0``),
the stream entering block ``i``: ``layers[i].layer_input``, which is ``layers[i - 1].layer_output``. Its lens is
the model's readout of ``h + h @ weight[i].T + bias[i]`` (the translator's output added to the stream, as
tuned-lens's ``transform_hidden`` adds it). The last block's output has no translator: it is read as it is, the
model's own output. ``load_tuned_lens`` reads the folder with nnterp's own reader (tuned-lens is not needed).

A trained lens is a dictionary of the same kind as an SAE: ``lens.dictionary(i)`` is translator ``i`` as a
``Dictionary`` at ``(i, "layer_input")``, whose features are the translated stream (what the lens reads out)
and whose decoder is the translator's inverse. So ``collect(..., dictionaries=lens.dictionaries())`` collects
what each layer's lens reads, and ``splice(model, lens.dictionary(i))`` edits the stream as the lens sees it: a
change of the features is the stream change whose translation is that change.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from ..dictionaries import FOLDER_KINDS, Dictionary, DictionaryError, _checked_site

LENS_VALUES = ("layer_input", "layer_output")  # the stream between blocks, where a tuned lens was trained


class TunedLens:
    """A tuned lens: ``weight`` ``[layers, d_model, d_model]`` (``nn.Linear``'s, out by in) and ``bias``
    ``[layers, d_model]`` (or None), translator ``i`` reading the stream entering block ``i``.
    ``logit_lens(model, prompts, lens=lens)`` reads each layer's stream through it.

    ``unembed_hash`` is tuned-lens's digest of the unembedding the lens was trained with: ``check(model)``
    refuses a model whose unembedding differs (set it to None to use the lens anyway). A plain class of tensors
    and plain methods: it travels with a remote request as it is.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, unembed_hash: str | None = None,
                 config: dict | None = None):
        if weight.dim() != 3 or weight.shape[1] != weight.shape[2]:
            raise DictionaryError(f"A tuned lens's weight is [layers, d_model, d_model]; got {list(weight.shape)}.")
        if bias is not None and bias.shape != weight.shape[:2]:
            raise DictionaryError(f"A tuned lens's bias is [layers, d_model] = {list(weight.shape[:2])}; got "
                                  f"{list(bias.shape)}.")
        self.weight, self.bias, self.unembed_hash, self.config = weight, bias, unembed_hash, dict(config or {})

    @property
    def num_layers(self) -> int:
        return self.weight.shape[0]

    @property
    def d_model(self) -> int:
        return self.weight.shape[1]

    def __repr__(self) -> str:
        base = self.config.get("base_model_name_or_path")
        return f"TunedLens(layers={self.num_layers}, d_model={self.d_model}" + (f", for {base!r})" if base else ")")

    def translator(self, layer: int, value: str = "layer_output") -> int | None:
        """Which translator reads ``layers[layer].value`` (``value`` is ``layer_input`` or ``layer_output``);
        None for the last block's output, read as it is."""
        if value not in LENS_VALUES:
            raise DictionaryError(f"A tuned lens translates the stream between blocks ({', '.join(LENS_VALUES)}), "
                                  f"where it was trained; not {value!r}.")
        index = (layer % self.num_layers) + (value == "layer_output")
        return None if index == self.num_layers else index

    def translate(self, hidden: torch.Tensor, layer: int, value: str = "layer_output") -> torch.Tensor:
        """``hidden + hidden @ weight[i].T + bias[i]`` for the translator ``i`` of ``layers[layer].value``, in the
        stream's dtype (as tuned-lens runs its translators in the model's)."""
        index = self.translator(layer, value)
        if index is None:
            return hidden
        weight = self.weight[index].to(device=hidden.device, dtype=hidden.dtype)
        out = hidden @ weight.T
        if self.bias is not None:
            out = out + self.bias[index].to(device=hidden.device, dtype=hidden.dtype)
        return hidden + out

    def dictionary(self, layer: int, value: str = "layer_input") -> Dictionary:
        """The translator of ``layers[layer].value`` as a ``Dictionary`` at that site: ``encode(h)`` is
        ``translate(h)`` (``d_sae = d_model``, activation ``"identity"``), ``decode`` its inverse affine map, so
        a splice's edit of the features moves the stream by ``change @ inverse``. In the lens's dtype; the
        inverse is computed in float64. ``check(model)`` says whether the lens is the model's own."""
        index = self.translator(layer, value)
        if index is None:
            raise DictionaryError(f"layers[{layer}].{value} is the last block's output, which the lens reads as it is "
                                  "(no translator): there is nothing to encode.")
        forward = torch.eye(self.d_model, dtype=torch.float64) + self.weight[index].double().T  # h @ forward
        inverse, info = torch.linalg.inv_ex(forward)
        if info != 0 or not torch.isfinite(inverse).all():
            raise DictionaryError(f"Translator {index} (identity + weight) is singular: its translated stream cannot be "
                                  "decoded back to the stream, so it is no dictionary (logit_lens(lens=...) still reads "
                                  "through it).")
        bias = torch.zeros(self.d_model, dtype=torch.float64) if self.bias is None else self.bias[index].double()
        dtype, device = self.weight.dtype, self.weight.device
        as_lens = lambda tensor: tensor.to(device=device, dtype=dtype)
        return Dictionary(as_lens(forward), as_lens(bias), as_lens(inverse), as_lens(-bias @ inverse),
                          activation="identity", site=(layer % self.num_layers, value),
                          hook=f"layer_translators.{index}", format="tuned_lens",
                          architecture=self.config.get("lens_type", "linear_tuned_lens"), config=self.config)

    def dictionaries(self) -> list[Dictionary]:
        """Every translator as a ``Dictionary``, translator ``i`` at ``(i, "layer_input")``: ready for
        ``collect(..., dictionaries=...)`` (collected as ``"features/layers.i.layer_input"``)."""
        return [self.dictionary(index) for index in range(self.num_layers)]

    def check(self, model) -> None:
        """A clear error where the lens was not trained on ``model``: its layers, width or unembedding differ."""
        if (self.num_layers, self.d_model) != (model.num_layers, model.hidden_size):
            raise DictionaryError(f"{self!r} was trained on a model of {self.num_layers} layers of width "
                                  f"{self.d_model}; this one has {model.num_layers} of width {model.hidden_size}.")
        if self.unembed_hash is not None:
            head = model._module.get_output_embeddings()
            if head is None or unembedding_hash(head.weight) != self.unembed_hash:
                raise DictionaryError(
                    f"{self!r} was trained with another unembedding than this model's (tuned-lens's unembed_hash "
                    "differs): its translators map the stream to that model's readout. Use the lens's own model; "
                    "set lens.unembed_hash = None to apply it anyway.")

    def to(self, device=None, dtype: torch.dtype | None = None) -> TunedLens:
        """The same lens with its tensors on ``device`` and in ``dtype`` (a new object)."""
        bias = None if self.bias is None else self.bias.to(device=device, dtype=dtype)
        return TunedLens(self.weight.to(device=device, dtype=dtype), bias, unembed_hash=self.unembed_hash,
                         config=self.config)


def unembedding_hash(weight: torch.Tensor) -> str:
    """tuned-lens's ``Unembed.unembedding_hash``: the SHA-256 of NumPy's text of the weight at one decimal (its
    corners, with NumPy's default print options), robust to the dtype."""
    array = weight.detach().cpu().float().numpy()
    with np.printoptions(threshold=1000, edgeitems=3, linewidth=75, suppress=False, nanstr="nan", infstr="inf",
                         sign="-", floatmode="maxprec", legacy=False):
        return hashlib.sha256(np.array_str(array, precision=1).encode()).hexdigest()


def load_tuned_lens(folder: str | os.PathLike, *, device=None, dtype: torch.dtype | None = None) -> TunedLens:
    """A tuned lens from the folder tuned-lens's ``TunedLens.save`` writes (``config.json`` + ``params.pt``)."""
    path = Path(folder).expanduser()
    if not (path / "params.pt").is_file() or not (path / "config.json").is_file():
        inside = sorted(p.name for p in path.iterdir())[:12] if path.is_dir() else None
        raise DictionaryError(f"{str(path)!r} holds no tuned lens: tuned-lens saves config.json + params.pt ("
                              + (f"it has: {', '.join(inside) or 'nothing'}" if inside is not None else "no such folder")
                              + ").")
    config = json.loads((path / "config.json").read_text())
    kind = config.get("lens_type", "linear_tuned_lens")
    if kind != "linear_tuned_lens":
        raise DictionaryError(f"{path}: tuned-lens lens_type {kind!r} is not one nnterp reads (linear_tuned_lens).")
    state = torch.load(path / "params.pt", map_location="cpu", weights_only=True)
    layers = config.get("num_hidden_layers")
    found = sorted({int(m.group(1)) for key in state if (m := re.fullmatch(r"(\d+)\.(weight|bias)", key))})
    unknown = [key for key in state if not re.fullmatch(r"\d+\.(weight|bias)", key)]
    if unknown or not found or found != list(range(len(found))) or (layers is not None and len(found) != layers):
        raise DictionaryError(f"{path}/params.pt is not tuned-lens's layer_translators of {layers} layers "
                              f"(\"i.weight\", \"i.bias\"): it holds {', '.join(sorted(state)[:8])}.")
    weight = torch.stack([state[f"{i}.weight"] for i in found])
    has_bias = all(f"{i}.bias" in state for i in found)
    if has_bias != bool(config.get("bias", True)) or (not has_bias and any(key.endswith(".bias") for key in state)):
        raise DictionaryError(f"{path}: config.json says bias={config.get('bias', True)}, and params.pt holds the "
                              f"biases of {sum(key.endswith('.bias') for key in state)} of its {len(found)} translators.")
    bias = torch.stack([state[f"{i}.bias"] for i in found]) if has_bias else None
    lens = TunedLens(weight, bias, unembed_hash=config.get("unembed_hash"), config=config)
    return lens if device is None and dtype is None else lens.to(device, dtype)


__all__ = ["TunedLens", "load_tuned_lens", "unembedding_hash"]


def _translator(path: Path, site, out_site, device, dtype) -> Dictionary:
    if site is None or out_site is not None:
        raise DictionaryError(
            f"{path} is a tuned lens: one translator per layer, each reading the stream entering its block. Say "
            "which: load_dictionary(path, site=(layer, 'layer_input')); load_tuned_lens(path).dictionaries() gives "
            "them all (for collect), load_tuned_lens(path) the lens (for logit_lens(..., lens=...)).")
    layer, value = _checked_site(site)
    return load_tuned_lens(path, device=device, dtype=dtype).dictionary(layer, value)


FOLDER_KINDS["tuned_lens"] = _translator  # load_dictionary on a tuned-lens folder
