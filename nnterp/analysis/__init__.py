"""Decomposition and direct logit attribution over one pass's cache, by TransformerLens's names.

``decompose_resid`` splits the stream into what each block adds, ``accumulated_resid`` stacks the stream
as each block receives it, ``stack_head_results`` and ``stack_neuron_results`` split the attention's and
the MLP's outputs per head and per neuron, ``apply_ln_to_stack`` passes a stack through a norm frozen as
it was in the pass, and ``logit_attrs`` projects a stack on the head's rows of some tokens (direct logit
attribution). ``ActivationCache``'s methods of the same names call these; they read the cache, the
family spec and the model's modules (``model.block_spec``, ``model.location``, ``model.timeline``, the
modules' weights), none of the engine's private state, and never run the model.

Exactness. A block's identity (its spec's ``combine``, in the code's own order of addition) is run on
symbols, which gives it as an addition tree: its leaves are the contributions (each as it reaches the
stream: Granite's times ``residual_multiplier``) and the stream the block received. The decomposition
is those leaves, and ``recompose`` adds them back along the trees, which is the stream bit for bit. A
block whose identity is not such a sum (a scalar or gate on the stream, a norm after the add, mixed or
parallel streams) is refused with the reason, as is a model that changes the stream between blocks.

Norms. A norm is frozen as the affine map it applied in the pass: ``(x - mean(x)) / s * gain + bias``
(no centring on an RMSNorm; ``gain`` is the weight as the norm applies it, Gemma's ``1 + weight``), with
``s`` per position, read off the norm's cached input and output (TransformerLens's ``hook_scale``).
Centring and the weight's convention are read by calling the module on a probe; a norm whose output in
the pass is not that map is refused. The norm's bias is a component of its own, so a stack whose rows
sum to the stream sums, through the frozen norm, to the normed stream the model saw (within rounding:
the norm and the head are applied row by row). The decomposition keeps the model's dtype, in which its
sums are exact; everything computed from it (norms, heads, neurons, attributions) is float32.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..core.tokens import token_ids
from ..core.validation import IDENTITY_TERMS
from ..families.base import native
from ..spec.catalog import BY_NAME
from ..spec.errors import NNterpError, ValueUnavailable
from ..spec.locations import At
from ..spec.sourced import sourced

SHORT = {"attention_output": "attn_out", "mixer_output": "mixer_out", "mlp_output": "mlp_out"}
MODES = {"all": None, "attn": ("attention_output", "mixer_output"), "mlp": ("mlp_output",)}


class AnalysisUnavailable(NNterpError, ValueError):
    """An analysis that would not be exact on this family or this cache; the message says why."""


def _refuse(model, what: str, reason: str):
    raise AnalysisUnavailable(f"{what} is unavailable on {model.family.name}: {reason}.")


class NonFiniteValues(NNterpError, ValueError):
    """The pass holds NaN or infinite values where an analysis reads it: the values are at fault, not the family."""


def _why_not_exact(cache, what: str, reads: list[tuple[str, torch.Tensor]], where: str) -> None:
    """Before blaming the family for ``where`` not being what its identity computes: raise ``NonFiniteValues`` naming
    the first value of ``reads`` (``(label, tensor [batch, seq, ...])``) with a NaN or infinity, and the prompt and
    position; ``AnalysisUnavailable`` naming the steering where the cache's pass was steered. Returns otherwise."""
    for label, tensor in reads:
        bad = ~torch.isfinite(tensor)
        if bad.any():
            prompt, position = bad.nonzero()[0].tolist()[:2]
            value = tensor[prompt, position][bad[prompt, position]].flatten()[0].item()
            raise NonFiniteValues(
                f"{what}: in this pass, {label} is {value} at prompt {prompt}, position {position}, so {where} cannot be "
                "checked against the blocks' identities. The values are not finite (the pass overflowed, or an input "
                "or an edit brought the NaN), not the model's structure; find where it first appears with "
                "cache[name, layer].isfinite().all(-1).")
    steered = getattr(cache, "steered", ())
    if steered:
        raise AnalysisUnavailable(
            f"{what} is unavailable on this cache: its pass was steered at {', '.join(steered)} (run_with_cache(..., "
            f"steer=...)) and a steered value is cached as steered, so {where} is not what the cached values add up "
            "to; decompose a cache of the unsteered pass.")


# -- a block's identity as an addition tree ------------------------------------------------------


@sourced
@dataclass(frozen=True, eq=False)
class Term:
    """A leaf of a block's identity: value ``name`` (or identity extra) as it reaches the stream, ``factor``
    applied as the block's code applies it."""

    name: str
    factor: object = None
    how: str = "value * factor"  # or "factor * value", "value / factor"

    def of(self, value: torch.Tensor) -> torch.Tensor:
        if self.factor is None:
            return value
        if self.how == "factor * value":
            return self.factor * value
        return value / self.factor if self.how == "value / factor" else value * self.factor


@sourced
@dataclass(frozen=True, eq=False)
class Add:
    left: Term | Add
    right: Term | Add


def leaves(node: Term | Add) -> list[Term]:
    return [node] if isinstance(node, Term) else leaves(node.left) + leaves(node.right)


