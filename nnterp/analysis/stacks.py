"""Each attention head's and each MLP neuron's share of the stream (``stack_head_results``,
``stack_neuron_results``), each as it reaches the stream, checked against the sublayer's output."""

from __future__ import annotations

import torch
from torch import nn

from ..spec.locations import At
from .blocks import _available, added_factor, block_sum
from .checks import _far, _refuse
from .experts import _expert_modules, expert_neuron_results
from .norms import apply_ln_to_stack
from .reading import _layer, _take, _warn_if_pads, stream_at


def _projection(model, layer: int, value: str, what: str) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """``(weight [hidden, inputs], bias, path)`` of the linear map whose input is ``value`` of block ``layer``."""
    location = model.location(layer, value)
    if location.op or location.side != "input":
        _refuse(model, what, f"block {layer}'s {value} is not the input of one module")
    module = model.layers[layer]._module.get_submodule(location.path)
    if isinstance(module, nn.Linear):
        weight = module.weight
    elif type(module).__name__ == "Conv1D":  # GPT-2's: weight [inputs, outputs]
        weight = module.weight.t()
    else:
        _refuse(model, what, f"block {layer}'s {location.path} ({type(module).__name__}) is not one linear projection")
    if weight.device.type == "meta":
        _refuse(model, what, f"block {layer}'s {location.path} weights are not loaded here (meta)")
    if weight.shape[0] != model.hidden_size:
        _refuse(model, what, f"block {layer}'s {location.path} maps to {weight.shape[0]} features, not the stream's "
                             f"{model.hidden_size}")
    bias = getattr(module, "bias", None)
    return weight.detach().float(), None if bias is None else bias.detach().float(), location.path


def _sublayer_output_check(model, layer, total, output, path, value, what):
    difference = _far(total, output, output.dtype)
    if difference is not None:
        _refuse(model, what, f"block {layer}'s {value} is not its projection {path}'s output (relative difference "
                             f"{difference:.2g}): the block norms, scales or gates it after the projection, so the "
                             "projection's parts do not sum to it")


def _contributed(model, layer: int, name: str, rows: torch.Tensor, what: str) -> torch.Tensor:
    """``rows`` (shares of block ``layer``'s ``name``) as its identity adds ``name`` to the stream (a scale the identity
    puts on it; Granite's factor is in its contributions themselves). A block whose identity is not the stream plus contributions (a gate or scalar on the
    stream, a norm after the add: post-norm OPT) is refused, as ``decompose_resid`` refuses it: no head or neuron
    there adds a fixed row to the stream."""
    block = block_sum(model, layer, what)
    term = block.term(name)
    if term is None:
        _refuse(model, what, f"block {layer}'s identity, {model.block_spec(layer).formula}, does not add its {name} "
                             "to the stream")
    return block.reaching(term, rows)


def _has(model, layer: int, name: str) -> bool:
    return isinstance(model.block_spec(layer).resolve(name), At)


def head_results(cache, layer: int, pos_slice=None) -> torch.Tensor:
    """Each head's share of block ``layer``'s attention output, ``[heads, batch, pos, hidden]``: its slice of
    ``attention_premix`` through its columns of the output projection (times the factor the block adds the
    projection's output with: Granite's ``residual_multiplier``). They sum, with the projection's bias (times that
    factor), to ``attention_output`` (within rounding), which is checked."""
    model = cache.model
    what = "stack_head_results"
    weight, bias, path = _projection(model, layer, "attention_premix", what)
    premix = _take(cache["attention_premix", layer], pos_slice, 1).float()  # [batch, pos, heads, head_dim]
    heads, head_dim = premix.shape[-2:]
    if weight.shape[1] != heads * head_dim:
        _refuse(model, what, f"block {layer}'s {path} reads {weight.shape[1]} features, not the {heads} heads' "
                             f"{heads * head_dim}")
    per_head = weight.to(premix.device).view(weight.shape[0], heads, head_dim)
    factor = added_factor(model, layer, "attention_output")
    results = torch.einsum("...hd,ohd->h...o", premix, per_head) * factor
    total = results.sum(0) + (0 if bias is None else bias.to(premix.device) * factor)
    output = _take(cache["attention_output", layer], pos_slice, -2)
    _sublayer_output_check(model, layer, total, output, path, "attention_output", what)
    return results


def neuron_results(cache, layer: int, neuron_slice=None, pos_slice=None) -> torch.Tensor:
    """Each MLP neuron's share of block ``layer``'s MLP output, ``[neurons, batch, pos, hidden]``: ``mlp_neurons``
    times its column of the down projection (times the factor the block adds the projection's output with). All of
    them sum, with the projection's bias (times that factor), to ``mlp_output`` (within rounding), which is checked."""
    model = cache.model
    what = "stack_neuron_results"
    weight, bias, path = _projection(model, layer, "mlp_neurons", what)
    neurons = _take(cache["mlp_neurons", layer], pos_slice, -2).float()  # [batch, pos, neurons]
    weight = weight.to(neurons.device)
    if weight.shape[1] != neurons.shape[-1]:
        _refuse(model, what, f"block {layer}'s {path} reads {weight.shape[1]} features, not its "
                             f"{neurons.shape[-1]} mlp_neurons")
    factor = added_factor(model, layer, "mlp_output")
    total = (neurons @ weight.t() + (0 if bias is None else bias.to(neurons.device))) * factor
    output = _take(cache["mlp_output", layer], pos_slice, -2)
    _sublayer_output_check(model, layer, total, output, path, "mlp_output", what)
    chosen = _take(torch.arange(neurons.shape[-1]), neuron_slice, 0).reshape(-1)
    columns = weight.t()[chosen.to(weight.device)] * factor  # [neurons, hidden]
    return (neurons[..., chosen.to(neurons.device), None] * columns).movedim(-2, 0)


