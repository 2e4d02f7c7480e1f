"""TransformerLens's hooks on a standardized model: ``run_with_hooks``, ``with model.hooks(...)``, and the hooks
that stay on, ``model.add_hook(name, fn)`` until ``model.reset_hooks()``.

A hook is ``(name or predicate over names, fn)``; ``fn(tensor, hook)`` is called on the hook point's value in the
forward pass (``hook.name`` its name, ``hook.layer()`` its block, ``hook.ctx`` a dictionary kept until the hooks are
reset with ``clear_contexts``), and may edit it in place or return a tensor that replaces it. The hook points are read
in the order the model computes them (``nnterp.tools.hook_points``), so any order of hooks works. The hooks on the
model (``add_hook``, and those of the ``with model.hooks(...)`` blocks around the call) run in every pass
TransformerLens's methods make (``model(...)`` on a ``HookedTransformer``, ``run_with_hooks``, ``run_with_cache``,
``run_with_saes``, ``generate``, and on a ``HookedTransformer`` ``activation_patching``), before the call's own, in the
order they were added, as TransformerLens registers them; not in ``model.trace`` or nnterp's other tools, whose edits
are written in the trace. A hook may name an attached SAE's own values (``f"{hook}.hook_sae_acts_post"``, SAELens's
names). A backward hook (``dir="bwd"``, ``bwd_hooks=``) is called as ``fn(grad, hook)`` with the gradient of the hook
point's value when a loss computed from a pass of those methods is backpropagated (a tensor hook on the value of the
pass, ``tensor.register_hook``), until the hooks are reset, as TransformerLens's module hooks are; a returned tensor
replaces the gradient.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import nnsight
import torch

from ...tools import hook_passes
from ...tools.activation_cache import _inputs, _refuse_foreign_arguments, _returned, _standard_point, lm_loss
from .installed import InstalledHook, _installed, _names_sae_value, _publish, backward_hooks, context_hooks


def add_hook(model, name, hook: Callable, dir: str = "fwd", is_permanent: bool = False, level: int | None = None,
             prepend: bool = False) -> None:
    """TransformerLens's ``model.add_hook(name_or_predicate, fn)``: ``fn`` is called on those hook points in every
    later pass of TransformerLens's methods, until ``model.reset_hooks()`` (``is_permanent=True``: until
    ``reset_hooks(including_permanent=True)``). ``prepend=True`` runs it before the hooks already there."""
    if dir not in ("fwd", "bwd"):
        raise ValueError(f"dir is 'fwd' or 'bwd', not {dir!r}.")
    _check(model, name, hook, dir)  # a bad name or function says so here, not at the next pass
    entry = InstalledHook(name, hook, bool(is_permanent), level, dir)
    installed = _installed(model)
    _publish(model, [entry, *installed] if prepend else [*installed, entry])


def _sae_entries(model, names) -> list[str]:
    """The attached SAEs' own values (``...hook_sae_acts_post``) that a hook name or predicate chooses."""
    from .saes import SAE_ENTRIES, attached_saes

    entries = [f"{one.prefix}.{entry}" for one in attached_saes(model).values() for entry in SAE_ENTRIES]
    return [e for e in entries if (names(e) if callable(names) else names == e)]


def _check(model, names, fn, dir: str) -> None:
    """A hook's name (or predicate) and function, checked before it goes on the model: an attached SAE's value it
    may hook (``saes.check_sae_hook``), or the model's own hook points (a backward hook on a point computed from the
    pass refused)."""
    if _names_sae_value(names):
        from .saes import check_sae_hook

        if not callable(fn):
            raise hook_passes.HookError(f"A hook is a pair (name or predicate over names, fn(tensor, hook)), not "
                                        f"{(names, fn)!r}.")
        check_sae_hook(model, names, dir)
        return
    for point, _ in hook_passes.hooked_points(model, [(names, fn)]):
        if dir == "bwd":
            hook_passes.refuse_backward(point)


def add_perma_hook(model, name, hook: Callable, dir: str = "fwd") -> None:
    """``add_hook(..., is_permanent=True)``: kept by ``reset_hooks()``."""
    add_hook(model, name, hook, dir, is_permanent=True)


def reset_hooks(model, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False,
                level: int | None = None) -> None:
    """TransformerLens's ``model.reset_hooks()``: remove the hooks on the model (the permanent ones too with
    ``including_permanent``; those a ``with model.hooks(...)`` block of depth ``level`` added, with ``level``), and
    with ``clear_contexts`` empty every ``hook.ctx``."""
    if direction not in ("fwd", "bwd", "both"):
        raise ValueError(f"direction is 'fwd', 'bwd' or 'both', not {direction!r}.")
    kept = [hook for hook in _installed(model) if direction not in ("both", hook.dir) or not (
        including_permanent or (not hook.permanent and (level is None or hook.level == level)))]
    _publish(model, kept)
    if clear_contexts:
        model.__dict__["_nnterp_hook_contexts"] = {}