def add_up(node: Term | Add, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tree's additions, in its order, on ``rows`` (each leaf's tensor as it reaches the stream)."""
    if isinstance(node, Term):
        return rows[node.name]
    return add_up(node.left, rows) + add_up(node.right, rows)


class _NotASum(Exception):
    pass


class _Symbol:
    """Stands for a value while a block's ``combine`` runs: it records additions and scalings, and
    refuses anything else (a norm, a cast, a product of values, a mix of streams)."""

    def __init__(self, node):
        self.node = node

    def __add__(self, other):
        if not isinstance(other, _Symbol):
            raise _NotASum("it adds a constant")
        return _Symbol(Add(self.node, other.node))

    def __radd__(self, other):
        raise _NotASum("it adds a constant")

    def _scaled(self, factor, how):
        if isinstance(factor, _Symbol):
            raise _NotASum("it multiplies values together (a gate)")
        if isinstance(self.node, Add):
            raise _NotASum("it scales a sum of values (a per-block scalar on the stream)")
        if self.node.factor is not None:
            raise _NotASum(f"it scales {self.node.name} twice")
        return _Symbol(Term(self.node.name, factor, how))

    def __mul__(self, factor):
        return self._scaled(factor, "value * factor")

    def __rmul__(self, factor):
        return self._scaled(factor, "factor * value")

    def __truediv__(self, factor):
        return self._scaled(factor, "value / factor")

    def __getattr__(self, name):
        raise _NotASum(f"it computes with a value in the block's own code (.{name}: a norm, a cast or a reshaping)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise _NotASum(f"it computes {getattr(func, '__name__', func)} on the values (a gate, a norm or a mix of streams)")


@sourced
@dataclass(frozen=True, eq=False)
class BlockSum:
    """Block ``layer``'s identity as a sum: ``tree`` (its leaves: the stream, ``layer_input``, and the
    contributions ``terms``, in forward order), and ``mid``, the subtree that is ``layer_mid`` (None where
    the block has no stream between its token mixer's add and its MLP's; ``no_mid`` says why)."""

    layer: int
    tree: Term | Add
    terms: tuple[Term, ...]
    mid: Term | Add | None
    no_mid: str = ""


def block_sum(model, layer: int, what: str = "decompose_resid") -> BlockSum:
    """Block ``layer``'s identity as an addition tree, or ``AnalysisUnavailable`` with the reason."""
    if any(model.runs_of(i) > 1 for i in range(model.num_layers)):
        _refuse(model, what, "a section of blocks runs several times per pass (a looped model), so a block's "
                             "contribution is not one tensor")
    spec = model.block_spec(layer)
    symbols = {name: _Symbol(Term(name)) for name in (*IDENTITY_TERMS, *spec.extra) if name != "layer_output"}
    try:
        result = spec.combine(symbols, model.layers[layer]._module)
    except _NotASum as error:
        reason = str(error)
    except Exception as error:  # the identity computes with the values in a way a sum does not
        reason = f"it computes with the values ({type(error).__name__}: {error})"
    else:
        reason = None if isinstance(result, _Symbol) else "it is not computed from the values alone"
    if reason is None:
        tree = result.node
        names = [term.name for term in leaves(tree)]
        stream = [term for term in leaves(tree) if term.name == "layer_input"]
        if len(set(names)) < len(names):
            reason = "it uses a value twice"
        elif len(stream) != 1:
            reason = "the stream the block receives is not one of its terms"
        elif stream[0].factor is not None:
            reason = "it scales the stream the block receives (a per-block scalar or gate)"
    if reason is not None:
        _refuse(model, what, f"block {layer}'s identity, {spec.formula}, is not the stream it receives plus "
                             f"contributions: {reason}; so what the blocks add does not sum to the stream")
    for term in leaves(tree):
        if term.name in BY_NAME:
            _available(model, layer, term.name, what)
    rank = {key.removeprefix("extra.").rpartition(".")[2]: n for n, (_, key, _) in enumerate(model.timeline(layer))}
    terms = tuple(sorted((t for t in leaves(tree) if t.name != "layer_input"), key=lambda t: rank.get(t.name, 0)))
    mid, no_mid = _mid(model, layer, tree, spec)
    return BlockSum(layer, tree, terms, mid, no_mid)


def _available(model, layer: int, name: str, what: str) -> None:
    """Refuse, with the block's reason, where value ``name`` has no meaning on block ``layer``."""
    try:
        model.location(layer, name)
    except ValueUnavailable as error:
        _refuse(model, what, f"block {layer}'s {error.key} is unavailable ({error.reason})")


def _mid(model, layer, tree, spec):
    """The subtree that gives ``layer_mid``: the side of the last add that holds the stream, where the other
    side is the MLP's output alone."""
    where = spec.resolve("layer_mid")
    if not isinstance(where, At):
        return None, where.reason
    if spec.mid is not None or not isinstance(tree, Add):
        return None, "the stream between the token mixer's add and the MLP's is not a partial sum of the identity"
    for mid, other in ((tree.left, tree.right), (tree.right, tree.left)):
        if isinstance(other, Term) and other.name == "mlp_output" and "layer_input" in {t.name for t in leaves(mid)}:
            return mid, ""
    return None, f"the identity ({spec.formula}) does not add the MLP's output last"


# -- reading the cache ---------------------------------------------------------------------------


def _take(tensor: torch.Tensor, index, dim: int) -> torch.Tensor:
    """TransformerLens's slices: None (all), an int (that one, the dimension dropped), a tuple (a slice of
    its arguments), a slice, or a list or tensor of indices."""
    if index is None:
        return tensor
    dim %= tensor.dim()
    if isinstance(index, int):
        return tensor.select(dim, index)
    if isinstance(index, tuple):
        index = slice(*index)
    if isinstance(index, slice):
        return tensor[(slice(None),) * dim + (index,)]
    return tensor.index_select(dim, torch.as_tensor(index, dtype=torch.long, device=tensor.device))


