"""SAELens's ``HookedSAETransformer`` methods on a standardized model: SAEs spliced where SAELens splices them.

``model.run_with_saes(prompt, saes=[sae])`` runs one forward pass with each SAE spliced at its site (its
``cfg.metadata.hook_name``); ``model.run_with_cache_with_saes(prompt, saes=[sae])`` caches the pass too, with each
SAE's own values under SAELens's names (``f"{hook_name}.hook_sae_acts_post"``, ...); ``with model.saes(saes=[sae]):``
attaches them for a block, ``model.add_sae(sae)`` until ``model.reset_saes()``. A SAE is any ``nnterp.Dictionary``
(``load_dictionary`` reads SAELens's folders, sparsify's and dictionary_learning's) or a SAELens ``SAE`` object
(read by ``nnterp.dictionaries.from_saelens``, its tensors shared).

An attached SAE is an nnsight edit of the model (``model.edit(inplace=True)``): it runs in every later forward pass
of the model, ``model.trace`` and every tool of nnterp's that traces (``run_with_cache``, the lens, patching,
collection), until it is reset; in nnsight's ``model.generate`` trace it runs in the first forward pass (the prompt's)
only, and in a ``HookedTransformer``'s ``generate`` in every step (one forward pass per token). As in
SAELens, ``use_error_term=False`` (the default) makes the model go on with the reconstruction, and
``use_error_term=True`` with the reconstruction plus the error: the value itself, bit for bit, where no feature is
edited (``nnterp.splice``, which each attached SAE runs, says how).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

from ...dictionaries import Dictionary, from_saelens, transformerlens_site
from ...dictionaries.splicing import place, splice
from ...tools.activation_cache import ActivationCache, run_with_cache
from ...tools.hook_passes import HookContext, call_in_turn, gradient_hook
from .hooked_module import names_predicate
from .installed import sae_hooks

# what SAELens's HookedSAETransformer caches of each SAE, under f"{hook name}.{entry}"
SAE_ENTRIES = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
               "hook_sae_output")
RETURN_TYPES = ("logits", "loss", "both", None)


class AttachedSAE:
    """One SAE attached to a model: the dictionary, whether the model keeps its error, and the nnsight edit that
    splices it (``mediator``). ``record``, while a dict, receives the SAE's values of each pass (SAELens's names)."""

    def __init__(self, sae: Dictionary, use_error_term: bool, given=None):
        self.sae, self.use_error_term = sae, use_error_term
        self.given = sae if given is None else given  # what the user attached (a SAELens SAE, or the dictionary)
        self.record: dict | None = None
        # while a dict: the hook functions of this pass on the SAE's own values, by entry (run_with_hooks_with_saes)
        self.hooks: dict[str, list[Callable]] | None = None
        self.mediator = None

    @property
    def name(self) -> str:
        """Its name: the SAE's input hook (SAELens's ``acts_to_saes`` key), or its site's standard name."""
        return sae_name(self.sae)

    @property
    def prefix(self) -> str:
        """The prefix of its cache entries: the hook it writes (a transcoder's output hook, as SAELens places it)."""
        if self.sae.transcoder:
            return self.sae.hook_name_out or f"layers.{self.sae.out_site[0]}.{self.sae.out_site[1]}"
        return self.name


def as_dictionary(sae) -> Dictionary:
    """``sae`` as a ``Dictionary``: itself, or a SAELens ``SAE`` object read by ``from_saelens`` (its tensors
    shared)."""
    if isinstance(sae, Dictionary):
        return sae
    if hasattr(sae, "cfg") and hasattr(sae, "save_model") and hasattr(sae, "state_dict"):  # SAELens's SAE
        return from_saelens(sae)  # each time: the SAE may have been converted (.to) since
    raise TypeError(f"An SAE is an nnterp Dictionary (nnterp.load_dictionary) or a SAELens SAE, not "
                    f"{type(sae).__name__}.")


