"""``HookPoint`` and ``HookedRootModule`` for users' own modules, as TransformerLens's Main Demo builds one: a
``HookPoint`` is an identity module whose output hooks may read or replace; a ``HookedRootModule`` names its hook
points (``setup()``) and runs itself with hooks (``run_with_hooks``) or caching them (``run_with_cache``).

These are plain PyTorch modules the user writes, so their hooks are PyTorch's own (forward hooks, and backward hooks
on the gradient of a hook point's output); a language model wrapped by nnterp is hooked through
``HookedTransformer``'s methods instead."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable

import torch
from torch import nn


class HookPoint(nn.Module):
    """An identity module: ``self.hook_x = HookPoint()`` in ``__init__``, ``x = self.hook_x(x)`` in ``forward``.
    ``add_hook(fn)`` calls ``fn(tensor, hook=self)`` on what passes through (``dir="bwd"``: on its gradient); a
    returned tensor replaces it. ``name`` is set by the root's ``setup()``; ``ctx`` is a dictionary the hooks may
    keep things in."""

    def __init__(self):
        nn.Module.__init__(self)
        self.name: str | None = None
        self.ctx: dict = {}
        self._handles: list[tuple[torch.utils.hooks.RemovableHandle, str, bool, int | None]] = []

    def forward(self, x):
        return x

    def layer(self) -> int:
        """The block this hook point belongs to, read from its name (``blocks.3.hook_x`` -> 3)."""
        match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", self.name or "")
        if match is None:
            raise ValueError(f"The hook point {self.name!r} has no layer in its name.")
        return int(match.group(1))

    def add_hook(self, hook: Callable, dir: str = "fwd", is_permanent: bool = False, level: int | None = None,
                 prepend: bool = False) -> None:
        if dir == "fwd":
            handle = self.register_forward_hook(lambda module, args, output: hook(output, hook=self),
                                                prepend=prepend)
        elif dir == "bwd":
            handle = self.register_full_backward_hook(
                lambda module, grad_in, grad_out: _as_grad(hook(grad_out[0], hook=self)), prepend=prepend)
        else:
            raise ValueError(f"dir is 'fwd' or 'bwd', not {dir!r}.")
        self._handles.append((handle, dir, is_permanent, level))

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False, level: int | None = None) -> None:
        if dir not in ("fwd", "bwd", "both"):
            raise ValueError(f"dir is 'fwd', 'bwd' or 'both', not {dir!r}.")
        kept = []
        for handle, side, permanent, made_at in self._handles:
            if dir in (side, "both") and (including_permanent or not permanent) and (level is None or made_at == level):
                handle.remove()
            else:
                kept.append((handle, side, permanent, made_at))
        self._handles = kept

    def clear_context(self) -> None:
        self.ctx = {}


def _as_grad(result):
    return None if result is None else (result,)


def names_predicate(names) -> Callable[[str], bool]:
    """TransformerLens's names_filter (None, a name, names or a predicate) as a predicate on hook names."""
    if names is None:
        return lambda name: True
    if callable(names):
        return names
    names = {names} if isinstance(names, str) else set(names)
    return names.__contains__


class HookedRootModule(nn.Module):
    """A module whose ``HookPoint`` submodules are named by ``setup()`` (call it at the end of ``__init__``):
    ``hook_dict`` (name -> hook point), ``mod_dict`` (name -> module), and TransformerLens's ``run_with_hooks``,
    ``run_with_cache``, ``hooks``, ``add_hook``, ``reset_hooks``, ``hook_points``."""

    def setup(self) -> None:
        self.mod_dict: dict[str, nn.Module] = {}
        self.hook_dict: dict[str, HookPoint] = {}
        for name, module in self.named_modules():
            if name:
                module.name = name
                self.mod_dict[name] = module
                if isinstance(module, HookPoint):
                    self.hook_dict[name] = module
        self._level = 0

    def hook_points(self):
        return self.hook_dict.values()

    def _hook_dict(self) -> dict[str, HookPoint]:
        if not hasattr(self, "hook_dict"):
            raise RuntimeError(f"{type(self).__name__} has not named its hook points: call self.setup() at the end of "
                               "its __init__, as TransformerLens's HookedRootModule needs.")
        return self.hook_dict

    def add_hook(self, name, hook: Callable, dir: str = "fwd", is_permanent: bool = False, level: int | None = None,
                 prepend: bool = False) -> None:
        """``hook`` on the hook point ``name`` (or every one a predicate over names accepts)."""
        chosen = [point for key, point in self._hook_dict().items() if (name(key) if callable(name) else key == name)]
        if not chosen and not callable(name):
            raise KeyError(f"{name!r} is no hook point of {type(self).__name__}: its hook points are "
                           f"{', '.join(self._hook_dict())}.")
        for point in chosen:
            point.add_hook(hook, dir, is_permanent, level, prepend)

    def add_perma_hook(self, name, hook: Callable, dir: str = "fwd") -> None:
        self.add_hook(name, hook, dir, is_permanent=True)

    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False,
                    level: int | None = None) -> None:
        for point in self._hook_dict().values():
            point.remove_hooks(direction, including_permanent, level)
            if clear_contexts:
                point.clear_context()

    @contextlib.contextmanager
    def hooks(self, fwd_hooks=(), bwd_hooks=(), reset_hooks_end: bool = True, clear_contexts: bool = False):
        """``with model.hooks(fwd_hooks=[(name, fn)]):`` the hooks on inside the block."""
        self._level = getattr(self, "_level", 0) + 1
        level = self._level
        try:
            for name, hook in fwd_hooks:
                self.add_hook(name, hook, "fwd", level=level)
            for name, hook in bwd_hooks:
                self.add_hook(name, hook, "bwd", level=level)
            yield self
        finally:
            if reset_hooks_end:
                self.reset_hooks(clear_contexts, including_permanent=False, level=level)
            self._level = level - 1

    def run_with_hooks(self, *model_args, fwd_hooks=(), bwd_hooks=(), reset_hooks_end: bool = True,
                       clear_contexts: bool = False, **model_kwargs):
        """``self(*model_args, **model_kwargs)`` with the hooks on."""
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts):
            return self(*model_args, **model_kwargs)

    def run_with_cache(self, *model_args, names_filter=None, remove_batch_dim: bool = False,
                       reset_hooks_end: bool = True, clear_contexts: bool = False, **model_kwargs):
        """``(output, cache)``: the output, and what passed through each hook point ``names_filter`` chooses (all by
        default), by name, detached (without the batch dimension with ``remove_batch_dim``)."""
        cache: dict[str, torch.Tensor] = {}
        keep = names_predicate(names_filter)

        def save(tensor, hook):
            cache[hook.name] = (tensor[0] if remove_batch_dim else tensor).detach()

        hooks = [(name, save) for name in self._hook_dict() if keep(name)]
        with self.hooks(hooks, (), reset_hooks_end, clear_contexts):
            output = self(*model_args, **model_kwargs)
        return output, cache


__all__ = ["HookPoint", "HookedRootModule"]