def _warn_if_pads(cache, pos_slice, what: str) -> None:
    """``pos_slice`` picks columns of the batch, as TransformerLens's does, not each prompt's own positions: warn
    where a column it picks is padding for some prompt (the short prompts' last tokens are not at -1 when the
    tokenizer pads on the right)."""
    mask = getattr(cache, "attention_mask", None)
    if pos_slice is None or mask is None or bool(mask.all()):
        return
    pads = _take(mask, pos_slice, -1) == 0
    if pads.any():
        prompts = sorted(set(pads.nonzero()[:, 0].tolist()))
        side = "right" if bool((mask[:, -1] == 0).any()) else "left"
        warnings.warn(f"{what}: pos_slice={pos_slice!r} picks columns of the batch, and they are padding for prompt(s) "
                      f"{prompts} of this batch, padded on the {side}: those prompts' rows there are a pad's. Pad on "
                      "the left (as the model's traces do) for pos_slice=-1 to be each prompt's last token, or pick "
                      "positions per prompt (cache.attention_mask.sum(-1) - 1 is each one's last under right padding).",
                      UserWarning, stacklevel=3)


def _value(cache, name: str, layer: int) -> torch.Tensor:
    """Block ``layer``'s value ``name``, or its identity's extra term ``name``."""
    return cache[name if name in BY_NAME else f"extra.{name}", layer]


def _layer(model, layer: int | None, what: str) -> int:
    """TransformerLens's ``layer``: 0 to ``num_layers`` (the stream the final norm reads); None or -1 mean the last."""
    n = model.num_layers
    if layer is None or layer == -1:
        return n
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
        raise IndexError(f"{what}'s layer is 0 to {n} (the stream the final norm reads; None or -1 too), not {layer!r}.")
    return layer


def _readout_refusal(model) -> str | None:
    family = model.family
    if family.readout_unavailable:
        return family.readout_unavailable
    if family.stream_readout:
        return f"the model collapses parallel streams ({family.stream_readout}) before its final norm"
    if family.before_final_norm:
        return "the model changes the last block's output before its final norm reads it"
    return None


def stream_at(cache, layer: int) -> torch.Tensor:
    """The stream block ``layer`` receives; at ``num_layers``, the stream the final norm reads (the last block's
    output on a model without one)."""
    model = cache.model
    if layer < model.num_layers:
        return cache["layer_input", layer]
    if model.family.ln_final:
        return cache["ln_final_input"]
    return cache["layer_output", model.num_layers - 1]


# -- the stream, decomposed ---------------------------------------------------------------------


def _plan(cache, layer: int, mlp_input: bool, what: str) -> list[tuple[BlockSum, Term | Add]]:
    """(block, the part of its identity the stream at ``layer`` holds) for every block before it."""
    model = cache.model
    if layer == model.num_layers and _readout_refusal(model):
        _refuse(model, what, f"{_readout_refusal(model)}, so no sum of the blocks' contributions is the stream it reads")
    plan = [(block, block.tree) for block in (block_sum(model, i, what) for i in range(layer))]
    if mlp_input:
        if layer == model.num_layers:
            raise ValueError(f"{what}: mlp_input=True names a block's MLP input; the final norm's input has none.")
        block = block_sum(model, layer, what)
        if block.mid is None:
            _refuse(model, f"{what}(mlp_input=True)", f"block {layer} has no stream before its MLP's add: {block.no_mid}")
        plan.append((block, block.mid))
    return plan


def _components(cache, plan, pos_slice) -> tuple[list[str], list[str], list[torch.Tensor], list[tuple]]:
    """Every leaf of the plan as it reaches the stream: labels, value names, rows, and per block (block, part,
    (name, row) of its leaves)."""
    labels, names_of, rows, parts = [], [], [], []
    for block, part in plan:
        names = {t.name for t in leaves(part)}
        mine = []
        for term in block.terms:
            if term.name in names:
                value = _take(_value(cache, term.name, block.layer), pos_slice, -2)
                labels.append(f"{block.layer}_{SHORT.get(term.name, term.name)}")
                names_of.append(term.name)
                rows.append(term.of(value))
                mine.append((term.name, len(rows) - 1))
        parts.append((block, part, mine))
    return labels, names_of, rows, parts


def _chain(cache, parts, rows, embed: torch.Tensor, pos_slice, what: str) -> torch.Tensor:
    """Add the components up along the blocks' identities, checking the stream each next block receives (and
    ``layer_mid`` at a partial last block) is that sum, bit for bit."""
    model = cache.model
    stream = embed
    for block, part, mine in parts:
        stream = add_up(part, {"layer_input": stream, **{name: rows[k] for name, k in mine}})
        partial = part is not block.tree
        truth = cache["layer_mid", block.layer] if partial else stream_at(cache, block.layer + 1)
        truth = _take(truth, pos_slice, -2)
        where = (f"layer_mid of block {block.layer}" if partial else
                 f"the stream block {block.layer + 1} receives" if block.layer + 1 < model.num_layers else
                 "the stream the final norm reads")
        if truth.shape != stream.shape:
            _refuse(model, what, f"{where} has shape {list(truth.shape)}, block {block.layer}'s values "
                                 f"{list(stream.shape)}: the model adds positions or streams the values do not hold")
        if not torch.equal(truth, stream):
            reads = [(f"block {block.layer}'s {name}", _value(cache, name, block.layer))
                     for name in ("layer_input", *(term.name for term in block.terms))]
            reads.append((where, cache["layer_mid", block.layer] if partial else stream_at(cache, block.layer + 1)))
            _why_not_exact(cache, what, reads, where)
            _refuse(model, what, f"{where} is not block {block.layer}'s identity of its values: the model changes "
                                 "the stream between its blocks")
    return stream