def sae_name(sae: Dictionary) -> str:
    """A dictionary's name among the attached SAEs: its TransformerLens hook name (``cfg.metadata.hook_name``), or
    ``layers.<layer>.<value>`` where no hook name reads its site."""
    sae = as_dictionary(sae)
    if sae.hook_name:
        return sae.hook_name
    if sae.site is None:
        place(None, sae)  # the reason it has no site, and how to give one
    return f"layers.{sae.site[0]}.{sae.site[1]}"


def splice_attached(model, attached: AttachedSAE) -> None:
    """The body of an attached SAE's edit: the SAE spliced in one forward pass, its values recorded when asked, and
    in a pass of TransformerLens's methods (``attached.hooks`` a dict) hooked."""
    spliced = splice(model, attached.sae, keep_error=attached.use_error_term)
    with spliced as features:
        if attached.hooks is not None:
            hook_sae_values(model, attached, spliced, features)
    if attached.record is not None:
        attached.record.update(entries(attached, spliced))


# the SAE's values a hook may edit, and where the edit reaches the model
HOOKABLE = {"hook_sae_acts_post": "the features, which the model goes on with decoded",
            "hook_sae_error": "the error, which the model goes on with added to the reconstruction"}
# the SAE's values a backward hook gets the gradient of (SAELens computes the error without gradients)
BACKWARD = ("hook_sae_acts_post",)


def _chosen(names, full: str) -> bool:
    return names(full) if callable(names) else names == full


def hook_sae_values(model, attached: AttachedSAE, spliced, features: torch.Tensor) -> None:
    """Inside the splice: each hook function on the SAE's features (then on its error, with ``use_error_term``)
    called as ``fn(tensor, hook)``, the hooks on the model (``add_hook``) first, then the call's own; an in-place edit
    or a returned tensor reaches the model. The backward hooks on the model on its features get their gradient."""
    for entry in HOOKABLE:
        full = f"{attached.prefix}.{entry}"
        if entry == "hook_sae_error" and not attached.use_error_term:
            continue
        fns = [fn for names, fn in sae_hooks(model, "fwd") if _chosen(names, full)] + attached.hooks.get(entry, [])
        bwd = [fn for names, fn in sae_hooks(model, "bwd") if _chosen(names, full)] if entry in BACKWARD else []
        if not (fns or bwd):
            continue
        context = HookContext(full, attached.sae.site[0] if attached.sae.site else None)
        value = call_in_turn(fns, features if entry == "hook_sae_acts_post" else spliced.error, context)
        if bwd and value.requires_grad:  # the gradient of the features the model goes on with
            value.register_hook(gradient_hook(bwd, context))
        if entry == "hook_sae_acts_post":
            spliced.features = value
        else:
            spliced.error = value


def check_sae_hook(model, name: str, dir: str) -> None:
    """A hook named after an SAE's value (``f"{hook}.hook_sae_acts_post"``), refused unless an attached SAE has it
    and nnterp's hooks reach it: in the forward pass ``HOOKABLE``, backward ``BACKWARD``."""
    found = [(one, entry) for one in attached_saes(model).values() for entry in SAE_ENTRIES
             if f"{one.prefix}.{entry}" == name]
    if not found:
        attached = [f"{one.prefix}.<entry>" for one in attached_saes(model).values()]
        raise KeyError(f"No attached SAE has the hook point {name!r} (attached: {', '.join(attached) or 'none'}; "
                       "attach the SAE first with model.add_sae(sae)).")
    one, entry = found[0]
    if dir == "bwd" and entry not in BACKWARD:
        raise TypeError(f"A backward hook on {name}: nnterp's backward hooks on an SAE get the gradient of its "
                        "features (hook_sae_acts_post); the SAE's other values are copies outside the model's graph "
                        "(SAELens computes hook_sae_error without gradients).")
    if dir == "fwd" and (entry not in HOOKABLE or (entry == "hook_sae_error" and not one.use_error_term)):
        raise TypeError(f"A hook on {name}: nnterp's hooks on an SAE edit {', '.join(HOOKABLE)} "
                        f"({'; '.join(HOOKABLE.values())}; hook_sae_error with use_error_term=True). Read the others "
                        "with run_with_cache_with_saes.")


