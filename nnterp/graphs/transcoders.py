"""Transcoders in circuit-tracer's on-disk format, read into one small structure whose sites are standard values.

A folder holds ``config.yaml`` (``model_kind``, ``feature_input_hook``, ``feature_output_hook``, ``scan``,
``model_name``) and either one ``layer_{i}.safetensors`` per layer (a per-layer transcoder: ``W_enc`` and
``W_dec`` ``[d_transcoder, d_model]``, ``b_enc``, ``b_dec``, optionally ``activation_function.threshold`` for a
JumpReLU and ``W_skip`` with ``skip(x) = x @ W_skip.T``), or a cross-layer transcoder: ``W_enc_{i}.safetensors``
(``W_enc_i``, ``b_enc_i``, ``b_dec_i``) and ``W_dec_{i}.safetensors`` (``W_dec_i`` ``[d_transcoder, L - i,
d_model]``: what layer i's features write to layers i, ..., L - 1).

The hooks are TransformerLens's names (circuit-tracer's), translated through the catalog's
``TRANSFORMERLENS_NAMES``; circuit-tracer's ``mlp.hook_in`` / ``mlp.hook_out`` are the MLP module's input and
output. A transcoder reads ``mlp_input``, ``layer_mid`` (``hook_resid_mid``: circuit-tracer's Llama transcoders) or
the MLP norm's output, and writes ``mlp_output`` (``hook_mlp_out`` / ``mlp.hook_out``; on Gemma-2 the output of
``post_feedforward_layernorm``, which is then inside what the transcoder predicts, as circuit-tracer's Gemma-2 hooks
are). TransformerLens's ``ln2.hook_normalized`` is the MLP norm's input normalized, *before* its weight and bias
(circuit-tracer's Gemma-2 transcoders read ``x / rms(x)`` of ``pre_feedforward_layernorm``, not ``(1 + w)`` times
it): such a transcoder reads ``mlp_norm_output`` with the norm's weight and bias undone (``normalized_input``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..spec.catalog import transformerlens_value
from ..spec.errors import NNterpError, ValueUnavailable
from ..spec.sourced import sourced

INPUTS = ("mlp_input", "mlp_norm_output", "layer_mid")
OUTPUTS = ("mlp_output",)
# circuit-tracer's names of the MLP module's own input and output (its nnsight backend's hooks)
MODULE_HOOKS = {"mlp.hook_in": "mlp_input", "mlp.hook_out": "mlp_output", "hook_mlp_in": "mlp_input"}


class TranscoderError(NNterpError, ValueError):
    """Transcoders that cannot be read, or do not fit the model; the message says why."""


def standard_site(hook: str) -> str | None:
    """The standard value a circuit-tracer (TransformerLens) hook name means, or None."""
    tail = hook.split(".", 2)[2] if hook.startswith("blocks.") and hook.count(".") >= 2 else hook
    if tail in MODULE_HOOKS:
        return MODULE_HOOKS[tail]
    return transformerlens_value(tail)


@sourced
@dataclass(eq=False)
class Transcoders:
    """One transcoder per layer, or a cross-layer transcoder, as tensors.

    ``W_enc[i]`` ``[d_model, d_transcoder]`` and ``b_enc[i]`` encode layer i's ``input_value``: the features are
    ``relu(x @ W_enc + b_enc)``, zero where the pre-activation is at most ``threshold[i]`` (a JumpReLU; None: a
    ReLU). ``W_dec[i]`` is ``[d_transcoder, d_model]`` (per layer) or ``[d_transcoder, L - i, d_model]`` (cross
    layer: what layer i's features add to the output of layers i, ..., L - 1); ``b_dec[i]`` is layer i's output
    bias; ``W_skip[i]`` ``[d_model, d_model]`` (or None) adds ``x @ W_skip.T``. The output is ``output_value``
    (``mlp_output``). ``feature_input_hook`` and ``feature_output_hook`` are the names the folder gave."""

    W_enc: list[torch.Tensor]
    b_enc: list[torch.Tensor]
    W_dec: list[torch.Tensor]
    b_dec: list[torch.Tensor]
    threshold: list[torch.Tensor | None]
    W_skip: list[torch.Tensor | None]
    input_value: str = "mlp_input"
    output_value: str = "mlp_output"
    cross_layer: bool = False
    feature_input_hook: str = ""
    feature_output_hook: str = ""
    scan: str | None = None
    config: dict = field(default_factory=dict)

    @property
    def normalized_input(self) -> bool:
        """The input is TransformerLens's ``ln2.hook_normalized``: the MLP norm's output before its weight and bias."""
        return self.input_value == "mlp_norm_output"

    @property
    def n_layers(self) -> int:
        return len(self.W_enc)

    @property
    def d_transcoder(self) -> int | list[int]:
        """The number of features of each layer's transcoder; the list of them where the layers' widths differ."""
        widths = [self.width(layer) for layer in range(self.n_layers)]
        return widths[0] if len(set(widths)) == 1 else widths

    def width(self, layer: int) -> int:
        """The number of features of layer ``layer``'s transcoder."""
        return self.W_enc[layer].shape[1]

    @property
    def d_model(self) -> int:
        return self.W_enc[0].shape[0]

    def pre_activation(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_enc + b_enc`` of layer ``layer``: what a feature's row of the graph explains."""
        return x.to(self.W_enc[layer].dtype) @ self.W_enc[layer] + self.b_enc[layer]

    def activate(self, layer: int, pre: torch.Tensor) -> torch.Tensor:
        features = torch.relu(pre)
        threshold = self.threshold[layer]
        return features if threshold is None else features * (pre > threshold).to(pre.dtype)

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s features of ``x`` ``[..., d_model]``: ``[..., d_transcoder]``."""
        return self.activate(layer, self.pre_activation(layer, x))

    def decoder(self, source: int, target: int) -> torch.Tensor:
        """``[d_transcoder, d_model]``: what one unit of each of layer ``source``'s features adds to layer
        ``target``'s output (zero rows where it writes nothing there)."""
        W = self.W_dec[source]
        if not self.cross_layer:
            return W if source == target else W.new_zeros(W.shape)
        return W[:, target - source] if target >= source else W.new_zeros(W.shape[0], W.shape[-1])

    def decode(self, layer: int, features: list[torch.Tensor]) -> torch.Tensor:
        """Layer ``layer``'s output from the features of layers 0 to ``layer`` (``features[i]`` of layer i; a per-layer
        transcoder reads its own layer's only), the skip connection left out (``skip``)."""
        sources = range(layer + 1) if self.cross_layer else (layer,)
        out = self.b_dec[layer]
        for source in sources:
            out = out + features[source].to(self.W_enc[source].dtype) @ self.decoder(source, layer)
        return out

    def skip(self, layer: int, x: torch.Tensor) -> torch.Tensor | int:
        W = self.W_skip[layer]
        return 0 if W is None else x.to(W.dtype) @ W.T

    def to(self, device=None, dtype: torch.dtype | None = None) -> Transcoders:
        def move(tensors):
            return [None if t is None else t.to(device=device, dtype=dtype) for t in tensors]

        return Transcoders(move(self.W_enc), move(self.b_enc), move(self.W_dec), move(self.b_dec),
                           move(self.threshold), move(self.W_skip), self.input_value, self.output_value,
                           self.cross_layer, self.feature_input_hook, self.feature_output_hook, self.scan,
                           dict(self.config))

    def __repr__(self) -> str:
        kind = "cross-layer transcoder" if self.cross_layer else "per-layer transcoders"
        return (f"Transcoders({kind}, {self.n_layers} layers, d_transcoder={self.d_transcoder}, "
                f"{self.input_value} -> {self.output_value})")

    def check_fits(self, model) -> None:
        """Refuse, naming the layer and the value, a set whose sites the model does not have or whose sizes differ."""
        if self.n_layers != model.num_layers:
            raise TranscoderError(f"The transcoders cover {self.n_layers} layers; the model has {model.num_layers}.")
        for layer in range(model.num_layers):
            for value in (self.input_value, self.output_value):
                try:
                    model.location(layer, value)
                except ValueUnavailable as error:
                    raise TranscoderError(f"The transcoders read or write {value} at layer {layer}, which "
                                          f"{model.family.name} does not have there: {error.reason}.") from None
            if self.W_enc[layer].shape[0] != model.hidden_size:
                raise TranscoderError(f"Layer {layer}'s transcoder reads vectors of {self.W_enc[layer].shape[0]}; "
                                      f"the model's {self.input_value} has {model.hidden_size}.")
            shapes = {"b_enc": self.b_enc[layer].shape[0], "W_dec": self.W_dec[layer].shape[0]}
            if self.threshold[layer] is not None:
                shapes["threshold"] = self.threshold[layer].shape[0]
            for name, width in shapes.items():
                if width != self.width(layer):
                    raise TranscoderError(f"Layer {layer}'s transcoder has {self.width(layer)} features in W_enc and "
                                          f"{width} in {name}: one layer's tensors have one number of features.")
            if self.W_dec[layer].shape[-1] != model.hidden_size:
                raise TranscoderError(f"Layer {layer}'s transcoder writes vectors of {self.W_dec[layer].shape[-1]}; "
                                      f"the model's {self.output_value} has {model.hidden_size}.")


def _config(path: Path) -> dict:
    import yaml

    file = path / "config.yaml"
    if not file.is_file():
        raise TranscoderError(f"{str(path)!r} holds no circuit-tracer transcoders: no config.yaml (it has: "
                              f"{', '.join(sorted(p.name for p in path.iterdir())[:12]) or 'nothing'}).")
    config = yaml.safe_load(file.read_text()) or {}
    for key in ("feature_input_hook", "feature_output_hook"):
        if key not in config:
            raise TranscoderError(f"{file}: config.yaml names no {key}.")
    return config


def _sites(config: dict, file: Path) -> tuple[str, str]:
    found = []
    for key, allowed in (("feature_input_hook", INPUTS), ("feature_output_hook", OUTPUTS)):
        hook = str(config[key])
        value = standard_site(hook)
        if value not in allowed:
            meaning = f"means {value}" if value else "is no TransformerLens hook nnterp knows"
            raise TranscoderError(f"{file}: {key} {hook!r} {meaning}; a transcoder here reads "
                                  f"{' or '.join(INPUTS)} and writes {' or '.join(OUTPUTS)}.")
        found.append(value)
    return found[0], found[1]


def load_transcoders(folder, device=None, dtype: torch.dtype | None = None) -> Transcoders:
    """circuit-tracer's transcoders from a local folder (per-layer or cross-layer), their sites as standard values."""
    from safetensors.torch import load_file

    path = Path(folder).expanduser()
    if not path.is_dir():
        raise TranscoderError(f"No transcoder folder at {str(folder)!r}.")
    config = _config(path)
    input_value, output_value = _sites(config, path / "config.yaml")
    layers = sorted(int(p.stem.removeprefix("layer_")) for p in path.glob("layer_*.safetensors"))
    encoders = sorted(int(p.stem.removeprefix("W_enc_")) for p in path.glob("W_enc_*.safetensors"))
    if layers and encoders:
        raise TranscoderError(f"{path} holds both per-layer (layer_i) and cross-layer (W_enc_i) files.")
    indices = layers or encoders
    if not indices or indices != list(range(len(indices))):
        raise TranscoderError(f"{path}: the layer files are not layer_0 ... layer_(L-1) (or W_enc_0 ...): found "
                              f"{indices or 'none'}.")
    parts: dict[str, list] = {name: [] for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")}
    n = len(indices)
    for i in indices:
        if layers:
            tensors = load_file(str(path / f"layer_{i}.safetensors"))
            W_enc, W_dec = tensors["W_enc"], tensors["W_dec"]
            b_enc, b_dec = tensors["b_enc"], tensors["b_dec"]
            threshold = tensors.get("activation_function.threshold")
            skip = tensors.get("W_skip")
            if W_dec.shape != W_enc.shape:
                raise TranscoderError(f"{path}: layer {i}'s W_enc is {list(W_enc.shape)} and W_dec "
                                      f"{list(W_dec.shape)}; both are [d_transcoder, d_model].")
        else:
            enc = load_file(str(path / f"W_enc_{i}.safetensors"))
            dec = load_file(str(path / f"W_dec_{i}.safetensors"))
            W_enc, b_enc, b_dec, W_dec = enc[f"W_enc_{i}"], enc[f"b_enc_{i}"], enc[f"b_dec_{i}"], dec[f"W_dec_{i}"]
            threshold, skip = enc.get(f"threshold_{i}", enc.get("activation_function.threshold")), None
            if W_dec.dim() != 3 or W_dec.shape[1] != n - i:
                raise TranscoderError(f"{path}: W_dec_{i} is {list(W_dec.shape)}; a cross-layer transcoder's is "
                                      f"[d_transcoder, {n - i}, d_model] (layers {i} to {n - 1}).")
        parts["W_enc"].append(W_enc.T.contiguous())  # [d_model, d_transcoder]: x @ W_enc
        parts["b_enc"].append(b_enc)
        parts["W_dec"].append(W_dec)
        parts["b_dec"].append(b_dec)
        parts["threshold"].append(threshold)
        parts["W_skip"].append(skip)
    transcoders = Transcoders(**parts, input_value=input_value, output_value=output_value, cross_layer=bool(encoders),
                              feature_input_hook=str(config["feature_input_hook"]),
                              feature_output_hook=str(config["feature_output_hook"]), scan=config.get("scan"),
                              config=config)
    return transcoders if device is None and dtype is None else transcoders.to(device, dtype)


def write_random_transcoders(folder, n_layers: int, d_model: int, d_transcoder: int, *,
                             feature_input_hook: str = "mlp.hook_in", feature_output_hook: str = "mlp.hook_out",
                             jumprelu: bool = False, skip: bool = False, cross_layer: bool = False, seed: int = 0,
                             scale: float = 0.3, b_dec: bool = True, dtype: torch.dtype = torch.float32) -> Path:
    """Random transcoders in circuit-tracer's format (for tests): encoders scaled so that some features fire."""
    import yaml
    from safetensors.torch import save_file

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, s=scale):
        return (torch.randn(*shape, generator=generator) * s).to(dtype).contiguous()

    config = {"model_kind": "cross_layer_transcoder" if cross_layer else "transcoder_set",
              "feature_input_hook": feature_input_hook, "feature_output_hook": feature_output_hook,
              "scan": f"random-{seed}", "model_name": "tiny"}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    for i in range(n_layers):
        W_enc, b_enc = randn(d_transcoder, d_model), randn(d_transcoder, s=0.1)
        bias = randn(d_model, s=0.05) if b_dec else torch.zeros(d_model, dtype=dtype)
        threshold = (torch.rand(d_transcoder, generator=generator) * 0.1).to(dtype) if jumprelu else None
        if cross_layer:
            enc = {f"W_enc_{i}": W_enc, f"b_enc_{i}": b_enc, f"b_dec_{i}": bias}
            if threshold is not None:
                enc[f"threshold_{i}"] = threshold
            save_file(enc, str(path / f"W_enc_{i}.safetensors"))
            save_file({f"W_dec_{i}": randn(d_transcoder, n_layers - i, d_model, s=scale / 4)},
                      str(path / f"W_dec_{i}.safetensors"))
        else:
            tensors = {"W_enc": W_enc, "b_enc": b_enc, "W_dec": randn(d_transcoder, d_model, s=scale / 4),
                       "b_dec": bias}
            if threshold is not None:
                tensors["activation_function.threshold"] = threshold
            if skip:
                tensors["W_skip"] = randn(d_model, d_model, s=0.02)
            save_file(tensors, str(path / f"layer_{i}.safetensors"))
    return path