@contextlib.contextmanager
def hooks(model, fwd_hooks=(), bwd_hooks=(), reset_hooks_end: bool = True, clear_contexts: bool = False):
    """``with model.hooks(fwd_hooks=[(name, fn)], bwd_hooks=[(name, fn)]):`` the passes inside the block call these
    hooks too (the backward hooks, a backward pass inside it); after it they are gone (kept with
    ``reset_hooks_end=False``, until ``model.reset_hooks()``)."""
    pairs = [(entry, "fwd") for entry in fwd_hooks] + [(entry, "bwd") for entry in (bwd_hooks or ())]
    for entry, dir in pairs:  # a bad name or pair says so here, before any is added
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and callable(entry[1])):
            raise hook_passes.HookError(f"A hook is a pair (name or predicate over names, fn(tensor, hook)), not "
                                        f"{entry!r}.")
        _check(model, entry[0], entry[1], dir)
    level = model.__dict__.get("_nnterp_hook_level", 0) + 1
    model.__dict__["_nnterp_hook_level"] = level
    try:
        for (name, fn), dir in pairs:
            add_hook(model, name, fn, dir, level=level)
        yield model
    finally:
        if reset_hooks_end:
            reset_hooks(model, clear_contexts, level=level)
        model.__dict__["_nnterp_hook_level"] = level - 1


def run_with_hooks(model, input, fwd_hooks=(), bwd_hooks=None, reset_hooks_end: bool = True,
                   clear_contexts: bool = False, return_type: str | None = "logits", loss_per_token: bool = False,
                   prepend_bos: bool | None = None, padding_side: str | None = None,
                   stop_at_layer: int | None = None, **kwargs):
    """One forward pass with ``fwd_hooks`` (after the hooks on the model) called on their hook points:
    TransformerLens's ``run_with_hooks``.

    ``input``: a text, a list of texts (tokenized as ``model.to_tokens`` does, with ``prepend_bos``; a batch is
    padded on ``padding_side`` and its pads masked) or token ids ``[batch, seq]`` / ``[seq]``. ``return_type``: ``"logits"``,
    ``"loss"`` (the mean next-token loss; per token with ``loss_per_token``), ``"both"`` or None;
    ``stop_at_layer=k`` returns the stream entering block ``k`` instead. The pass keeps gradients as torch's mode
    says (TransformerLens's does). The attention values are turned on for the call where a hook needs them.
    ``reset_hooks_end=False`` leaves ``fwd_hooks`` on the model afterwards, as TransformerLens does. ``bwd_hooks``
    are called with the gradients of a later backward pass from the returned value while they are on the model: with
    ``reset_hooks_end=True`` they are removed as the call ends, before any backward pass, so never called, as in
    TransformerLens (which warns so).
    """
    _refuse_foreign_arguments(kwargs, False, "run_with_hooks", "input, fwd_hooks, bwd_hooks, reset_hooks_end, "
                              "clear_contexts, return_type, loss_per_token, prepend_bos, padding_side and "
                              "stop_at_layer")
    fwd_hooks = list(fwd_hooks)
    if any(isinstance(entry, (tuple, list)) and len(entry) == 2 and _sae_entries(model, entry[0])
           for entry in fwd_hooks):  # an attached SAE's own values: hooked inside its splice, for this call
        if not reset_hooks_end:
            raise TypeError("run_with_hooks(reset_hooks_end=False) with hooks on an SAE's values: those run for one "
                            "call only.")
        from .saes import run_with_hooks_with_saes

        return run_with_hooks_with_saes(model, input, fwd_hooks=fwd_hooks, clear_contexts=clear_contexts,
                                        return_type=return_type, loss_per_token=loss_per_token,
                                        prepend_bos=prepend_bos, padding_side=padding_side,
                                        stop_at_layer=stop_at_layer)
    with hooks(model, fwd_hooks, bwd_hooks or (), reset_hooks_end, clear_contexts):
        if bwd_hooks and reset_hooks_end:
            warnings.warn("run_with_hooks(bwd_hooks=...) with reset_hooks_end=True: the hooks are reset as the call "
                          "ends, before a backward pass can call the backward hooks (as in TransformerLens); pass "
                          "reset_hooks_end=False and call model.reset_hooks() after the backward pass.", stacklevel=2)
        return forward(model, input, context_hooks(model), return_type, loss_per_token, prepend_bos, stop_at_layer,
                       padding_side)


