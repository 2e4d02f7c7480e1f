"""Mixtures of experts: where the router's choice reaches a block's experts, and each (expert, neuron)'s share of
the MLP's output."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..spec.locations import At
from .checks import _far, _refuse
from .reading import _take

# what a routed block's experts receive and give, cached by run_with_cache (names=None): the tokens they read
# [batch, seq, hidden], the experts the router chose and its weights for them [batch, seq, k], their output
ROUTING = ("expert_input", "expert_indices", "expert_weights", "expert_output")


def _is_standard_experts(module: nn.Module) -> bool:
    """transformers' experts module (its class decorated by ``use_experts_implementation``): it declares its
    weights' layout (``has_gate``, ``is_transposed``, ``has_bias``) and takes the router's choice as arguments,
    ``experts(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])``."""
    return all(hasattr(module, name) for name in ("has_gate", "is_transposed", "has_bias", "down_proj")) and \
        hasattr(type(module), "_apply_gate")


def _expert_modules(model, layer: int) -> list[str]:
    """``"path (Class)"`` of every module of block ``layer`` named or typed as experts."""
    return [f"{path} ({type(module).__name__})" for path, module in model.layers[layer]._module.named_modules()
            if path and "expert" in (path.rpartition(".")[2] + type(module).__name__).lower()]


def experts_of(model, layer: int, what: str) -> tuple[str, nn.Module, dict[str, At]]:
    """Block ``layer``'s routed experts: ``(path in the block, module, where each of ``ROUTING`` is read)``, or
    ``AnalysisUnavailable`` with the reason (a dense block, or experts that do not take the router's choice as
    transformers' standard experts module does)."""
    block = model.layers[layer]._module
    attention = model.family.attention
    found = [(path, module) for path, module in block.named_modules()
             if path and not (attention and path.startswith(attention.rpartition(".")[2] + "."))
             and _is_standard_experts(module)]
    if len(found) > 1:
        _refuse(model, what, f"block {layer} has several sets of experts ({', '.join(path for path, _ in found)})")
    if not found:
        routed = _expert_modules(model, layer)
        if not routed:
            _refuse(model, what, f"block {layer} has no routed experts (its MLP, if any, is dense)")
        _refuse(model, what, f"block {layer}'s experts ({routed[0]}) are not transformers' standard experts module, "
                             "which is called with the router's choice (top_k_index, top_k_weights) and declares its "
                             "weights' layout, so where the router's choice reaches them is not known")
    path, module = found[0]
    parameters = list(inspect.signature(type(module).forward).parameters)[1:4]  # after self
    if len(parameters) < 3:
        _refuse(model, what, f"block {layer}'s experts ({type(module).__name__}) take {parameters}, not the tokens "
                             "and the router's choice")
    names = ("expert_input", "expert_indices", "expert_weights")
    locations = {name: At(path, "input", arg=k, kwarg=parameters[k]) for k, name in enumerate(names)}
    return path, module, {**locations, "expert_output": At(path, "output")}


def _expert_weight(module: nn.Module, name: str) -> torch.Tensor | None:
    """An experts module's weight ``[experts, outputs, inputs]`` (transposed where its class stores it
    ``[experts, inputs, outputs]``), or its bias ``[experts, outputs]``; float32."""
    tensor = getattr(module, name, None)
    if tensor is None:
        return None
    tensor = tensor.detach().float()
    return tensor.transpose(1, 2) if tensor.dim() == 3 and module.is_transposed else tensor


def expert_neuron_results(cache, layer: int, neuron_slice=None, pos_slice=None) -> tuple[torch.Tensor, list]:
    """Each (expert, neuron)'s share of routed block ``layer``'s MLP output, ``[experts * neurons, batch, pos,
    hidden]`` with the ``(expert, neuron)`` of each row: the router's weight of that expert for the token times
    the neuron's activation (recomputed with the experts' own gate on the tokens they read) times its column of
    the expert's down projection; zero on tokens not routed to it. Row ``e * neurons + n`` is expert ``e``'s
    neuron ``n`` (``neuron_slice`` picks among those). Checked: they sum, with the experts' down-projection biases
    weighted as the router weighs them, to the experts' output; and the MLP adds that output to the rest of its
    own (a shared expert) unchanged, which is what its module returns with the experts' down projection zeroed."""
    model = cache.model
    what = "stack_neuron_results"
    path, experts, _ = experts_of(model, layer, what)
    label = f"block {layer}'s experts ({type(experts).__name__})"
    if getattr(experts, "has_post_expert_norm", False):
        _refuse(model, what, f"{label} norm each expert's output, so its neurons do not sum to it")
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    up, down = _expert_weight(experts, up_name), _expert_weight(experts, "down_proj")
    if up is None or down is None or up.dim() != 3 or down.dim() != 3 or "meta" in (up.device.type, down.device.type):
        _refuse(model, what, f"{label} have no {up_name} and down_proj weights loaded here, one matrix per expert")
    up_bias = _expert_weight(experts, f"{up_name}_bias") if experts.has_bias else None
    down_bias = _expert_weight(experts, "down_proj_bias") if experts.has_bias else None
    x = _take(cache["expert_input", layer], pos_slice, -2).float()  # [batch, pos, features]
    index = _take(cache["expert_indices", layer], pos_slice, -2)  # [batch, pos, k]
    weight = _take(cache["expert_weights", layer], pos_slice, -2).float()
    count, hidden, neurons = down.shape
    device = x.device
    up, down = up.to(device), down.to(device)
    # per token and expert: the router's weight (zero where the token is not routed to it), and its neurons'
    # activations times that weight
    chosen = (index[..., None] == torch.arange(count, device=index.device)).to(device)  # [batch, pos, k, experts]
    gate = (weight.to(device)[..., None] * chosen).sum(-2)  # [batch, pos, experts]
    weighted = x.new_zeros((*x.shape[:-1], count, neurons))
    with torch.no_grad():
        for e in range(count):
            routed = chosen[..., e].any(-1)  # [batch, pos]
            if not routed.any():
                continue
            projected = x[routed] @ up[e].t() + (0 if up_bias is None else up_bias[e].to(device))
            activation = experts._apply_gate(projected) if experts.has_gate else experts.act_fn(projected)
            weighted[routed, e] = gate[routed, e, None] * activation.float()
    total = torch.einsum("...en,ehn->...h", weighted, down)
    if down_bias is not None:
        total = total + gate @ down_bias.to(device)
    output = _take(cache["expert_output", layer], pos_slice, -2)
    if total.shape != output.shape:
        _refuse(model, what, f"{label} give {list(output.shape)}, their neurons {list(total.shape)}")
    difference = _far(total, output, output.dtype)
    if difference is not None:
        _refuse(model, what, f"{label} do not compute, per expert, down_proj(gate(up_proj(x))) weighted by the "
                             f"router (relative difference {difference:.2g}), so their neurons do not sum to their "
                             "output")
    _experts_added_unchanged(cache, layer, path, experts, label)
    rows = _take(torch.arange(count * neurons), neuron_slice, 0).reshape(-1)
    per_row = weighted.flatten(-2)[..., rows.to(device)]  # [batch, pos, rows]
    columns = down.transpose(1, 2).reshape(count * neurons, hidden)[rows.to(device)]  # [rows, hidden]
    pairs = [(int(r) // neurons, int(r) % neurons) for r in rows]
    return (per_row[..., None] * columns).movedim(-2, 0), pairs


def _experts_added_unchanged(cache, layer: int, path: str, experts: nn.Module, label: str) -> None:
    """Refuse unless block ``layer``'s ``mlp_output`` is the experts' output added unchanged to the rest of the
    module that calls them: that module, called on its cached input with the experts' down projection (and its bias)
    zeroed, gives the rest (a shared expert, or nothing), and the rest plus the experts' output is ``mlp_output``."""
    model = cache.model
    what = "stack_neuron_results"
    caller, _, name = path.rpartition(".")
    where = {value: model.location(layer, value) for value in ("mlp_input", "mlp_output")}
    plain = all(at.path == caller and not at.op and at.side == side and not (at.views or at.join)
                for at, side in zip(where.values(), ("input", "output")))
    if not plain:
        _refuse(model, what, f"block {layer}'s mlp_output ({where['mlp_output'].describe()}) is not what the module "
                             f"that calls its experts ({caller or 'the block'}) returns for mlp_input "
                             f"({where['mlp_input'].describe()}): the block computes more with the experts' output, "
                             "so their neurons do not sum to mlp_output")
    module = model.layers[layer]._module.get_submodule(caller)
    zeroed = {f"{name}.down_proj": torch.zeros_like(experts.down_proj)}
    if experts.has_bias and getattr(experts, "down_proj_bias", None) is not None:
        zeroed[f"{name}.down_proj_bias"] = torch.zeros_like(experts.down_proj_bias)
    output = cache["mlp_output", layer]
    try:
        with torch.no_grad():
            rest = torch.func.functional_call(module, zeroed, (cache["mlp_input", layer],))
    except Exception as error:
        _refuse(model, what, f"block {layer}'s {caller} ({type(module).__name__}) cannot be called on mlp_input "
                             f"alone ({type(error).__name__}: {error}), so how it adds its experts' output is not "
                             "checked")
    rest = rest[where["mlp_output"].index] if isinstance(rest, (tuple, list)) else rest
    routed = cache["expert_output", layer]
    if rest.shape != output.shape or routed.shape != output.shape:
        _refuse(model, what, f"{label} give {list(routed.shape)}, mlp_output is {list(output.shape)}: the MLP "
                             "projects their output")
    difference = _far(rest.float() + routed.float(), output, output.dtype)
    if difference is not None:
        _refuse(model, what, f"block {layer}'s {caller} ({type(module).__name__}) changes its experts' output before "
                             f"it returns it (relative difference {difference:.2g}: a scale, a norm or a gate), so "
                             "their neurons do not sum to mlp_output")
