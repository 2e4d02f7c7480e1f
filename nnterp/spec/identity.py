"""A block's residual identity, declared once: the formula people read and the arithmetic the proof runs.

A family spec says how a block's values give ``layer_output``, in the order the model's code adds them. The
formula on the family's page, the recomputation the proof compares bit for bit, and the stream between the
sublayers the proof checks ``layer_mid`` against all come from that one declaration:

- ``Sum``: the block adds its values (an addition tree, terms scaled by a block attribute or a number allowed):
  ``Sum((X + A) + M)`` is the sequential block; its formula is rendered from the tree, and its ``layer_mid`` is
  the side of the last add that holds the block's input, where the other side is the MLP's output.
- ``PostNorm``: a norm after each add, by the norms' module names.
- ``Custom``: a block that computes more (a cast, a gate on the stream, mixed or parallel streams): its code,
  its formula written beside it, the names of the terms the code reads (``reads``: the code is given those alone,
  and must read each; ``drift`` says where the formula names others), and, where the proof can check it, how it
  gives ``layer_mid``.

Part of the core: it imports nothing of the package but ``sourced``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from .sourced import sourced

Terms = Mapping[str, torch.Tensor]  # the values a block's identity reads, by name
Compute = Callable[[Terms, torch.nn.Module], torch.Tensor]
HOW = ("value * factor", "factor * value", "value / factor")


class _Builds:
    """``+``, ``*`` and ``/`` on the nodes build the tree: ``(X + A * "residual_multiplier") + M``."""

    def __add__(self, other: Expr) -> Plus:
        return Plus(self, other)  # type: ignore[arg-type]

    def __mul__(self, factor: str | float) -> Scaled:
        return Scaled(self, factor)  # type: ignore[arg-type]

    def __rmul__(self, factor: str | float) -> Scaled:
        return Scaled(self, factor, "factor * value")  # type: ignore[arg-type]

    def __truediv__(self, factor: str | float) -> Scaled:
        return Scaled(self, factor, "value / factor")  # type: ignore[arg-type]


@sourced
@dataclass(frozen=True)
class Name(_Builds):
    """A value of the block (or an extra tensor of its identity), as the block's code reads it."""

    name: str

    def __str__(self) -> str:
        return self.name


@sourced
@dataclass(frozen=True)
class Plus(_Builds):
    """``left + right``, in this order (the order of the tree is the code's order of addition)."""

    left: Expr
    right: Expr

    def __str__(self) -> str:
        return f"{_operand(self.left)} + {_operand(self.right)}"


@sourced
@dataclass(frozen=True)
class Scaled(_Builds):
    """``of`` scaled by ``by``: the name of an attribute of the block module (Granite's ``residual_multiplier``),
    or a number; ``how`` as the code writes it."""

    of: Expr
    by: str | float
    how: str = "value * factor"

    def __post_init__(self):
        if self.how not in HOW:
            raise ValueError(f"Scaled.how is one of {HOW}, not {self.how!r}")

    def __str__(self) -> str:
        of = _operand(self.of)
        return {"value * factor": f"{of} * {self.by}", "factor * value": f"{self.by} * {of}",
                "value / factor": f"{of} / {self.by}"}[self.how]


Expr = Name | Plus | Scaled

X, A, M, MIXER = Name("layer_input"), Name("attention_output"), Name("mlp_output"), Name("mixer_output")


def _operand(node: Expr) -> str:
    return f"({node})" if isinstance(node, Plus) else str(node)


def evaluate(node: Expr, terms: Terms, block: torch.nn.Module):
    """The tree's arithmetic in its order, on the values ``terms`` (a block attribute's factor read off ``block``)."""
    if isinstance(node, Name):
        return terms[node.name]
    if isinstance(node, Plus):
        return evaluate(node.left, terms, block) + evaluate(node.right, terms, block)
    value, factor = evaluate(node.of, terms, block), getattr(block, node.by) if isinstance(node.by, str) else node.by
    if node.how == "factor * value":
        return factor * value
    return value / factor if node.how == "value / factor" else value * factor


def names_in(node: Expr) -> set[str]:
    if isinstance(node, Name):
        return {node.name}
    if isinstance(node, Plus):
        return names_in(node.left) | names_in(node.right)
    return names_in(node.of)


def addends(node: Expr) -> list[Expr]:
    """What the tree's additions add, in its order: the nodes that are not themselves an addition."""
    return addends(node.left) + addends(node.right) if isinstance(node, Plus) else [node]


def renamed_tree(node: Expr, names: dict[str, str]) -> Expr:
    if isinstance(node, Name):
        return Name(names.get(node.name, node.name))
    if isinstance(node, Plus):
        return Plus(renamed_tree(node.left, names), renamed_tree(node.right, names))
    return dataclasses.replace(node, of=renamed_tree(node.of, names))


def _renamed_text(text: str, names: dict[str, str]) -> str:
    return re.sub(r"\b\w+\b", lambda word: names.get(word.group(), word.group()), text)