@contextmanager
def hooked_pass(model):
    """``with hooked_pass(model):`` a pass of TransformerLens's methods: the hooks on the model (``add_hook``) on the
    attached SAEs' values run in it (not in a ``model.trace`` of the user's)."""
    fresh = [one for one in attached_saes(model).values() if one.hooks is None]
    for one in fresh:
        one.hooks = {}
    try:
        yield model
    finally:
        for one in fresh:
            one.hooks = None


def entries(attached: AttachedSAE, spliced) -> dict[str, torch.Tensor]:
    """SAELens's cache entries of one splice: the input (flat, in the SAE's dtype), the pre-activations, the
    features (as the hooks on them left them), the reconstruction before the input's normalization is undone, the
    error (with ``use_error_term``) and what the model went on with, in the site's own shape."""
    sae = attached.sae
    sae_input = spliced._input.to(sae.dtype)
    features = spliced.features.detach()
    found = {"hook_sae_input": sae_input, "hook_sae_acts_pre": sae._pre(sae._processed(sae_input)[0]),
             "hook_sae_acts_post": features, "hook_sae_recons": sae._recons(features)}
    if attached.use_error_term:
        found["hook_sae_error"] = spliced.error.reshape(spliced.written.shape)
    found["hook_sae_output"] = spliced.written
    return {f"{attached.prefix}.{entry}": tensor.detach() for entry, tensor in found.items()}


# -- attaching ---------------------------------------------------------------------------------------------------

def attached_saes(model) -> dict[str, AttachedSAE]:
    """The SAEs attached to ``model``, by name (an edit removed by ``model.clear_edits()`` is no longer attached)."""
    registry = model.__dict__.setdefault("_nnterp_saes", {})
    edits = model._edits
    for name in [name for name, attached in registry.items() if not any(e is attached.mediator for e in edits)]:
        del registry[name]
    return registry


def acts_to_saes(model) -> dict[str, Dictionary]:
    """SAELens's ``model.acts_to_saes``: the attached SAEs by the name of their input hook."""
    return {name: attached.given for name, attached in attached_saes(model).items()}


def add_sae(model, sae: Dictionary, use_error_term: bool | None = None) -> None:
    """Attach ``sae`` at its site until ``model.reset_saes()``, replacing an SAE attached at the same hook, as
    SAELens's ``add_sae``: it runs in every later forward pass of the model. ``use_error_term`` (default: the SAE's
    own ``use_error_term``, False) keeps the error: the model goes on with the value itself."""
    given, sae = sae, as_dictionary(sae)
    name = sae_name(sae)
    place(model, sae, "site")  # a clear error now for a site the model does not have
    if sae.transcoder:
        place(model, sae, "out_site")
    if name in attached_saes(model):
        reset_saes(model, name)
    attached = AttachedSAE(sae, bool(sae.use_error_term if use_error_term is None else use_error_term), given)
    edits = len(model._edits)
    with model.edit(inplace=True):
        splice_attached(model, attached)
    if len(model._edits) != edits + 1:
        raise RuntimeError("model.edit(inplace=True) did not store one edit for the SAE: nnsight's edits changed.")
    attached.mediator = model._edits[-1]
    attached_saes(model)[name] = attached
    name_hook_points(attached)


def name_hook_points(attached: AttachedSAE) -> None:
    """A SAELens SAE's own hook points named after the hook it is attached at (``blocks.5.attn.hook_z.hook_sae_input``),
    as SAELens's ``add_sae`` names them (``setup()``), and left so after it is reset; its ``hook_sae_error`` and
    ``hook_sae_output`` keep their names (SAELens's wrapper runs hook points of its own for them)."""
    for entry, hook_point in dict(getattr(attached.given, "hook_dict", None) or {}).items():
        if entry not in ("hook_sae_error", "hook_sae_output") and hasattr(hook_point, "name"):
            hook_point.name = f"{attached.prefix}.{entry}"


