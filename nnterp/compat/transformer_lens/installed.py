"""The hooks left on a model (``add_hook``, ``with model.hooks(...)``): what each is, where the passes read them, and
which of them an attached SAE's values get (``nnterp.compat.transformer_lens.saes``). One module both the hook
functions and the SAEs read, so neither imports the other."""

from __future__ import annotations

from collections.abc import Callable


class InstalledHook:
    """A hook on the model: its names (a name or a predicate), its function, whether ``reset_hooks()`` keeps it
    (``permanent``), the ``with model.hooks(...)`` depth that added it (None: ``add_hook``) and its direction
    (``"fwd"`` or ``"bwd"``)."""

    __slots__ = ("names", "fn", "permanent", "level", "dir")

    def __init__(self, names, fn: Callable, permanent: bool = False, level: int | None = None, dir: str = "fwd"):
        self.names, self.fn, self.permanent, self.level, self.dir = names, fn, permanent, level, dir

    def __repr__(self) -> str:
        return (f"InstalledHook({self.names!r}, {self.fn!r}, permanent={self.permanent}, level={self.level}, "
                f"dir={self.dir!r})")


def _installed(model) -> list[InstalledHook]:
    return model.__dict__.setdefault("_nnterp_installed_hooks", [])


def _publish(model, installed: list[InstalledHook]) -> None:
    """Store the hooks on the model, and its forward hooks on the model's own hook points as ``(names, fn)`` pairs
    where ``run_with_cache`` reads them (an SAE's values are hooked in the SAE's splice: ``sae_hooks``)."""
    model.__dict__["_nnterp_installed_hooks"] = installed
    model.__dict__["_nnterp_context_hooks"] = [(hook.names, hook.fn) for hook in installed
                                               if hook.dir == "fwd" and not _names_sae_value(hook.names)]


def _names_sae_value(names) -> bool:
    return isinstance(names, str) and ".hook_sae_" in names


def context_hooks(model) -> list:
    """The forward hooks on the model (``add_hook``, ``with model.hooks(...)``) on its own hook points, as
    ``(names, fn)`` in the order they run."""
    return list(model.__dict__.get("_nnterp_context_hooks", ()))


def backward_hooks(model) -> list:
    """The backward hooks on the model's own hook points, as ``(names, fn)``: each ``fn`` is called only while its
    hook is still on the model (``reset_hooks`` removes it, as TransformerLens removes its module hook)."""
    return [(hook.names, _while_installed(model, hook)) for hook in _installed(model)
            if hook.dir == "bwd" and not _names_sae_value(hook.names)]


def sae_hooks(model, dir: str) -> list:
    """The hooks on the model in direction ``dir`` that may choose an attached SAE's values (a name of one, or a
    predicate), as ``(names, fn)``."""
    return [(hook.names, _while_installed(model, hook) if dir == "bwd" else hook.fn) for hook in _installed(model)
            if hook.dir == dir and (callable(hook.names) or _names_sae_value(hook.names))]


def _while_installed(model, hook: InstalledHook) -> Callable:
    def call(grad, context):
        if any(entry is hook for entry in _installed(model)):
            return hook.fn(grad, context)
        return None

    return call