def forward(model, input, fwd_hooks, return_type="logits", loss_per_token=False, prepend_bos=None, stop_at_layer=None,
            padding_side=None):
    """The pass of ``run_with_hooks`` (and of a ``HookedTransformer``'s ``model(input)``), with the backward hooks on
    the model and, on the attached SAEs' values, the hooks on the model."""
    from .saes import hooked_pass

    if return_type not in ("logits", "loss", "both", None):
        raise ValueError(f"return_type is one of 'logits', 'loss', 'both' or None, not {return_type!r}.")
    stop = None if stop_at_layer is None else hook_passes.stop_block(model, stop_at_layer)
    plan = hook_passes.Plan()
    for point, fn in hook_passes.hooked_points(model, fwd_hooks):
        if hook_passes.before_stop(point, stop):  # TransformerLens never calls the hooks past the stop
            plan.add(point, fn)
    for point, fn in hook_passes.hooked_points(model, backward_hooks(model)):
        if hook_passes.before_stop(point, stop):
            plan.add_backward(point, fn)
    residual = None
    if stop is not None:
        residual = (_standard_point(model, "layer_input", stop) if stop < model.num_layers
                    else _standard_point(model, "layer_output", model.num_layers - 1))
        plan.add(residual)
    inputs = _inputs(model, input, prepend_bos, padding_side)
    with hooked_pass(model), hook_passes.attention_for(model, plan.needs_attention), model.trace(inputs):
        plan.run(model, *inputs["input_ids"].shape[:2])
        if residual is not None:
            stream = nnsight.save(residual.read(model))
        elif return_type is not None:
            logits = nnsight.save(model.logits)
    length = plan.shortened.length  # a hook returned fewer positions: TransformerLens runs on with them
    if length is not None:
        if residual is not None:
            return stream[:, :length]
        if return_type in ("loss", "both"):
            raise hook_passes.HookError(
                f"A hook returned a tensor of {length} positions for a pass of {inputs['input_ids'].shape[1]}: the "
                "model ran on with those positions, as TransformerLens's does, and their logits no longer line up "
                "with the tokens for the loss (TransformerLens's loss fails on them too). Return a tensor of the "
                "hook point's shape, or pass the tokens the hook's tensor was computed for.")
        logits = logits[:, :length]
    if residual is not None:
        return stream
    if return_type is None:
        return None
    if loss_per_token and return_type in ("loss", "both"):
        loss = lm_loss(logits, inputs["input_ids"], inputs["attention_mask"], per_token=True)
        return loss if return_type == "loss" else (logits, loss)
    return _returned(model, logits, inputs["input_ids"], inputs["attention_mask"], return_type)


def loss_per_token(model, input, prepend_bos: bool | None = None) -> torch.Tensor:
    """The next-token loss at each position, ``[batch, seq - 1]`` (0 where it or the token it predicts is a pad)."""
    return forward(model, input, context_hooks(model), "loss", True, prepend_bos)


def loss_fn(model, logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
            per_token: bool = False) -> torch.Tensor:
    """TransformerLens's ``model.loss_fn(logits, tokens, attention_mask=None, per_token=False)``: minus the
    log-probability of each next token, ``[batch, seq - 1]`` with ``per_token`` (0 where ``attention_mask`` masks it
    or the token it predicts), else its mean over the real predictions."""
    tokens = torch.as_tensor(tokens)
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"loss_fn takes logits [batch, seq, vocab] and their tokens [batch, seq], not "
                         f"{tuple(logits.shape)} and {tuple(tokens.shape)}.")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(tokens.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, the tokens {tuple(tokens.shape)}.")
    return lm_loss(logits, tokens, attention_mask, per_token=per_token)


# TransformerLens's switches for hook points it computes only when asked; nnterp serves them always, or never
def set_use_attn_result(model, use_attn_result: bool) -> None:
    """TransformerLens's switch for ``attn.hook_result``: nnterp always serves it (computed from ``hook_z`` and the
    output projection, read-only), so this changes nothing."""


def set_use_hook_mlp_in(model, use_hook_mlp_in: bool) -> None:
    """TransformerLens's switch for ``hook_mlp_in``: nnterp always serves it, so this changes nothing."""


def _refuse_attn_in(model, use: bool = True) -> None:
    if use:
        raise TypeError("TransformerLens's hook_attn_in (one copy of the stream per head, feeding that head's queries, "
                        "keys and values at once) is not served: use model.set_use_split_qkv_input(True) and "
                        "hook_q_input / hook_k_input / hook_v_input, which nnterp serves, or patch a head's own values "
                        "(attn.hook_q / hook_k / hook_v / hook_z, per head).")


# (set_use_split_qkv_input is nnterp.compat.transformer_lens.split_inputs's)
SWITCHES = {"set_use_attn_result": set_use_attn_result, "set_use_hook_mlp_in": set_use_hook_mlp_in,
            "set_use_attn_in": _refuse_attn_in}