def reset_saes(model, act_names: str | Iterable[str] | None = None) -> None:
    """Detach the SAEs attached at ``act_names`` (their names, as ``acts_to_saes`` lists them), or every one: the
    model runs as it was. Other edits of the model are kept."""
    registry = attached_saes(model)
    names = list(registry) if act_names is None else [act_names] if isinstance(act_names, str) else list(act_names)
    unknown = [name for name in names if name not in registry]
    if unknown:
        raise KeyError(f"No SAE is attached at {', '.join(unknown)}: attached at {', '.join(registry) or 'nothing'}.")
    for name in names:
        mediator = registry.pop(name).mediator
        model._edits = [edit for edit in model._edits if edit is not mediator]


@contextmanager
def saes(model, saes: Dictionary | Iterable[Dictionary] = (), reset_saes_end: bool = True,
         use_error_term: bool | None = None):
    """``with model.saes(saes=[sae]):`` the SAEs attached inside the block (SAELens's ``saes``): at its end they are
    detached and the SAEs they replaced attached again, unless ``reset_saes_end=False``."""
    saes = [saes] if isinstance(saes, Dictionary) or hasattr(saes, "cfg") else list(saes)  # one, or several
    replaced = []
    try:
        for sae in saes:
            name = sae_name(sae)
            replaced.append((name, attached_saes(model).get(name)))
            add_sae(model, sae, use_error_term)
        yield model
    finally:
        if reset_saes_end:
            for name, previous in reversed(replaced):
                if name in attached_saes(model):
                    reset_saes(model, name)
                if previous is not None:
                    add_sae(model, previous.given, previous.use_error_term)


# -- running -----------------------------------------------------------------------------------------------------

def run_with_saes(model, input, *, saes: Dictionary | Iterable[Dictionary] = (), reset_saes_end: bool = True,
                  use_error_term: bool | None = None, return_type: str | None = "logits",
                  loss_per_token: bool = False, prepend_bos: bool | None = None, padding_side: str | None = None,
                  stop_at_layer: int | None = None, **kwargs):
    """One forward pass with ``saes`` attached (and those attached before): SAELens's ``run_with_saes``.

    ``input`` is a prompt, a list of prompts (padded as the model's traces pad them, or on ``padding_side``, with a
    BOS first as ``prepend_bos`` says) or token ids. ``return_type`` is ``"logits"``, ``"loss"`` (the mean next-token
    cross-entropy over the real tokens, per token with ``loss_per_token``, as TransformerLens computes it),
    ``"both"`` (``(logits, loss)``) or None; ``stop_at_layer=k`` returns the stream entering block ``k`` instead,
    as the model's own call does. Without gradients.
    """
    if kwargs:
        raise TypeError(f"run_with_saes got {', '.join(sorted(kwargs))}: its arguments are input, saes, "
                        "reset_saes_end, use_error_term and the model call's return_type, loss_per_token, prepend_bos, "
                        "padding_side and stop_at_layer.")
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type is one of {', '.join(map(repr, RETURN_TYPES))}, not {return_type!r}.")
    options = {"prepend_bos": prepend_bos, "padding_side": padding_side, "stop_at_layer": stop_at_layer}
    with model.saes(saes=saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term), hooked_pass(model):
        logits, cache = run_with_cache(model, input, names=[], **{k: v for k, v in options.items() if v is not None})
    if stop_at_layer is not None:  # the stream entering the block, as the model's call returns it
        return logits
    return _returned(logits, cache, return_type, loss_per_token)