def decompose_resid(cache, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                    apply_ln: bool = False, pos_slice=None, incl_embeds: bool = True, return_labels: bool = False):
    """The stream block ``layer`` receives (None: the one the final norm reads), as what made it:
    ``[components, batch, pos, hidden]``.

    The components are ``embed`` (the stream block 0 receives: the token embeddings, with the position
    embeddings where the model adds them), then, for each block before ``layer``, what it adds, in forward
    order: ``{i}_attn_out`` (``attention_output``), ``{i}_mixer_out`` (a token mixer that is not attention),
    ``{i}_mlp_out``, and the family's own terms by their spec name (an identity extra); each as it reaches
    the stream (Granite's times its ``residual_multiplier``). ``mlp_input=True`` adds block ``layer``'s
    token mixer, for the stream its MLP's norm reads. ``mode`` ``"attn"`` keeps the token mixers' terms and
    ``"mlp"`` the MLPs' (and ``embed`` with ``incl_embeds``). They sum to the stream: ``recompose`` adds them
    in the family's own order, bit for bit; ``.sum(0)`` within rounding. ``apply_ln=True`` passes them
    through the norm that reads that stream, frozen (``apply_ln_to_stack``, which adds its bias as a
    component).
    """
    what = "decompose_resid"
    model = cache.model
    _warn_if_pads(cache, pos_slice, what)
    if mode not in MODES:
        raise ValueError(f"decompose_resid's mode is 'all', 'attn' or 'mlp', not {mode!r}.")
    layer = _layer(model, layer, what)
    plan = _plan(cache, layer, mlp_input, what)
    labels, names, rows, parts = _components(cache, plan, pos_slice)
    embed = _take(cache["layer_input", 0], pos_slice, -2)
    _chain(cache, parts, rows, embed, pos_slice, what)  # the contract, checked on this pass
    keep = [k for k, name in enumerate(names) if MODES[mode] is None or name in MODES[mode]]
    labels, rows = [labels[k] for k in keep], [rows[k] for k in keep]
    if incl_embeds:
        labels, rows = ["embed", *labels], [embed, *rows]
    stack = torch.stack(rows) if rows else embed.new_zeros((0, *embed.shape))
    if apply_ln:
        stack, labels = apply_ln_to_stack(cache, stack, layer, mlp_input, pos_slice=pos_slice, labels=labels)
    return (stack, labels) if return_labels else stack


def recompose(cache, stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False) -> torch.Tensor:
    """The rows of ``decompose_resid(layer, mlp_input)`` (every component, ``embed`` first, as it gave them, or
    edited) added up in the family's own order of addition: on the rows as given, the stream, bit for bit."""
    what = "recompose_resid"
    layer = _layer(cache.model, layer, what)
    parts = []
    count = 1
    for block, part in _plan(cache, layer, mlp_input, what):
        names = {t.name for t in leaves(part)}
        mine = [(t.name, count + k) for k, t in enumerate(t for t in block.terms if t.name in names)]
        count += len(mine)
        parts.append((part, mine))
    if stack.shape[0] != count:
        raise ValueError(f"recompose_resid adds up the {count} rows of decompose_resid(layer={layer}, mlp_input="
                         f"{mlp_input}) (mode 'all', with embed), not {stack.shape[0]}.")
    stream = stack[0]
    for part, mine in parts:
        stream = add_up(part, {"layer_input": stream, **{name: stack[k] for name, k in mine}})
    return stream


def accumulated_resid(cache, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                      pos_slice=None, mlp_input: bool = False, return_labels: bool = False):
    """The stream as each block receives it, ``[rows, batch, pos, hidden]``: ``{i}_pre`` (``layer_input``) for every
    block before ``layer`` (None: all), then the stream the final norm reads (``final_post``); or block ``layer``'s
    own input (``{layer}_pre``). ``incl_mid`` adds each earlier block's ``layer_mid`` (``{i}_mid``), ``mlp_input``
    block ``layer``'s. ``apply_ln=True`` norms each row as the norm that reads the last row would: the final
    norm with each row's own statistics (the logit lens), a block's norm at its frozen scale of the pass."""
    model = cache.model
    _warn_if_pads(cache, pos_slice, "accumulated_resid")
    layer = _layer(model, layer, "accumulated_resid")
    labels, rows = [], []
    for i in range(layer + 1):
        if i == model.num_layers:
            labels.append("final_post")
        else:
            labels.append(f"{i}_pre")
        rows.append(stream_at(cache, i))
        if i < model.num_layers and ((incl_mid and i < layer) or (mlp_input and i == layer)):
            labels.append(f"{i}_mid")
            rows.append(cache["layer_mid", i])
    rows = [_take(row, pos_slice, -2) for row in rows]
    shapes = {tuple(row.shape) for row in rows}
    if len(shapes) > 1:
        _refuse(model, "accumulated_resid", f"the streams have shapes {sorted(shapes)} (the final norm reads another "
                                            "stream than the blocks pass on), so they do not stack")
    stack = torch.stack(rows)
    if apply_ln:
        if layer == model.num_layers:
            stack = apply_ln_to_stack(cache, stack, layer, pos_slice=pos_slice, recompute_ln=True)
        else:  # each row is a whole stream: the norm's bias belongs to every row
            norm = frozen_norm(cache, layer, mlp_input)
            stack = norm.linear(stack, _take(norm.scale, pos_slice, -2))
            stack = stack if norm.bias is None else stack + norm.bias
    return (stack, labels) if return_labels else stack


# -- norms, frozen ----------------------------------------------------------------------------------


def _tolerance(dtype: torch.dtype) -> float:
    """How far a recomputation in float32 may be from what the model computed in ``dtype``, relative to its size."""
    return 1e-4 if torch.finfo(dtype).bits >= 32 else 3e-2


