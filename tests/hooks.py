"""Ground truth for the tests: plain PyTorch forward hooks on the unwrapped model, per call of each module."""

from __future__ import annotations

import torch


def output_tensor(out):
    """A module's output tensor: the first element where it returns a tuple or a list."""
    return out[0] if isinstance(out, (tuple, list)) else out


def capture_calls(hf_model, blocks, places, ids, **forward):
    """One plain forward pass of ``hf_model`` on ``ids`` with hooks: ``(calls, {(layer, run, name): tensor}, logits)``.

    ``blocks`` are the block modules in the standard order; ``places`` is ``{name: (path, side)}`` (a path relative
    to the block, "" the block itself), or a function of the block module giving it. ``side`` is ``"in"`` (the
    stream argument: the first positional one, or ``hidden_states``), ``"inN"`` (positional argument N) or
    ``"out"`` (the output, its first element where a tuple or a list); a third element names a block attribute the
    block's code multiplies that tensor by as it adds it (the value is the product). ``calls`` lists the blocks in the
    order the forward calls them; run k of a place is its k-th call. Each tensor is a clone: later in-place adds leave
    it.
    """
    calls, captured, handles, runs = [], {}, [], {}
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: calls.append(i)))
        for name, (path, side, *scale) in (places(block) if callable(places) else places).items():
            module = block.get_submodule(path) if path else block
            factor = getattr(block, scale[0]) if scale else None

            def record(tensor, i=i, name=name, factor=factor):
                run = runs[(i, name)] = runs.get((i, name), -1) + 1
                tensor = tensor if factor is None else tensor * factor
                captured[(i, run, name)] = tensor.detach().clone()

            if side.startswith("in"):
                arg = int(side[2:] or 0)
                handles.append(module.register_forward_pre_hook(
                    lambda m, a, k, record=record, arg=arg: record(a[arg] if len(a) > arg else k["hidden_states"]),
                    with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(lambda m, a, o, record=record: record(output_tensor(o))))
    try:
        with torch.no_grad():
            logits = hf_model(input_ids=ids, **forward).logits
    finally:
        for handle in handles:
            handle.remove()
    return calls, captured, logits


def capture_once(hf_model, blocks, places, ids, **forward):
    """``({(layer, name): tensor}, logits)`` of a model that calls each block once, in order (checked)."""
    calls, captured, logits = capture_calls(hf_model, blocks, places, ids, **forward)
    assert calls == list(range(len(blocks))), "a block ran more than once, or out of order"
    assert all(run == 0 for _, run, _ in captured), "a place ran more than once in its block's call"
    return {(i, name): tensor for (i, run, name), tensor in captured.items()}, logits


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (tuple, list):  # a named tuple or a model output stays as it is
        return type(value)(_cloned(item) for item in value)
    return value


def first_calls(hf_model, modules: dict, ids, **forward) -> dict[str, tuple]:
    """One plain forward pass of ``hf_model`` on ``ids`` with a forward hook on each of ``modules`` (``{name:
    module}``): ``{name: (args, output)}`` of each module's first call, its tensors cloned (later in-place adds leave
    them)."""
    got, handles = {}, []
    for name, module in modules.items():
        def hook(module, args, output, name=name):
            if name not in got:
                got[name] = (_cloned(args), _cloned(output))
        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf_model(input_ids=ids, **forward)
    finally:
        for handle in handles:
            handle.remove()
    return got


def scaled_edit(edit, factor: float):
    """``edit`` of a value the block adds as a module's tensor times ``factor``, as a hook on that tensor makes it: the
    product edited, the changed elements divided back by the factor, the others the module's own (plus a zero through
    which a gradient reaches the product)."""
    def on_module(t):
        product = t * factor
        changed = edit(product.clone())
        divided = changed / factor
        return torch.where(changed == product, t.detach() + (divided - divided.detach()), divided)
    return on_module


def logits_with_edit(hf_model, module, side: str, edit, ids, **forward) -> torch.Tensor:
    """The plain model's logits with ``edit`` (a function giving a new tensor) applied at ``module``: to its stream
    argument (``side="in"``: the first positional one) or to its output (``"out"``: the first element where it returns
    a tuple or a list)."""
    def pre(module, args):
        return (edit(args[0]), *args[1:])

    def post(module, args, out):
        if isinstance(out, list):
            return [edit(out[0]), *out[1:]]
        return (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out)

    handle = module.register_forward_pre_hook(pre) if side == "in" else module.register_forward_hook(post)
    try:
        with torch.no_grad():
            return hf_model(input_ids=ids, **forward).logits
    finally:
        handle.remove()
