"""TransformerLens's hook functions called on the hook points (``nnterp.tools.hook_points``) in one pass: what a
function is called with (``HookContext``), the functions of ``model.hooks(...)`` resolved to their points, and the
plan that reads, calls and writes them back in forward order. A backward hook is a tensor hook
(``tensor.register_hook``) on the point's value in the pass, called with its gradient when the loss is
backpropagated."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from .hook_points import HookError, Point, in_forward_order, points


class HookContext:
    """What a hook function is called with beside the tensor (TransformerLens's ``HookPoint``): ``hook.name`` the hook
    name, ``hook.layer()`` its block, ``hook.ctx`` a dictionary the function may keep things in (kept from pass to
    pass until ``model.reset_hooks()``)."""

    def __init__(self, name: str, layer: int | None):
        self.name, self._layer, self.ctx = name, layer, {}

    def layer(self) -> int:
        if self._layer is None:
            raise ValueError(f"{self.name} is the model's own hook point, not a block's: it has no layer.")
        return self._layer

    def __repr__(self) -> str:
        return f"HookContext({self.name!r})"


def hooked_points(model, hooks) -> list[tuple[Point, Callable]]:
    """``[(name or predicate, fn)]`` as ``[(point, fn)]``: a predicate is every hook name of the model it accepts."""
    pairs = []
    for entry in hooks:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and callable(entry[1])):
            raise HookError(f"A hook is a pair (name or predicate over names, fn(tensor, hook)), not {entry!r}.")
        names, fn = entry
        pairs.extend((point, fn) for point in points(model, names))
    return pairs


def apply(model, point: Point, value: torch.Tensor, fns: list[Callable], fit: Callable | None = None) -> torch.Tensor:
    """Inside a trace: call each of ``fns`` as ``fn(tensor, hook)`` on ``point``'s value, in order, each on what the
    one before left; a returned tensor replaces the value (written to the model once, after them, through ``fit``
    where given), None keeps the tensor (edited in place, it reaches the model as an edit of the value does). A
    computed point refuses an edit."""
    if not fns:
        return value
    context = HookContext(point.name, point.layer)
    # TransformerLens keeps a hook point's ctx from pass to pass, until the hooks are reset with clear_contexts
    context.ctx = model.__dict__.setdefault("_nnterp_hook_contexts", {}).setdefault(point.name, {})
    before = value.clone() if point.read_only else None
    current = call_in_turn(fns, value, context)
    if point.read_only:
        if not (torch.equal(value, before) and (current is value or torch.equal(current, before))):
            raise point.refuse_edit()
        return value
    if current is not value or getattr(point, "copy", False):  # a copy's in-place edit reaches the model written back
        if fit is not None and current is not value:
            current = fit(current)
        point.write(model, current)
    return current


def call_in_turn(fns: list[Callable], tensor: torch.Tensor, context: HookContext, what: str = "value"):
    """Each of ``fns`` called as ``fn(tensor, hook)``, in order, on what the one before left: a returned tensor
    replaces it, None keeps it (edited in place or not). What the last one left."""
    current = tensor
    for fn in fns:
        result = fn(current, context)
        if result is not None and result is not current:
            if not isinstance(result, torch.Tensor):
                raise HookError(f"A hook on {context.name} returned {type(result).__name__}: a hook returns a tensor "
                                f"(which replaces the {what}) or None (the {what} kept, edited in place or not).")
            current = result
    return current


def _positions(point: Point, length: int) -> tuple:
    """The index of a point's first ``length`` positions: the queries' and keys' of an attention pattern (scores)
    ``[batch, heads, query, key]``, else the second dimension's ``[batch, pos, ...]``."""
    if point.name.endswith(("attn.hook_pattern", "attn.hook_attn_scores")):
        return (slice(None), slice(None), slice(0, length), slice(0, length))
    return (slice(None), slice(0, length))


class Shortened:
    """TransformerLens's pass after a hook returned fewer positions than the pass has (``[batch, pos', ...]``, pos'
    < pos): the model runs on with the first pos' positions. Here the model runs on every position, the hook's tensor
    in the first pos' and the value as it was after them, which (the model being causal) gives the first pos'
    positions TransformerLens's values; the later hooks and the cache get those positions (a view: an in-place edit
    reaches the model), and the pass's logits are cut to them (``length``)."""

    def __init__(self, seq: int | None):
        self.seq, self.length = seq, None

    def view(self, point: Point, value):
        if self.length is None or not isinstance(value, torch.Tensor):
            return value
        return value[_positions(point, self.length)]

    def fit(self, point: Point, full: torch.Tensor) -> Callable:
        """The function giving what a hook returned as the model's value: itself, or, where it has fewer positions
        at the front of the sequence, those positions of the model's value replaced with it."""

        def fit(current: torch.Tensor) -> torch.Tensor:
            if self.seq is None or current.shape == full.shape or full.dim() < 2 or full.shape[1] != self.seq:
                return current
            length = current.shape[1]
            if current.dim() != full.dim() or current.shape[0] != full.shape[0] or not 0 < length < self.seq:
                return current
            index = _positions(point, length)
            if current.shape != full[index].shape:
                return current
            self.length = length if self.length is None else min(self.length, length)
            whole = full.clone()
            whole[index] = current.to(full.dtype)
            return whole

        return fit


def refuse_backward(point: Point) -> None:
    """A backward hook on a point computed from the pass (a norm's scale, each head's result): the model's graph
    does not go through it, so no gradient would reach it."""
    if point.read_only:
        raise HookError(f"A backward hook on {point.name}, which nnterp computes from the pass ({point.how}): the "
                        "model's graph does not go through it, so no gradient reaches it. Hook the gradient of "
                        f"{point.live} instead.")


def hook_gradient(model, point: Point, value: torch.Tensor, fns: list[Callable], written: bool) -> None:
    """Inside a trace: each of ``fns`` called as ``fn(grad, hook)`` with the gradient of ``point``'s value (as the
    model went on with it) when the loss is backpropagated (a tensor hook, ``value.register_hook``); a returned
    tensor replaces the gradient. A copy the model does not hold until written back (``written``: it was) is
    written back first, so that the gradient reaches it. Nothing where the pass keeps no gradients."""
    refuse_backward(point)
    if not (isinstance(value, torch.Tensor) and value.requires_grad):
        return
    if getattr(point, "copy", False) and not written:
        point.write(model, value)
    context = HookContext(point.name, point.layer)
    context.ctx = model.__dict__.setdefault("_nnterp_hook_contexts", {}).setdefault(point.name, {})
    value.register_hook(gradient_hook(fns, context))


def gradient_hook(fns: list[Callable], context: HookContext) -> Callable:
    """A tensor hook calling ``fns`` on the gradient in turn, each on what the one before returned."""

    def call(grad):
        current = call_in_turn(fns, grad, context, "gradient")
        return None if current is grad else current

    return call


class Plan:
    """The reads of one pass: each point once, in forward order, with the hook functions to call on it and whether
    its value (after them) is kept."""

    def __init__(self):
        self._points: dict[str, Point] = {}
        self._fns: dict[str, list[Callable]] = {}
        self._kept: dict[str, bool] = {}
        self._bwd: dict[str, list[Callable]] = {}

    def add_backward(self, point: Point, fn: Callable) -> None:
        """A backward hook on ``point``: called with its gradient when the pass's loss is backpropagated."""
        refuse_backward(point)
        self.add(point)
        self._bwd.setdefault(point.name, []).append(fn)

    def add(self, point: Point, fn: Callable | None = None, keep: bool = False) -> None:
        """``point`` read in the pass, ``fn`` called on it, its value kept with ``keep``. A point whose edit is
        written at a later point (``point.follow``: that point and the function writing it) brings it along, the
        function first there."""
        if point.name not in self._points and getattr(point, "follow", None) is not None:
            later, write = point.follow
            self.add(later)
            self._fns[later.name].insert(0, write)
        self._points.setdefault(point.name, point)
        self._fns.setdefault(point.name, [])
        if fn is not None:
            self._fns[point.name].append(fn)
        self._kept[point.name] = self._kept.get(point.name, False) or keep

    @property
    def needs_attention(self) -> bool:
        return any(point.needs_attention for point in self._points.values())

    def ordered(self) -> list[Point]:
        return in_forward_order(list(self._points.values()))

    def run(self, model, batch: int | None = None, seq: int | None = None) -> dict[str, torch.Tensor]:
        """Inside a trace: every point read in forward order, its hooks applied; the kept values, detached. ``batch``:
        the pass's number of prompts, to which a value the model holds once for all (``per_batch``) is expanded;
        ``seq``: its number of positions, given where a hook may return fewer (``Shortened``: the positions the pass
        kept are ``plan.shortened.length`` after it)."""
        kept = {}
        self.shortened = shortened = Shortened(seq)
        for point in self.ordered():
            value = point.read(model)
            if point.per_batch and batch is not None:
                value = value.expand(batch, *value.shape[1:]).clone()
            full, value = value, shortened.view(point, value)
            fit = shortened.fit(point, full) if seq is not None and isinstance(full, torch.Tensor) else None
            value = apply(model, point, value, self._fns[point.name], fit)
            value = shortened.view(point, value)  # the positions the pass kept (idempotent on a view)
            if self._bwd.get(point.name):
                hook_gradient(model, point, value, self._bwd[point.name], bool(self._fns[point.name]))
            if self._kept[point.name]:
                kept[point.name] = value.detach() if isinstance(value, torch.Tensor) else value
        return kept


@contextlib.contextmanager
def attention_for(model, needed: bool):
    """``with attention_for(model, needed):`` the attention values on inside the block where ``needed`` (eager
    attention), and as they were after it."""
    turn_on = needed and not model._nnterp_attention_on
    if turn_on:
        model.enable_attention_values()
    try:
        yield model
    finally:
        if turn_on:
            model.disable_attention_values()


def before_stop(point: Point, stop: int | None) -> bool:
    """Whether ``point`` runs before block ``stop`` (TransformerLens's ``stop_at_layer``: the hooks past it are never
    called): a block's before ``stop``, and the embeddings."""
    if stop is None:
        return True
    return point.layer < stop if point.layer is not None else point.name in ("hook_embed", "hook_pos_embed")


def stop_block(model, stop_at_layer: int) -> int:
    """TransformerLens's ``stop_at_layer`` as the block the pass stops before (``num_layers``: after the last),
    refused unless it is a block index from ``-num_layers`` to ``num_layers``."""
    if isinstance(stop_at_layer, bool) or not isinstance(stop_at_layer, int) or not (
            -model.num_layers <= stop_at_layer <= model.num_layers):
        raise ValueError(f"stop_at_layer is a block index from {-model.num_layers} to {model.num_layers}, "
                         f"not {stop_at_layer!r}.")
    return stop_at_layer % model.num_layers if stop_at_layer < model.num_layers else model.num_layers


__all__ = ["HookContext", "Plan", "apply", "attention_for", "before_stop", "call_in_turn", "gradient_hook",
           "hook_gradient", "hooked_points", "refuse_backward", "stop_block"]