def _far(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The relative difference of ``a`` and ``b`` where it exceeds the tolerance of ``dtype``; None where close."""
    if not a.numel():
        return None
    a, b = a.float(), b.float()
    difference = (a - b).abs().max().item() / max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    return None if difference <= _tolerance(dtype) else difference  # a NaN is far


@sourced
@dataclass(frozen=True, eq=False)
class FrozenNorm:
    """A norm as the affine map it applied in one pass: ``(x - mean(x)) / scale * gain + bias`` (no centring where
    ``centred`` is False: an RMSNorm), ``scale`` per position ``[batch, seq, 1]``; ``gain`` is the weight as the
    norm applies it (None: no weight), ``bias`` None where it has none. In float32."""

    label: str
    centred: bool
    scale: torch.Tensor
    gain: torch.Tensor | None
    bias: torch.Tensor | None

    def linear(self, stack: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The norm's linear part, at ``scale`` (the pass's, sliced as ``stack`` is), on each row of ``stack``."""
        stack = stack.float()
        if self.centred:
            stack = stack - stack.mean(-1, keepdim=True)
        stack = stack / scale.to(stack.device)
        return stack if self.gain is None else stack * self.gain.to(stack.device)


def _module(model, layer: int | None, path: str | None) -> nn.Module:
    return model.ln_final._module if layer is None else model.layers[layer]._module.get_submodule(path)


def frozen_norm(cache, layer: int | None = None, mlp_input: bool = False) -> FrozenNorm | None:
    """The norm that reads the stream at ``layer`` (None or ``num_layers``: the final norm; else block ``layer``'s
    attention norm, or its MLP norm with ``mlp_input``), frozen as it was in the pass; None where the model has
    no final norm (its head reads the stream)."""
    model = cache.model
    what = "apply_ln_to_stack"
    layer = _layer(model, layer, what)
    if layer == model.num_layers:
        if mlp_input:
            raise ValueError("apply_ln_to_stack: mlp_input=True names a block's MLP norm; the final norm has none.")
        if model.family.ln_final is None:
            return None
        module, label = _module(model, None, None), "ln_final"
        x, y = cache["ln_final_input"], cache["ln_final_output"]
        reads = "the stream the final norm reads"
    else:
        name = "mlp_norm_output" if mlp_input else "attention_norm_output"
        try:
            location = model.location(layer, name)
        except ValueUnavailable as error:
            _refuse(model, what, f"block {layer} has no {'MLP' if mlp_input else 'attention'} norm to freeze "
                                 f"({error.reason})")
        if location.op or location.side != "output":
            _refuse(model, what, f"block {layer}'s {name} is not one norm module's output")
        stream = "layer_mid" if mlp_input and isinstance(model.block_spec(layer).resolve("layer_mid"), At) else "layer_input"
        module = _module(model, layer, location.path)
        label = f"{layer}_{'mlp' if mlp_input else 'attention'}_norm"
        x, y = cache[stream, layer], cache[name, layer]
        reads = f"block {layer}'s {stream}"
    centred, offset = _norm_form(model, module, x, label)
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    gain = None if weight is None else weight.detach().float().to(x.device) + offset
    bias = None if bias is None else bias.detach().float().to(x.device)
    u, numerator, denominator = _fit(x, y, centred, gain, bias)
    # where the norm's input is flat (zero after centring: a pad's zero stream), its output says nothing of the
    # scale, which is then the norm's sqrt(eps) (TransformerLens's hook_scale there)
    flat = denominator == 0
    scale = numerator / torch.where(flat, 1, denominator)
    if flat.any():
        scale = torch.where(flat, _flat_scale(module, centred, gain, bias, x), scale)
    predicted = u / scale + (0 if bias is None else bias)
    difference = _far(predicted, y, y.dtype) if y.shape == x.shape else 1.0
    if difference is not None:
        _why_not_exact(cache, what, [(reads, x), (f"{label}'s output", y)], f"{label}'s output")
        _refuse(model, what, f"{label} ({type(module).__name__}) is not, in this pass, {reads} normed at one scale "
                             f"per position as a LayerNorm or an RMSNorm does (relative difference {difference:.2g}), "
                             "so it cannot be frozen")
    return FrozenNorm(label, centred, scale, gain, bias)


def _flat_scale(module: nn.Module, centred: bool, gain, bias, like: torch.Tensor) -> float:
    """What the norm divides by where its input is flat (zero after centring): ``sqrt(eps)``, its declared epsilon
    (transformers' norms name it one of these), or else read off its output on a small probe."""
    for name in ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value) ** 0.5
    probe = torch.full((1, 1, like.shape[-1]), 1e-3)
    probe[..., ::2] = -1e-3
    probe = (probe - probe.mean(-1, keepdim=True) if centred else probe).to(like.device)
    with torch.no_grad():
        y = native(module, probe.to(like.dtype))
    _, numerator, denominator = _fit(probe, y, False, gain, bias)  # already centred
    scale = (numerator / denominator).item()
    return max(scale * scale - probe.pow(2).mean().item(), 0.0) ** 0.5


def _fit(x: torch.Tensor, y: torch.Tensor, centred: bool, gain, bias):
    """``(u, u·u, u·r)`` per position, in float32: ``u`` the norm's input centred (where it centres) times its gain,
    ``r`` its output less its bias; ``y = u / scale + bias`` gives ``scale = u·u / u·r``."""
    u = x.float() - x.float().mean(-1, keepdim=True) if centred else x.float()
    u = u if gain is None else u * gain
    r = y.float() if bias is None else y.float() - bias
    return u, (u * u).sum(-1, keepdim=True), (u * r).sum(-1, keepdim=True)


