"""TransformerLens's ``ActivationCache`` methods that a cache's users call beside indexing: ``items``, ``values``,
``cache_dict``, ``to``, ``remove_batch_dim``, ``stack_activation``, ``compute_head_results``, ``get_neuron_results`` and
``get_full_resid_decomposition``. A mixin of ``nnterp.tools.activation_cache.ActivationCache``: each reads the cache
through its own indexing, so a name means what ``cache[name]`` means."""

from __future__ import annotations

import torch

from .. import analysis
from ..analysis.checks import _refuse
from ..analysis.reading import _take
from ..analysis.stacks import _contributed, _has, _projection
from ..spec.errors import NNterpError


class CacheMethods:
    """TransformerLens's methods of a cache (see the module)."""

    def items(self) -> list:
        """``(key, tensor)`` for each key of ``keys()``."""
        return [(key, self[key]) for key in self.keys()]

    def values(self) -> list:
        """The tensor of each key of ``keys()``."""
        return [self[key] for key in self.keys()]

    @property
    def cache_dict(self) -> dict:
        """The cache as a dictionary, ``{key: tensor}`` (TransformerLens's ``cache.cache_dict``)."""
        return dict(self.items())

    def to(self, device, move_model: bool = False):
        """Every tensor of the cache moved to ``device``, in place; the cache is returned. ``move_model=True`` is
        refused: move the model itself (its ``.to(device)``)."""
        if move_model:
            raise TypeError("cache.to(device, move_model=True): nnterp's cache does not move the model; move the model "
                            "itself (model.to(device)).")
        for store in (self._values, self._hooks, self._readout, getattr(self, "sae_values", {})):
            for key, tensor in store.items():
                store[key] = tensor.to(device) if isinstance(tensor, torch.Tensor) else tensor
        self.input_ids, self.attention_mask = self.input_ids.to(device), self.attention_mask.to(device)
        return self

    def remove_batch_dim(self) -> None:
        """A cache of one prompt gives every tensor without its batch dimension from now on (TransformerLens's
        ``remove_batch_dim``); a batch of several is refused."""
        if self.input_ids.shape[0] != 1:
            raise ValueError(f"remove_batch_dim takes a cache of one prompt, not a batch of {self.input_ids.shape[0]}.")
        self.batch_removed = True

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type: str | None = None):
        """``activation_name`` of every block before ``layer`` (-1: of every block) stacked ``[layers, ...]``:
        ``cache.stack_activation("resid_post")``, as TransformerLens's."""
        layers = range(self.num_layers) if layer == -1 else range(layer)
        return torch.stack([self[(activation_name, i, sublayer_type) if sublayer_type else (activation_name, i)]
                            for i in layers])

    def compute_head_results(self) -> None:
        """TransformerLens's step before reading ``attn.hook_result``: nnterp computes each head's result when it is
        read (``cache["result", layer]``), so there is nothing to do."""

    def get_neuron_results(self, layer: int, neuron_slice=None, pos_slice=None) -> torch.Tensor:
        """Each MLP neuron's share of block ``layer``'s MLP output, ``[batch, pos, neurons, hidden]`` (its activation
        times its column of the down projection), as TransformerLens's ``get_neuron_results``."""
        return analysis.stacks.neuron_results(self, self._layer(layer), neuron_slice, pos_slice).movedim(0, -2)

    def get_full_resid_decomposition(self, layer: int | None = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False, pos_slice=None,
                                     return_labels: bool = False):
        """The stream block ``layer`` reads (None or -1: the final norm's), as TransformerLens splits it: each
        head's result (``L{i}H{h}``), each neuron's (``L{i}N{n}``; each MLP's output, ``{i}_mlp_out``, without
        ``expand_neurons``), ``embed`` and ``pos_embed`` (one ``embed`` row where the cache holds no
        ``hook_pos_embed``), and ``bias``: the output projections' biases the stream gathered. ``mlp_input``:
        the stream block ``layer``'s MLP reads (its heads too)."""
        model = self.model
        layer = model.num_layers if layer is None or layer == -1 else layer
        heads, labels = self.stack_head_results(layer + (1 if mlp_input else 0), pos_slice=pos_slice,
                                                return_labels=True)
        components = [heads]
        if expand_neurons:
            neurons, neuron_labels = self.stack_neuron_results(layer, pos_slice=pos_slice, return_labels=True)
        else:
            neurons, neuron_labels = self.decompose_resid(layer, mlp_input=mlp_input, mode="mlp", incl_embeds=False,
                                                          pos_slice=pos_slice, return_labels=True)
        components.append(neurons.float())
        labels = [*labels, *neuron_labels]
        for name, label in self._embedding_rows():
            components.append(_take(name, pos_slice, -2).float().expand(heads.shape[1:])[None])
            labels.append(label)
        components.append(self._gathered_bias(layer, mlp_input, expand_neurons).expand(heads.shape[1:])[None])
        labels.append("bias")
        stack = torch.cat(components)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def _embedding_rows(self) -> list[tuple[torch.Tensor, str]]:
        """The token and position embeddings as two rows where the cache holds both, else the stream block 0 reads."""
        try:
            return [(self["hook_embed"], "embed"), (self["hook_pos_embed"], "pos_embed")]
        except (KeyError, ValueError, NNterpError):
            return [(self["layer_input", 0], "embed")]

    def _gathered_bias(self, layer: int, mlp_input: bool, mlp_biases: bool) -> torch.Tensor:
        """The biases of the attention's output projections (of blocks before ``layer``, and ``layer``'s with
        ``mlp_input``) and of the MLPs' down projections (before ``layer``, with ``mlp_biases``), as each reaches the
        stream, ``[hidden]``."""
        model = self.model
        total = torch.zeros(model.hidden_size)
        parts = [(i, "attention_premix", "attention_output") for i in range(layer + (1 if mlp_input else 0))]
        parts += [(i, "mlp_neurons", "mlp_output") for i in range(layer)] if mlp_biases else []
        for i, value, output in parts:
            if not _has(model, i, output):
                continue
            if not _has(model, i, value):
                _refuse(model, "get_full_resid_decomposition", f"block {i} has no {value} to find its bias from")
            _, bias, _ = _projection(model, i, value, "get_full_resid_decomposition")
            if bias is not None:
                total = total + _contributed(model, i, output, bias.cpu()[None], "get_full_resid_decomposition")[0]
        return total


__all__ = ["CacheMethods"]