def run_with_cache_with_saes(model, input, *, saes: Dictionary | Iterable[Dictionary] = (),
                             reset_saes_end: bool = True, use_error_term: bool | None = None,
                             names_filter: str | Iterable[str] | Callable[[str], bool] | None = None,
                             **cache_options) -> tuple[torch.Tensor, SAEActivationCache]:
    """``(logits, cache)`` of one forward pass with ``saes`` attached (and those attached before): SAELens's
    ``run_with_cache_with_saes``. The cache is nnterp's (``run_with_cache``: the standard values, ``names=`` and
    ``layers=`` among ``cache_options``) and holds each SAE's values under SAELens's names, after the hook it
    writes: ``hook_sae_input``, ``hook_sae_acts_pre``, ``hook_sae_acts_post``, ``hook_sae_recons``,
    ``hook_sae_output`` and, with ``use_error_term``, ``hook_sae_error``. The value at an SAE's site is what the model
    went on with (its ``hook_sae_output``).

    ``names_filter`` (a name, a list of names, or a function of a name) keeps the SAE entries it names; the names
    among them that are the model's own hooks go to ``run_with_cache`` where it takes ``names_filter``.
    """
    keep = names_predicate(names_filter)
    with model.saes(saes=saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
        attached = list(attached_saes(model).values())
        for one in attached:
            one.record = {}
        try:
            with hooked_pass(model):
                logits, cache = run_with_cache(model, input, **_cache_options(attached, names_filter, cache_options))
            recorded = {name: tensor for one in attached for name, tensor in one.record.items() if keep(name)}
        finally:
            for one in attached:
                one.record = None
    return logits, SAEActivationCache.of(cache, recorded)


def run_with_hooks_with_saes(model, input, *, saes: Dictionary | Iterable[Dictionary] = (),
                             reset_saes_end: bool = True, use_error_term: bool | None = None, fwd_hooks=(),
                             bwd_hooks=(), reset_hooks_end: bool = True, clear_contexts: bool = False,
                             return_type: str | None = "logits", loss_per_token: bool = False, **kwargs):
    """One forward pass with ``saes`` attached and ``fwd_hooks`` called: SAELens's ``run_with_hooks_with_saes``.

    A hook on an attached SAE's ``f"{hook_name}.hook_sae_acts_post"`` gets its features (and on ``.hook_sae_error``,
    with ``use_error_term``, its error) before the model goes on with them, so an edit (``acts[..., 7] = 0``, or a
    returned tensor) reaches the model as SAELens's does; a predicate over names gets the SAEs' entries too. The
    other hooks are the model's own (``run_with_hooks``)."""
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type is one of {', '.join(map(repr, RETURN_TYPES))}, not {return_type!r}.")
    with model.saes(saes=saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
        attached = list(attached_saes(model).values())
        model_hooks = []
        for one in attached:
            one.hooks = {}
        try:
            for entry in fwd_hooks:
                if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and callable(entry[1])):
                    raise TypeError(f"A hook is a pair (name or predicate over names, fn(tensor, hook)), not {entry!r}.")
                names, fn = entry
                taken = _sae_hook(attached, names, fn)
                if callable(names):  # the model's own hook points it chooses
                    model_hooks.append((lambda name, names=names: ".hook_sae_" not in name and names(name), fn))
                elif not taken:
                    model_hooks.append((names, fn))
            return model.run_with_hooks(input, fwd_hooks=model_hooks, bwd_hooks=bwd_hooks,
                                        reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts,
                                        return_type=return_type, loss_per_token=loss_per_token, **kwargs)
        finally:
            for one in attached:
                one.hooks = None


def _sae_hook(attached: list[AttachedSAE], names, fn) -> bool:
    """Give ``fn`` to the attached SAEs' entries ``names`` chooses; whether any was an SAE's entry."""
    taken = False
    for one in attached:
        for entry in SAE_ENTRIES:
            full = f"{one.prefix}.{entry}"
            if not (names(full) if callable(names) else names == full):
                continue
            if entry not in HOOKABLE or (entry == "hook_sae_error" and not one.use_error_term):
                if callable(names):
                    continue
                raise TypeError(f"A hook on {full}: nnterp's hooks on an SAE edit {', '.join(HOOKABLE)} "
                                f"({'; '.join(HOOKABLE.values())}; hook_sae_error with use_error_term=True). Read "
                                "the others with run_with_cache_with_saes.")
            one.hooks.setdefault(entry, []).append(fn)
            taken = True
    return taken


def _cache_options(attached: list[AttachedSAE], names_filter, options: dict) -> dict:
    """``run_with_cache``'s options: the names of ``names_filter`` that are no SAE entry, where it takes them."""
    if names_filter is None or callable(names_filter):
        model_filter = names_filter
    else:
        ours = {f"{one.prefix}.{entry}" for one in attached for entry in SAE_ENTRIES}
        names = [names_filter] if isinstance(names_filter, str) else list(names_filter)
        model_filter = [name for name in names if name not in ours]
        if not model_filter:  # only SAE entries: none of the model's values
            return {"names": [], **options}
    if model_filter is None:
        return options
    if "names_filter" in inspect.signature(run_with_cache).parameters:
        return {"names_filter": model_filter, **options}
    if callable(model_filter):  # nothing to ask the model for by a function of its hook names: its values as asked
        return options
    raise TypeError(f"names_filter names {', '.join(map(repr, model_filter))}, which are no SAE's entries: pass the "
                    "model's own values as run_with_cache's names=[...] (standard names).")


def _returned(logits: torch.Tensor, cache: ActivationCache, return_type, per_token: bool):
    if return_type is None:
        return None
    if return_type == "logits":
        return logits
    loss = next_token_loss(logits, cache.input_ids, cache.attention_mask, per_token)
    return loss if return_type == "loss" else (logits, loss)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    per_token: bool = False) -> torch.Tensor:
    """TransformerLens's ``lm_cross_entropy_loss``: minus the log-probability of each next token, ``[batch, seq - 1]``
    with ``per_token``, else its mean over the pairs of real tokens."""
    log_probs = logits.float().log_softmax(dim=-1)
    predicted = log_probs[:, :-1].gather(-1, tokens[:, 1:, None].to(logits.device))[..., 0]
    if attention_mask is None:
        return -predicted if per_token else -predicted.mean()
    mask = attention_mask.to(logits.device).bool()
    pairs = mask[:, :-1] & mask[:, 1:]
    predicted = predicted * pairs
    return -predicted if per_token else -predicted.sum() / pairs.sum()