def _norm_form(model, module: nn.Module, x: torch.Tensor, label: str) -> tuple[bool, float]:
    """(centred, offset of the weight) of a norm, from its output on a probe: a LayerNorm's output does not
    change when a constant is added to its input; the weight is applied as ``weight`` or ``1 + weight``."""
    what = "apply_ln_to_stack"
    parameters = dict(module.named_parameters())
    if set(parameters) - {"weight", "bias"}:
        _refuse(model, what, f"{label} ({type(module).__name__}) has parameters {sorted(parameters)}: it is not a "
                             "LayerNorm or an RMSNorm, so it cannot be frozen")
    if any(p.device.type == "meta" for p in parameters.values()):
        _refuse(model, what, f"{label}'s weights are not loaded here (meta), so it cannot be frozen")
    hidden = x.shape[-1]
    if any(tuple(p.shape) != (hidden,) for p in parameters.values()):
        _refuse(model, what, f"{label}'s parameters are not one per channel of the stream")
    device = next(iter(parameters.values())).device if parameters else x.device
    generator = torch.Generator().manual_seed(0)
    probe = torch.randint(-8, 9, (1, 8, hidden), generator=generator).float()  # integers: exact in any dtype
    try:
        with torch.no_grad():
            plain = native(module, probe.to(device, x.dtype))
            shifted = native(module, (probe + 16).to(device, x.dtype))
    except Exception as error:
        _refuse(model, what, f"{label} ({type(module).__name__}) cannot be called on a stream alone "
                             f"({type(error).__name__}: {error}), so it cannot be frozen")
    if not isinstance(plain, torch.Tensor) or plain.shape != probe.shape:
        _refuse(model, what, f"{label} ({type(module).__name__}) does not return a stream, so it cannot be frozen")
    centred = _far(plain, shifted, x.dtype) is None
    if "weight" not in parameters:
        return centred, 0.0
    normed = probe - probe.mean(-1, keepdim=True) if centred else probe
    normed = normed / normed.pow(2).mean(-1, keepdim=True).sqrt()
    weight = parameters["weight"].detach().float().cpu()
    bias = parameters["bias"].detach().float().cpu() if "bias" in parameters else 0
    plain = plain.float().cpu()
    error = {offset: (normed * (weight + offset) + bias - plain).abs().max().item() for offset in (0.0, 1.0)}
    return centred, min(error, key=error.get)


def _frozen_at(cache, layer: int, mlp_input: bool, pos_slice, batch_slice, has_batch_dim: bool):
    """``(the frozen norm, its scale sliced as a stack is)``, or ``(None, None)`` where there is no final norm."""
    norm = frozen_norm(cache, layer, mlp_input)
    if norm is None:
        return None, None
    scale = _take(norm.scale, batch_slice, 0)
    if not has_batch_dim:
        if scale.dim() == norm.scale.dim():  # still a batch dimension: it must be one prompt
            if scale.shape[0] != 1:
                raise ValueError("apply_ln_to_stack(has_batch_dim=False) needs one prompt: a cache of one, or an int "
                                 "batch_slice.")
            scale = scale[0]
    return norm, _take(scale, pos_slice, -2)


def apply_ln_to_stack(cache, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                      pos_slice=None, batch_slice=None, has_batch_dim: bool = True, recompute_ln: bool = False,
                      incl_bias: bool = True, labels: Sequence[str] | None = None):
    """``residual_stack`` ``[rows, batch, pos, hidden]`` (rows that sum to a stream) through the norm that reads the
    stream at ``layer`` (None: the final norm; else block ``layer``'s attention norm, or its MLP norm with
    ``mlp_input``), frozen at the scale it had in the pass, with its weight as it applies it. The norm's bias
    (where it has one, and ``incl_bias``) is one more row, so the rows still sum to the normed stream the model
    saw. ``pos_slice`` and ``batch_slice`` say which positions and prompts the stack holds (it is already sliced
    by ``pos_slice``; ``batch_slice`` is applied to it). ``recompute_ln=True`` (the final norm only) norms each row
    with its own statistics instead, as a stream of its own. With ``labels``, returns ``(stack, labels)``, the
    bias's label (``ln_final_bias``, ``{layer}_attention_norm_bias``, ...) added."""
    model = cache.model
    layer = _layer(model, layer, "apply_ln_to_stack")
    stack = _take(residual_stack, batch_slice, 1) if has_batch_dim else residual_stack
    labels = None if labels is None else list(labels)
    if recompute_ln:
        if layer != model.num_layers:
            raise ValueError("apply_ln_to_stack: recompute_ln=True norms with the final norm (layer None).")
        normed = stack.float()
        if model.family.ln_final is not None and len(stack):
            with torch.no_grad():
                normed = torch.stack([native(_module(model, None, None), row).float() for row in stack])
        return normed if labels is None else (normed, labels)
    norm, scale = _frozen_at(cache, layer, mlp_input, pos_slice, batch_slice, has_batch_dim)
    if norm is None:  # no final norm: the head reads the stream as it is
        return stack.float() if labels is None else (stack.float(), labels)
    normed = norm.linear(stack, scale)
    if incl_bias and norm.bias is not None:
        normed = torch.cat([normed, norm.bias.expand(normed.shape[1:])[None]])
        labels = None if labels is None else [*labels, f"{norm.label}_bias"]
    return normed if labels is None else (normed, labels)


# -- heads and neurons --------------------------------------------------------------------------


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


def _contribution(model, layer: int, name: str, what: str) -> Term:
    """Block ``layer``'s term of ``name`` in its identity: how the sublayer's output reaches the stream (Granite's
    times ``residual_multiplier``). A block whose identity is not the stream plus contributions (a gate or scalar on
    the stream, a norm after the add: post-norm OPT) is refused, as ``decompose_resid`` refuses it: no head or neuron
    there adds a fixed row to the stream."""
    terms = [term for term in block_sum(model, layer, what).terms if term.name == name]
    if not terms:
        _refuse(model, what, f"block {layer}'s identity, {model.block_spec(layer).formula}, does not add its {name} "
                             "to the stream")
    return terms[0]