def _stack_of(cache, per_layer, layer, incl_remainder, pos_slice, apply_ln, return_labels):
    """Rows of every block before ``layer`` (TransformerLens's range), the remainder of the stream, and the norm."""
    parts = [(rows, labels) for rows, labels in per_layer if len(labels)]
    stream = _take(stream_at(cache, layer), pos_slice, -2).float()
    stack = torch.cat([rows for rows, _ in parts]) if parts else stream.new_zeros((0, *stream.shape))
    labels = [label for _, part in parts for label in part]
    if (incl_remainder or apply_ln) and stack.shape[1:] != stream.shape:
        _refuse(cache.model, "incl_remainder and apply_ln", f"the stream at layer {layer} has shape "
                f"{list(stream.shape)}, the blocks' rows {list(stack.shape[1:])}: the model adds positions or streams "
                "the values do not hold")
    if incl_remainder:
        stack = torch.cat([stack, (stream - stack.sum(0))[None]])
        labels.append("remainder")
    if apply_ln:  # as many rows as TransformerLens's: the norm's bias is no row
        stack, labels = apply_ln_to_stack(cache, stack, layer, pos_slice=pos_slice, labels=labels)
    return (stack, labels) if return_labels else stack


def stack_head_results(cache, layer: int | None = -1, return_labels: bool = False, incl_remainder: bool = False,
                       pos_slice=None, apply_ln: bool = False):
    """Every attention head's share of the stream, for the blocks before ``layer`` (-1 or None: all):
    ``[heads, batch, pos, hidden]``, labelled ``L{i}H{h}`` (``head_results``), each as it reaches the stream
    (Granite's times its ``residual_multiplier``): a block's heads and its projection's bias sum to its row of
    ``decompose_resid``. A block whose token mixer is not attention has none; a family whose blocks are not the
    stream plus contributions is refused, as ``decompose_resid`` is. ``incl_remainder`` adds the rest of the
    stream at ``layer`` (embeddings, projection biases, MLPs, other mixers) as ``remainder``; ``apply_ln`` passes the rows through the norm that reads that
    stream, frozen (``apply_ln_to_stack``: as many rows; with the remainder they sum to the normed stream less the
    norm's bias)."""
    model = cache.model
    _warn_if_pads(cache, pos_slice, "stack_head_results")
    layer = _layer(model, layer, "stack_head_results")
    per_layer = []
    for i in range(layer):
        if not _has(model, i, "attention_output"):
            continue  # a token mixer that is not attention: no heads
        _available(model, i, "attention_premix", "stack_head_results")
        results = head_results(cache, i, pos_slice)  # checked against attention_output first: its reason first
        results = _contributed(model, i, "attention_output", results, "stack_head_results")
        per_layer.append((results, [f"L{i}H{h}" for h in range(results.shape[0])]))
    return _stack_of(cache, per_layer, layer, incl_remainder, pos_slice, apply_ln, return_labels)


def stack_neuron_results(cache, layer: int | None, pos_slice=None, neuron_slice=None, return_labels: bool = False,
                         incl_remainder: bool = False, apply_ln: bool = False):
    """Every MLP neuron's share of the stream, for the blocks before ``layer`` (-1 or None: all):
    ``[neurons, batch, pos, hidden]``, labelled ``L{i}N{n}`` (``neuron_results``), each as it reaches the stream
    (as ``stack_head_results``'s heads); ``neuron_slice`` picks the
    neurons of each block. A routed mixture of experts gives each expert's neurons, ``L{i}E{e}N{n}``
    (``expert_neuron_results``: the router's weight times the activation times the down projection's column, zero
    on tokens not routed to the expert), numbered expert by expert for ``neuron_slice`` (``e * neurons + n``); its
    experts' biases and a shared expert are in the remainder. A block without an MLP has none. ``incl_remainder``
    and ``apply_ln`` as in ``stack_head_results``. This is large: ``layers x neurons`` rows of the stream's size
    (``x experts`` on a routed block)."""
    model = cache.model
    what = "stack_neuron_results"
    _warn_if_pads(cache, pos_slice, what)
    layer = _layer(model, layer, what)
    per_layer = []
    for i in range(layer):
        if not _has(model, i, "mlp_output"):
            continue  # no MLP adds to the stream here
        if not _has(model, i, "mlp_neurons"):
            if not _expert_modules(model, i):  # a dense MLP without them: its own reason
                _available(model, i, "mlp_neurons", what)
            rows, pairs = expert_neuron_results(cache, i, neuron_slice, pos_slice)
            labels = [f"L{i}E{e}N{n}" for e, n in pairs]
        else:
            rows = neuron_results(cache, i, neuron_slice, pos_slice)
            chosen = _take(torch.arange(cache["mlp_neurons", i].shape[-1]), neuron_slice, 0).reshape(-1)
            labels = [f"L{i}N{int(n)}" for n in chosen]
        per_layer.append((_contributed(model, i, "mlp_output", rows, what), labels))
    return _stack_of(cache, per_layer, layer, incl_remainder, pos_slice, apply_ln, return_labels)