@sourced
@dataclass(frozen=True)
class Sum:
    """A block that adds its values: ``layer_output`` is ``tree``; ``note`` says what names in it stand for."""

    tree: Expr
    note: str = ""

    mid = None  # the tree says where layer_mid is (``layer_mid``)

    @property
    def formula(self) -> str:
        return f"layer_output = {self.tree}" + (f" {self.note}" if self.note else "")

    def combine(self, terms: Terms, block: torch.nn.Module):
        return evaluate(self.tree, terms, block)

    def layer_mid(self) -> Expr | None:
        """The stream between the token mixer's add and the MLP's: the side of the last add that holds the
        block's input, where the other side is the MLP's output (scaled or not), and before the scale the add puts
        on it (Doge's ``post_attention_residual``); None where the tree has no such add."""
        tree = self.tree
        if not isinstance(tree, Plus):
            return None
        for side, other in ((tree.left, tree.right), (tree.right, tree.left)):
            while isinstance(other, Scaled):
                other = other.of
            if other == M and "layer_input" in names_in(side):
                while isinstance(side, Scaled):
                    side = side.of
                return side
        return None

    def renamed(self, names: dict[str, str]) -> Sum:
        return Sum(renamed_tree(self.tree, names), _renamed_text(self.note, names))

    def noted(self, note: str) -> Sum:
        return dataclasses.replace(self, note=f"{self.note} {note}".strip())


def native(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's own forward, called past nnsight's instrumentation: an identity that has the block's norms in it
    recomputes them (it serves no value, and uses up no call)."""
    return type(module).forward(module, x)


@sourced
@dataclass(frozen=True)
class PostNorm:
    """A post-norm block, ``n = first_norm(x + attn(x)); y = second_norm(n + mlp(n))``, by the norms' paths in the
    block: the norms are recomputed with their own forward, and ``layer_mid`` is ``n``."""

    first_norm: str
    second_norm: str

    @property
    def formula(self) -> str:
        return f"layer_output = {self.second_norm}({self.first_norm}(layer_input + attention_output) + mlp_output)"

    def mid(self, terms: Terms, block: torch.nn.Module):
        return native(block.get_submodule(self.first_norm), terms["layer_input"] + terms["attention_output"])

    def combine(self, terms: Terms, block: torch.nn.Module):
        return native(block.get_submodule(self.second_norm), self.mid(terms, block) + terms["mlp_output"])

    def layer_mid(self) -> None:
        return None

    def renamed(self, names: dict[str, str]) -> Custom:
        return Custom(self.formula, self.combine, self.mid, reads=_POST_NORM_READS).renamed(names)

    def noted(self, note: str) -> Custom:
        return Custom(self.formula, self.combine, self.mid, reads=_POST_NORM_READS).noted(note)


_POST_NORM_READS = ("layer_input", "attention_output", "mlp_output")


class _Given(dict):
    """The terms a ``Custom``'s code is given: those it declares, each marked once the code reads it."""

    def __init__(self, terms: Terms, names: tuple[str, ...]):
        dict.__init__(self, ((name, terms[name]) for name in names))  # explicit: a trace ships it by source
        self.unread = set(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(f"the identity's code reads {name!r}, which its reads= does not declare")
        self.unread.discard(name)
        return dict.__getitem__(self, name)


class _Aliased(Mapping):
    """``terms`` read by the names a renamed identity's code was written with (``{old: new}`` in ``names``)."""

    def __init__(self, terms: Mapping[str, torch.Tensor], names: dict[str, str]):
        self.terms, self.names = terms, names

    def __getitem__(self, name: str) -> torch.Tensor:
        new = self.names.get(name, name)
        return self.terms[new if new in self.terms else name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.terms)

    def __len__(self) -> int:
        return len(self.terms)


@sourced
@dataclass(frozen=True)
class Custom:
    """A block that computes more than sums of its values: ``compute`` is its arithmetic in the code's order,
    ``formula`` the same for people, and ``mid`` (where given) recomputes ``layer_mid`` for the proof to check.

    ``reads`` names the terms ``compute`` reads (values and extra tensors): it is given those alone, and reading
    another, or leaving one unread, fails the recomputation; ``drift`` checks the formula names the same ones."""

    formula: str
    compute: Compute
    mid: Compute | None = None
    reads: tuple[str, ...] | None = field(default=None, kw_only=True)  # None: not declared (nothing is checked)

    def combine(self, terms: Terms, block: torch.nn.Module):
        if self.reads is None:
            return self.compute(terms, block)
        given = _Given(terms, self.reads)
        result = self.compute(given, block)
        if given.unread:
            raise ValueError(f"the identity declares {sorted(given.unread)} in reads=, which its code does not read: "
                             f"{self.formula}")
        return result

    def drift(self, terms: Iterable[str]) -> str:
        """How the formula differs from ``reads``, over ``terms`` (every name the block gives its identity: the
        identity's values and its extra tensors); '' where the formula names exactly the terms the code reads."""
        if self.reads is None:
            return "its reads= is not declared"
        named = set(re.findall(r"\w+", self.formula)) & set(terms)
        extra, missing = named - set(self.reads), set(self.reads) - named
        problems = [f"the formula names {sorted(extra)}, which its code does not read"] if extra else []
        if missing:
            problems.append(f"the formula omits {sorted(missing)}, which its code reads")
        return "; ".join(problems)

    def layer_mid(self) -> None:
        return None

    def renamed(self, names: dict[str, str]) -> Custom:
        compute, mid = self.compute, self.mid
        return Custom(_renamed_text(self.formula, names), lambda t, block: compute(_Aliased(t, names), block),
                      None if mid is None else lambda t, block: mid(_Aliased(t, names), block),
                      reads=None if self.reads is None else tuple(names.get(name, name) for name in self.reads))

    def noted(self, note: str) -> Custom:
        return dataclasses.replace(self, formula=f"{self.formula} {note}")


Identity = Sum | PostNorm | Custom
SEQUENTIAL = Sum((X + A) + M)