def _has(model, layer: int, name: str) -> bool:
    return isinstance(model.block_spec(layer).resolve(name), At)


def head_results(cache, layer: int, pos_slice=None) -> torch.Tensor:
    """Each head's share of block ``layer``'s attention output, ``[heads, batch, pos, hidden]``: its slice of
    ``attention_premix`` through its columns of the output projection. They sum, with the projection's bias, to
    ``attention_output`` (within rounding), which is checked."""
    model = cache.model
    what = "stack_head_results"
    weight, bias, path = _projection(model, layer, "attention_premix", what)
    premix = _take(cache["attention_premix", layer], pos_slice, 1).float()  # [batch, pos, heads, head_dim]
    heads, head_dim = premix.shape[-2:]
    if weight.shape[1] != heads * head_dim:
        _refuse(model, what, f"block {layer}'s {path} reads {weight.shape[1]} features, not the {heads} heads' "
                             f"{heads * head_dim}")
    per_head = weight.to(premix.device).view(weight.shape[0], heads, head_dim)
    results = torch.einsum("...hd,ohd->h...o", premix, per_head)
    total = results.sum(0) + (0 if bias is None else bias.to(premix.device))
    output = _take(cache["attention_output", layer], pos_slice, -2)
    _sublayer_output_check(model, layer, total, output, path, "attention_output", what)
    return results


def neuron_results(cache, layer: int, neuron_slice=None, pos_slice=None) -> torch.Tensor:
    """Each MLP neuron's share of block ``layer``'s MLP output, ``[neurons, batch, pos, hidden]``: ``mlp_neurons``
    times its column of the down projection. All of them sum, with the projection's bias, to ``mlp_output``
    (within rounding), which is checked."""
    model = cache.model
    what = "stack_neuron_results"
    weight, bias, path = _projection(model, layer, "mlp_neurons", what)
    neurons = _take(cache["mlp_neurons", layer], pos_slice, -2).float()  # [batch, pos, neurons]
    weight = weight.to(neurons.device)
    if weight.shape[1] != neurons.shape[-1]:
        _refuse(model, what, f"block {layer}'s {path} reads {weight.shape[1]} features, not its "
                             f"{neurons.shape[-1]} mlp_neurons")
    total = neurons @ weight.t() + (0 if bias is None else bias.to(neurons.device))
    output = _take(cache["mlp_output", layer], pos_slice, -2)
    _sublayer_output_check(model, layer, total, output, path, "mlp_output", what)
    chosen = _take(torch.arange(neurons.shape[-1]), neuron_slice, 0).reshape(-1)
    columns = weight.t()[chosen.to(weight.device)]  # [neurons, hidden]
    return (neurons[..., chosen.to(neurons.device), None] * columns).movedim(-2, 0)


