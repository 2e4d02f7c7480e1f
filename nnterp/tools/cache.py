"""``ActivationCache``: the values of one forward pass, kept in memory, read by ``(name, layer)`` and by
TransformerLens's names (``cache["resid_post", 5]``, ``cache["blocks.5.attn.hook_pattern"]``), with TransformerLens's
analysis methods (``nnterp.analysis``) and cache methods (``cache_methods``). ``run_with_cache``
(``nnterp.tools.activation_cache``) fills it."""

from __future__ import annotations

import numpy as np
import torch

from .. import analysis
from ..spec.catalog import BY_NAME, TRANSFORMERLENS_NAMES, transformerlens_spellings
from ..spec.errors import NNterpError, ValueUnavailable
from ..spec.locations import At
from ..spec.selection import layer_ranges, value_name
from . import hook_points
from .cache_methods import CacheMethods
from .hook_points import StandardPoint, get_act_name, is_hook_name, split_name


class ActivationCache(CacheMethods):
    """The values of one forward pass, by ``(name, layer)``.

    ``cache[name, layer]``: one block's value (a negative layer counts from the model's end).
    ``cache[name]``: every cached block's value stacked on a new first dimension, ``[layers, ...]``,
    in the order of ``cache.layers``. A name may be ``"mlp_output"`` or ``"mlp.mlp_output"``.
    A value that has no meaning on the block raises the model's ``ValueUnavailable``, with its reason.

    Beside the values: ``cache["ln_final_input"]`` and ``cache["ln_final_output"]``, the final norm's input (the
    stream it reads) and output; ``cache["ln_final_scale"]``, ``cache["attention_norm_scale", i]`` and
    ``cache["mlp_norm_scale", i]``, the scale ``[batch, seq, 1]`` each norm divided by in the pass
    (TransformerLens's ``hook_scale``); ``cache["extra.<name>", i]``, a term of block i's identity that is no
    standard value (Falcon-H1's ``mamba``). On a routed mixture of experts (with names=None, on a forward pass):
    ``cache["expert_indices", i]`` and ``cache["expert_weights", i]`` ``[batch, seq, k]``, the experts the router
    chose for each token and its weights for them, as the experts apply them (TransformerLens's
    ``hook_expert_indices`` / ``hook_expert_weights``), ``cache["expert_input", i]`` and ``cache["expert_output", i]``,
    what the experts read and gave. ``cache["pattern", i]`` is ``attention_probabilities`` (TransformerLens's
    ``hook_pattern``), served with the attention values on (``attention_values=True``). The analysis methods are
    TransformerLens's (``nnterp.analysis``).
    """

    def __init__(self, values: dict[tuple[str, int], torch.Tensor], names: list[str], layers: list[int],
                 unavailable: dict[tuple[str, int], ValueUnavailable], num_layers: int,
                 input_ids: torch.Tensor, attention_mask: torch.Tensor, model=None,
                 readout: dict[str, torch.Tensor] | None = None, prompt_length: int | None = None,
                 steered: tuple[str, ...] = (), hooks: dict[str, torch.Tensor] | None = None,
                 hook_names: list[str] | None = None, batch_removed: bool = False):
        self._values, self._unavailable = values, unavailable
        # a cache made with names_filter: TransformerLens's names it holds, in forward order, and the tensors of those
        # that are no standard value (read at a native module or computed in the pass)
        self._hooks, self.hook_names = hooks or {}, hook_names
        self.batch_removed = batch_removed  # remove_batch_dim=True: every tensor is given without its batch dimension
        self.names, self.layers, self.num_layers = names, layers, num_layers
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.model, self._readout = model, readout or {}
        # a generation's cache: the prompt's columns, then one per step after the first (run_with_cache)
        self.prompt_length = input_ids.shape[1] if prompt_length is None else prompt_length
        self.steered = steered  # where the pass was steered (run_with_cache(steer=...)): "layers[5].layer_output"

    @property
    def steps(self) -> int:
        """The forward passes the values come from: 1, or a generation's steps (step 0 the prompt)."""
        return self.input_ids.shape[1] - self.prompt_length + 1

    def step_positions(self, step: int) -> slice:
        """The positions (along seq) that generation step ``step`` ran: the prompt's for step 0, one after."""
        if isinstance(step, bool) or not isinstance(step, int) or not -self.steps <= step < self.steps:
            raise IndexError(f"Step {step!r} is not in this cache, which holds {self.steps} step(s), 0 the prompt.")
        step %= self.steps
        return slice(0, self.prompt_length) if step == 0 else slice(self.prompt_length + step - 1,
                                                                    self.prompt_length + step)

    def __getitem__(self, key) -> torch.Tensor:
        name, layer, layer_type = key if isinstance(key, tuple) and len(key) == 3 else (
            *(key if isinstance(key, tuple) and len(key) == 2 else (key, None)), None)
        if not isinstance(name, str):
            raise TypeError(f"Index a cache with a value name, or (name, layer): cache['layer_output', 5], not {key!r}.")
        layer = _as_layer(layer)
        if layer_type is not None or not _is_standard(name):  # TransformerLens's names: cache["resid_post", 5]
            if isinstance(layer, int) and not isinstance(layer, bool) and -self.num_layers <= layer < 0:
                layer %= self.num_layers  # cache["resid_post", -1]: the last block's
            full = get_act_name(name, layer, layer_type) if layer is not None or layer_type else get_act_name(name)
            if is_hook_name(full):
                return self._without_batch(self._hook(full), stacked=False)
        return self._without_batch(self._standard(name, layer), stacked=layer is None and (
            name.rpartition(".")[2] in BY_NAME or name.startswith("extra.") or name in SCALES))

    def _without_batch(self, tensor: torch.Tensor, stacked: bool) -> torch.Tensor:
        if not self.batch_removed:
            return tensor
        return tensor[:, 0] if stacked else tensor[0]

    def _hook(self, name: str) -> torch.Tensor:
        """The tensor of TransformerLens's hook ``name`` (``"blocks.5.hook_resid_post"``): the standard value it is,
        one read in the pass (a cache made with ``names_filter``), or one computed from the cached values (a norm's
        scale and normalized input, each head's result)."""
        if name in self._hooks:
            return self._hooks[name]
        layer, tail = split_name(name)
        if layer is not None:
            layer = self._layer(layer)
        point = hook_points.point(self.model, name)  # a name the family has no value for says why
        if isinstance(point, StandardPoint):
            return self._standard(point.value, layer)
        if isinstance(point, hook_points.ScoresPoint):  # TransformerLens's masked entries: -inf
            return point.masked(self._standard("attention_scores", layer))
        which = tail.partition(".")[0]
        try:
            if tail.endswith("hook_scale"):
                norm = analysis.frozen_norm(self, layer, mlp_input=which == "ln2")
                return norm.scale.to(self._stream_for(which, layer).dtype)
            if tail.endswith("hook_normalized"):
                norm, x = analysis.frozen_norm(self, layer, mlp_input=which == "ln2"), self._stream_for(which, layer)
                centred = x.float() - x.float().mean(-1, keepdim=True) if norm.centred else x.float()
                return (centred / norm.scale).to(x.dtype)
            if tail == "attn.hook_result":
                return analysis.stacks.head_results(self, layer).movedim(0, 2).to(self["attention_premix", layer].dtype)
        except KeyError as error:
            raise KeyError(f"{name} is computed from values this cache does not hold ({error}): run_with_cache(..., "
                           f"names_filter=[{name!r}]) reads it.") from None
        raise KeyError(f"{name} is not in this cache: it is read in the pass at a module no standard value names; "
                       f"run_with_cache(..., names_filter=[{name!r}]) reads it.")

    def _stream_for(self, which: str, layer: int | None) -> torch.Tensor:
        """The stream a norm reads: the final norm's input, or block ``layer``'s stream before its attention (ln1) or
        MLP (ln2) norm."""
        if which == "ln_final":
            return self["ln_final_input"]
        if which == "ln2" and isinstance(self.model.block_spec(layer).resolve("layer_mid"), At):
            return self["layer_mid", layer]
        return self["layer_input", layer]

    def _standard(self, name: str, layer) -> torch.Tensor:
        if name in READOUT or name in SCALES or name.startswith("extra."):
            return self._beside(name, layer)
        if name in analysis.ROUTING:
            return self._routing(name, layer)
        name = value_name(ALIASES.get(name, name))
        if name not in self.names and not any(key[0] == name for key in self._unavailable):
            raise KeyError(f"{name!r} was not cached: this cache holds {', '.join(self.names)}. Pass it in "
                           "run_with_cache(..., names=[...]), or names=None for every available value.")
        if layer is None:
            return self._stacked(name)
        return self._one(name, self._layer(layer))

    def _beside(self, name: str, layer) -> torch.Tensor:
        """The entries beside the values: the final norm's input, output and scale, the block norms' scales, and
        the identity's extra terms."""
        if name in READOUT:
            if layer is not None:
                raise TypeError(f"{name!r} is the model's, not a block's: cache[{name!r}].")
            if name == "ln_final_scale":
                norm = analysis.frozen_norm(self, None)
                if norm is None:
                    raise KeyError(f"{self.model.family.name} has no final norm: its head reads the last block's output.")
                return norm.scale
            if name not in self._readout:
                raise KeyError(f"{name!r} is not in this cache: the model has no final norm, or the cache was not made "
                               "by run_with_cache.")
            return self._readout[name]
        if layer is None:
            return torch.stack([self._beside(name, i) for i in self.layers])
        layer = self._layer(layer)
        if name in SCALES:
            return analysis.frozen_norm(self, layer, mlp_input=name == "mlp_norm_scale").scale
        if (name, layer) not in self._values:
            extras = [f"extra.{term}" for term in self.model.block_spec(layer).extra]
            raise KeyError(f"{name!r} of layer {layer} is not in this cache: block {layer}'s identity has "
                           f"{', '.join(extras) or 'no extra terms'}, which run_with_cache caches with names=None.")
        return self._values[(name, layer)]

    def _routing(self, name: str, layer) -> torch.Tensor:
        """What a routed block's experts received and gave (``analysis.ROUTING``), ``[batch, seq, ...]``: the router's
        choice as the experts apply it, read at their input."""
        if layer is None:
            return torch.stack([self._routing(name, i) for i in self.layers])
        layer = self._layer(layer)
        if (name, layer) not in self._values:
            analysis.experts_of(self.model, layer, f"cache[{name!r}, {layer}]")  # the reason, where there are none
            raise KeyError(f"{name!r} of layer {layer} is not in this cache: run_with_cache caches what a routed "
                           "block's experts receive with names=None, on a forward pass (not over a generation).")
        flat = self._values[(name, layer)]  # the experts read the tokens flattened, [batch * seq, ...]
        batch, seq = self.input_ids.shape
        if flat.shape[0] != batch * seq:
            raise ValueError(f"{name!r} of layer {layer} holds {flat.shape[0]} tokens, not the pass's {batch} x {seq}.")
        return flat.view(batch, seq, *flat.shape[1:])

    def _layer(self, layer) -> int:
        layer = _as_layer(layer)
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"The layer of cache[name, layer] is an int, not {layer!r}.")
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"Layer {layer} is out of range: the model has {self.num_layers} layers.")
        layer %= self.num_layers
        if layer not in self.layers:
            raise KeyError(f"Layer {layer} was not cached: this cache holds layers {layer_ranges(sorted(self.layers))}.")
        return layer

    def _one(self, name: str, layer: int) -> torch.Tensor:
        if (name, layer) in self._unavailable:
            error = self._unavailable[(name, layer)]
            raise ValueUnavailable(error.key, error.family, error.reason)
        return self._values[(name, layer)]

    def _stacked(self, name: str) -> torch.Tensor:
        missing = [layer for layer in self.layers if (name, layer) in self._unavailable]
        if missing:
            error = self._unavailable[(name, missing[0])]
            partly = len(missing) < len(self.layers)
            raise ValueUnavailable(error.key, error.family, error.reason + (
                f" (at layers {layer_ranges(sorted(missing))}: read the layers that have it one at a time, "
                f"cache[{name!r}, layer])" if partly else ""))
        tensors = [self._values[(name, layer)] for layer in self.layers]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise ValueError(f"{name!r} has different shapes across the cached layers ({sorted(shapes)}), so it "
                             f"cannot be stacked: read one layer at a time, cache[{name!r}, layer].")
        return torch.stack([t.to(tensors[0].device) for t in tensors])

    # -- TransformerLens's analyses (nnterp.analysis) ------------------------------------------------

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice=None, mlp_input: bool = False, return_labels: bool = False):
        """The stream as each block receives it, then as the final norm reads it (``nnterp.analysis``)."""
        return analysis.accumulated_resid(self, layer, incl_mid, apply_ln, pos_slice, mlp_input, return_labels)

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice=None, incl_embeds: bool = True, return_labels: bool = False):
        """The stream at ``layer`` as what each block added to it, summing to it exactly (``nnterp.analysis``)."""
        return analysis.decompose_resid(self, layer, mlp_input, mode, apply_ln, pos_slice, incl_embeds, return_labels)

    def recompose_resid(self, residual_stack: torch.Tensor, layer: int | None = None,
                        mlp_input: bool = False) -> torch.Tensor:
        """The rows of ``decompose_resid(layer, mlp_input)`` added in the family's order: the stream, bit for bit."""
        return analysis.recompose(self, residual_stack, layer, mlp_input)

    def stack_head_results(self, layer: int | None = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice=None, apply_ln: bool = False):
        """Every attention head's share of the stream, for the blocks before ``layer`` (``nnterp.analysis``)."""
        return analysis.stack_head_results(self, layer, return_labels, incl_remainder, pos_slice, apply_ln)

    def stack_neuron_results(self, layer: int | None, pos_slice=None, neuron_slice=None, return_labels: bool = False,
                             incl_remainder: bool = False, apply_ln: bool = False):
        """Every MLP neuron's share of the stream, for the blocks before ``layer`` (``nnterp.analysis``)."""
        return analysis.stack_neuron_results(self, layer, pos_slice, neuron_slice, return_labels, incl_remainder,
                                             apply_ln)

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice=None, batch_slice=None, has_batch_dim: bool = True, recompute_ln: bool = False,
                          incl_bias: bool = False, labels=None):
        """A stack through a norm frozen at its scale of the pass, as many rows; its bias one more with ``incl_bias``
        (``nnterp.analysis``)."""
        return analysis.apply_ln_to_stack(self, residual_stack, layer, mlp_input, pos_slice, batch_slice,
                                          has_batch_dim, recompute_ln, incl_bias, labels)

    def logit_attrs(self, residual_stack: torch.Tensor, tokens, incorrect_tokens=None, pos_slice=None,
                    batch_slice=None, has_batch_dim: bool = True, incl_bias: bool = False, labels=None,
                    before_logits_transform: bool = False):
        """Direct logit attribution, one value per row; the biases' term as rows of its own with ``incl_bias``
        (``nnterp.analysis``)."""
        return analysis.logit_attrs(self, residual_stack, tokens, incorrect_tokens, pos_slice, batch_slice,
                                    has_batch_dim, incl_bias, labels, before_logits_transform)

    def keys(self) -> list:
        """The ``(name, layer)`` pairs that hold a value, by layer, then in the catalog's order; for a cache made
        with ``names_filter``, TransformerLens's names it holds, in forward order."""
        if self.hook_names is not None:
            return list(self.hook_names)
        return [(name, layer) for layer in self.layers for name in self.names if (name, layer) in self._values]

    def __contains__(self, key) -> bool:
        """Whether ``cache[key]`` gives a tensor: a ``(name, layer)`` pair or TransformerLens's name it holds."""
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and _is_standard(key[0]):
            try:
                return (value_name(key[0]), self._layer(key[1])) in self._values
            except (ValueError, TypeError, IndexError, KeyError):
                return False
        if self.hook_names is not None and isinstance(key, str):
            return key in self.hook_names
        try:
            self[key]
        except (KeyError, ValueError, TypeError, IndexError, AttributeError, NNterpError):
            return False
        return True

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __repr__(self) -> str:
        batch, seq = self.input_ids.shape
        generated = f", over {self.steps} generation steps ({seq} positions)" if self.steps > 1 else ""
        return (f"ActivationCache({len(self)} tensors: {', '.join(self.names)} at layers "
                f"{layer_ranges(sorted(self.layers))}; {batch} prompt(s) of {self.prompt_length} tokens{generated})")


READOUT = ("ln_final_input", "ln_final_output", "ln_final_scale")
ROUTING = analysis.ROUTING  # a plain tuple: the trace's code ships it, not the analysis module
# TransformerLens's names of a cache's entries that are standard values under other names
ALIASES = dict.fromkeys(transformerlens_spellings("attn.hook_pattern"), TRANSFORMERLENS_NAMES["attn.hook_pattern"])
SCALES = ("attention_norm_scale", "mlp_norm_scale")


def _is_standard(name: str) -> bool:
    """Whether a cache key names a standard value or an entry beside them (else it is read as TransformerLens's)."""
    return (name in READOUT or name in SCALES or name in ALIASES or name in ROUTING or name.startswith("extra.")
            or name.rpartition(".")[2] in BY_NAME)


def _as_layer(layer):
    """A layer given as a NumPy integer or a 0-d integer tensor, as an int (anything else as it is)."""
    if isinstance(layer, np.integer):
        return int(layer)
    if isinstance(layer, torch.Tensor) and layer.dim() == 0 and not layer.is_floating_point() and (
            layer.dtype != torch.bool):
        return int(layer)
    return layer
