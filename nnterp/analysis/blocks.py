"""A block's identity as the sum the decomposition adds, read off the addition tree its spec declares.

A family spec's ``Sum`` (``nnterp.spec.identity``) is the block's code's own order of addition: its addends are
the contributions, each as it reaches the stream (a value, or a value scaled: Granite's times
``residual_multiplier``), and the stream the block received. A block whose identity is not such a sum (a scalar or
gate on the stream, a norm after the add, code that casts, gates or mixes streams) is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..spec.catalog import BY_NAME, IDENTITY_TERMS
from ..spec.errors import ValueUnavailable
from ..spec.identity import Expr, Name, Plus, PostNorm, Sum, addends, evaluate, names_in
from ..spec.locations import At
from ..spec.sourced import sourced
from ..spec.views import Times
from .checks import _refuse


def term_name(term: Expr) -> str:
    """The value an addend of a sum adds (itself, or scaled)."""
    (name,) = names_in(term)
    return name


@sourced
@dataclass(frozen=True, eq=False)
class BlockSum:
    """Block ``layer``'s identity as a sum: ``tree``, its spec's addition tree, adds the stream the block received
    (``layer_input``) and the contributions ``terms`` (its other addends, in forward order); ``mid`` is the subtree
    that is ``layer_mid`` (None where the block has no stream between its token mixer's add and its MLP's;
    ``no_mid`` says why). ``module`` is the block, whose attributes scale its terms."""

    layer: int
    module: nn.Module
    tree: Expr
    terms: tuple[Expr, ...]
    mid: Expr | None
    no_mid: str = ""

    def term(self, name: str) -> Expr | None:
        return next((term for term in self.terms if term_name(term) == name), None)

    def reaching(self, term: Expr, value: torch.Tensor) -> torch.Tensor:
        """``value`` of ``term`` as it reaches the stream: its factor applied as the block's code applies it."""
        return evaluate(term, {term_name(term): value}, self.module)


def added_factor(model, layer: int, value: str) -> float:
    """The factor block ``layer``'s code multiplies a sublayer's output by as it adds it to the stream, which the
    contribution ``value`` includes (its location's ``Times`` view: Granite's ``residual_multiplier``); 1 where there
    is none. A head's or neuron's share of the projection's output reaches the stream times it."""
    module = model.layers[layer]._module
    factor = 1.0
    for view in model.location(layer, value).views:
        if isinstance(view, Times):
            factor *= getattr(module, view.attribute)
    return factor


def add_up(node: Expr, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tree's additions, in its order, on ``rows`` (each addend's tensor as it reaches the stream)."""
    if isinstance(node, Plus):
        return add_up(node.left, rows) + add_up(node.right, rows)
    return rows[term_name(node)]


def _not_a_sum(identity, names: set[str]) -> str | None:
    """Why ``identity`` is not the stream the block receives plus contributions (``names``: what it may read);
    None where it is."""
    if isinstance(identity, PostNorm):
        return f"it norms the stream after each add ({identity.first_norm}, {identity.second_norm})"
    if not isinstance(identity, Sum):
        return ("it computes more than a sum of its values (a scale, bias or gate on the stream, a cast, a norm, "
                "or mixed or parallel streams)")
    why = _not_added(identity.tree, names)
    if why:
        return why
    read = [term_name(term) for term in addends(identity.tree)]
    stream = [term for term in addends(identity.tree) if term_name(term) == "layer_input"]
    if len(set(read)) < len(read):
        return "it uses a value twice"
    if len(stream) != 1:
        return "the stream the block receives is not one of its terms"
    if not isinstance(stream[0], Name):
        return "it scales the stream the block receives (a per-block scalar or gate)"
    return None


def _not_added(node: Expr, names: set[str]) -> str | None:
    """Why the tree is not an addition of values, each scaled or not: its first step that is not, in the order the
    block's code computes; None where there is none."""
    if isinstance(node, Name):
        return None if node.name in names else f"it reads {node.name}, neither a value of the block nor an extra term"
    if isinstance(node, Plus):
        return _not_added(node.left, names) or _not_added(node.right, names)
    why = _not_added(node.of, names)
    if why is None and isinstance(node.of, Plus):
        return "it scales a sum of values (a per-block scalar or gate on the stream)"
    return why


def block_sum(model, layer: int, what: str = "decompose_resid") -> BlockSum:
    """Block ``layer``'s identity as an addition tree, or ``AnalysisUnavailable`` with the reason."""
    if any(model.runs_of(i) > 1 for i in range(model.num_layers)):
        _refuse(model, what, "a section of blocks runs several times per pass (a looped model), so a block's "
                             "contribution is not one tensor")
    spec = model.block_spec(layer)
    names = {name for name in (*IDENTITY_TERMS, *spec.extra) if name != "layer_output"}
    reason = _not_a_sum(spec.identity, names)
    if reason is not None:
        _refuse(model, what, f"block {layer}'s identity, {spec.formula}, is not the stream it receives plus "
                             f"contributions: {reason}; so what the blocks add does not sum to the stream")
    tree = spec.identity.tree
    for term in addends(tree):
        if term_name(term) in BY_NAME:
            _available(model, layer, term_name(term), what)
    rank = {key.removeprefix("extra.").rpartition(".")[2]: n for n, (_, key, _) in enumerate(model.timeline(layer))}
    terms = tuple(sorted((t for t in addends(tree) if term_name(t) != "layer_input"), key=lambda t: rank.get(term_name(t), 0)))
    where = spec.resolve("layer_mid")
    if not isinstance(where, At):
        mid, no_mid = None, where.reason
    else:  # the spec's tree says which of its partial sums is layer_mid
        mid = spec.identity.layer_mid()
        no_mid = "" if mid is not None else f"the identity ({spec.formula}) does not add the MLP's output last"
    return BlockSum(layer, model.layers[layer]._module, tree, terms, mid, no_mid)


def _available(model, layer: int, name: str, what: str) -> None:
    """Refuse, with the block's reason, where value ``name`` has no meaning on block ``layer``."""
    try:
        model.location(layer, name)
    except ValueUnavailable as error:
        _refuse(model, what, f"block {layer}'s {error.key} is unavailable ({error.reason})")