# -- mixtures of experts: the router's choice, and each expert's neurons ------------------------------

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
    plain = all(at.path == caller and not at.op and at.side == side and not (at.heads or at.unflatten or at.prefix
                                                                                 or at.count or at.join)
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
    if apply_ln:  # the norm's bias joins a stack whose rows sum to the stream
        stack, labels = apply_ln_to_stack(cache, stack, layer, pos_slice=pos_slice, incl_bias=incl_remainder,
                                          labels=labels)
    return (stack, labels) if return_labels else stack


def stack_head_results(cache, layer: int | None = -1, return_labels: bool = False, incl_remainder: bool = False,
                       pos_slice=None, apply_ln: bool = False):
    """Every attention head's share of the stream, for the blocks before ``layer`` (-1 or None: all):
    ``[heads, batch, pos, hidden]``, labelled ``L{i}H{h}`` (``head_results``), each as it reaches the stream
    (Granite's times ``residual_multiplier``): a block's heads and its projection's bias sum to its row of
    ``decompose_resid``. A block whose token mixer is not attention has none; a family whose blocks are not the
    stream plus contributions is refused, as ``decompose_resid`` is. ``incl_remainder`` adds the rest of the
    stream at ``layer`` (embeddings, projection biases, MLPs, other mixers) as ``remainder``; ``apply_ln`` passes the rows through the norm that reads that
    stream, frozen (its bias a row of its own with ``incl_remainder``)."""
    model = cache.model
    _warn_if_pads(cache, pos_slice, "stack_head_results")
    layer = _layer(model, layer, "stack_head_results")
    per_layer = []
    for i in range(layer):
        if not _has(model, i, "attention_output"):
            continue  # a token mixer that is not attention: no heads
        _available(model, i, "attention_premix", "stack_head_results")
        results = head_results(cache, i, pos_slice)  # checked against attention_output first: its reason first
        results = _contribution(model, i, "attention_output", "stack_head_results").of(results)
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
        per_layer.append((_contribution(model, i, "mlp_output", what).of(rows), labels))
    return _stack_of(cache, per_layer, layer, incl_remainder, pos_slice, apply_ln, return_labels)


# -- direct logit attribution -----------------------------------------------------------------------


def _scalar_of(transform, config) -> float | None:
    """The factor a logits transform multiplies by, where it is one (a scale, a cast); None where it is not linear
    (a softcap)."""
    probe = torch.linspace(-60, 60, 241).view(1, 1, -1)
    out = transform(probe, config).float()
    if out.shape != probe.shape:
        return None
    factor = (out[probe != 0] / probe[probe != 0]).mean().item()
    return factor if torch.allclose(out, probe * factor, rtol=1e-5, atol=1e-6) else None


def _directions(model, tokens, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's rows ``[..., hidden]`` and biases ``[...]`` of ``tokens`` (a string, an id, a list or a tensor)."""
    head = model.lm_head._module
    if not isinstance(head, nn.Linear):
        _refuse(model, what, f"the head ({type(head).__name__}) is not one linear map")
    ids = token_ids(model, tokens, "The token")
    ids = ids.to(head.weight.device)
    bias = None if head.bias is None else head.bias.detach().float()[ids]
    return head.weight.detach().float()[ids], bias


def logit_attrs(cache, residual_stack: torch.Tensor, tokens, incorrect_tokens=None, pos_slice=None,
                batch_slice=None, has_batch_dim: bool = True, incl_bias: bool = True,
                labels: Sequence[str] | None = None, before_logits_transform: bool = False):
    """Direct logit attribution: each row of ``residual_stack`` (rows that sum to the stream the final norm reads,
    e.g. ``decompose_resid()``), through the final norm frozen as it was in the pass, dotted with the head's row of
    ``tokens`` (minus ``incorrect_tokens``'s: a logit difference). ``[rows, batch, pos]``; tokens broadcast as in
    TransformerLens (an id, a string, ``[batch]`` with a position-sliced stack, ``[batch, pos]``). With
    ``incl_bias``, the final norm's bias and the head's are rows of their own (``ln_final_bias``,
    ``lm_head_bias``, where they exist), so the rows sum to the model's logit (or logit difference), within
    rounding, on the positions the stack holds. A model that scales its logits (Cohere, Granite) has that factor
    in every row; one that softcaps them is refused, as no sum of rows is the capped logit:
    ``before_logits_transform=True`` attributes the head's output before the cap. With ``labels``, returns
    ``(attributions, labels)`` with the bias rows' labels added."""
    model = cache.model
    what = "logit_attrs"
    _warn_if_pads(cache, pos_slice, what)
    family = model.family
    asked = labels is not None
    config = model.config
    # MiniCPM3 divides the normed stream by a scale before the head: a factor of every row
    factor = _scalar_of(family.head_input_transform, config) if family.head_input_transform else 1.0
    if family.head_input or family.vocab_projection or factor is None:
        _refuse(model, what, "the model transforms the normed stream between its final norm and its head's "
                             "projection on the vocabulary other than by a factor")
    if family.logits_transform and not before_logits_transform:
        after = _scalar_of(family.logits_transform, config)
        if after is None:
            _refuse(model, what, "the model softcaps its logits, tanh(logits / cap) * cap, which no sum of rows is; "
                                 "pass before_logits_transform=True to attribute the head's output before the cap")
        factor *= after
    direction, bias = _directions(model, tokens, what)
    if incorrect_tokens is not None:
        wrong, wrong_bias = _directions(model, incorrect_tokens, what)
        if wrong.shape != direction.shape:
            raise ValueError(f"tokens and incorrect_tokens have different shapes ({tuple(direction.shape[:-1])} and "
                             f"{tuple(wrong.shape[:-1])}).")
        direction = direction - wrong
        bias = None if bias is None else bias - wrong_bias
    stack = _take(residual_stack, batch_slice, 1) if has_batch_dim else residual_stack
    labels = [""] * len(residual_stack) if labels is None else list(labels)
    norm, scale = _frozen_at(cache, model.num_layers, False, pos_slice, batch_slice, has_batch_dim)
    direction = direction.to(stack.device)
    # the frozen norm folded into the direction: ((s - mean s) / scale * gain) · d == s · (w - mean w) / scale with
    # w = gain * d, one product per row, without a normed copy of the stack
    w = direction if norm is None or norm.gain is None else direction * norm.gain.to(stack.device)
    if norm is not None and norm.centred:
        w = w - w.mean(-1, keepdim=True)
    attributions = torch.matmul(stack.float().unsqueeze(-2), w.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    if norm is not None:
        attributions = attributions / scale.to(stack.device).squeeze(-1)
        if incl_bias and norm.bias is not None:
            row = (norm.bias.to(stack.device) * direction).sum(-1).expand(attributions.shape[1:])
            attributions, labels = torch.cat([attributions, row[None]]), [*labels, f"{norm.label}_bias"]
    if incl_bias and bias is not None:
        attributions = torch.cat([attributions, bias.to(attributions.device).expand(attributions.shape[1:])[None]])
        labels = [*labels, "lm_head_bias"]
    attributions = attributions * factor
    return (attributions, labels) if asked else attributions


# -- what is served ---------------------------------------------------------------------------------

SERVED = ("decompose_resid", "stack_head_results", "stack_neuron_results", "logit_attrs")


def refusal(cache, analysis: str) -> str | None:
    """Why ``analysis`` (one of ``SERVED``) is refused on this cache's model, ``AnalysisUnavailable``'s reason, or
    None where it is served: the analysis runs on the cache as a call would (``logit_attrs`` of the stream the final
    norm reads, a stack of one row, on token 0), so this is its own decision. The family pages list it."""
    calls = {"decompose_resid": lambda: decompose_resid(cache),
             "stack_head_results": lambda: stack_head_results(cache),
             "stack_neuron_results": lambda: stack_neuron_results(cache, None),
             "logit_attrs": lambda: logit_attrs(cache, stream_at(cache, cache.model.num_layers)[None],
                                                torch.tensor(0))}
    if analysis not in calls:
        raise ValueError(f"refusal: the analysis is one of {', '.join(SERVED)}, not {analysis!r}.")
    try:
        calls[analysis]()
    except AnalysisUnavailable as error:  # "{what} is unavailable on {family}: {reason}."
        head, _, reason = str(error).partition(": ")
        what = head.split(" is unavailable on ")[0]
        return (reason if what == analysis else f"{what}: {reason}").removesuffix(".")
    return None