class SAEActivationCache(ActivationCache):
    """nnterp's cache of a pass, with the SAEs' own values under SAELens's names: ``cache[f"{hook}.hook_sae_acts_post"]``.
    A TransformerLens hook name of a standard value reads that value (``cache["blocks.3.hook_resid_post"]``)."""

    @classmethod
    def of(cls, cache: ActivationCache, sae_values: dict[str, torch.Tensor]) -> SAEActivationCache:
        made = cls.__new__(cls)
        made.__dict__.update(cache.__dict__)
        made.sae_values = sae_values
        return made

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, str) and key in self.sae_values:
            return self._without_batch(self.sae_values[key], stacked=False)  # remove_batch_dim: as SAELens's
        if isinstance(key, str) and key.startswith("blocks."):
            site, reason = transformerlens_site(key)
            if site is None and ".hook_sae_" in key:
                raise KeyError(f"{key!r} is not in this cache: it holds the SAE entries "
                               f"{', '.join(self.sae_values) or '(none)'}.")
            if site is not None:
                return ActivationCache.__getitem__(self, (site[1], site[0]))
        return ActivationCache.__getitem__(self, key)

    def __contains__(self, key) -> bool:
        return key in self.sae_values or ActivationCache.__contains__(self, key)

    def keys(self) -> list:
        return [*ActivationCache.keys(self), *self.sae_values]

    def __repr__(self) -> str:
        return ActivationCache.__repr__(self)[:-1] + f"; SAE entries {', '.join(self.sae_values) or 'none'})"


# -- on the model class ------------------------------------------------------------------------------------------

METHODS = {"run_with_saes": run_with_saes, "run_with_cache_with_saes": run_with_cache_with_saes, "saes": saes,
           "run_with_hooks_with_saes": run_with_hooks_with_saes,
           "add_sae": add_sae, "reset_saes": reset_saes}


def install(model_class: type) -> None:
    """SAELens's methods on ``model_class`` (``HookedTransformer``, SAELens's ``HookedSAETransformer``)."""
    for name, method in METHODS.items():
        setattr(model_class, name, method)
    model_class.acts_to_saes = property(acts_to_saes)


__all__ = ["SAEActivationCache", "acts_to_saes", "add_sae", "install", "next_token_loss", "reset_saes",
           "run_with_cache_with_saes", "run_with_hooks_with_saes", "run_with_saes", "saes"]
