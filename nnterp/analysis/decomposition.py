"""The stream, decomposed: what each block adds to it (``decompose_resid``), added back in the family's own order
(``recompose``), and the stream as each block receives it (``accumulated_resid``).

The decomposition is the addends of the blocks' identities (``blocks``); adding them back along the identities'
trees is the stream bit for bit, which is checked on the pass. It keeps the model's dtype, in which its sums are
exact.
"""

from __future__ import annotations

import torch

from ..spec.identity import Expr, names_in
from .blocks import BlockSum, add_up, block_sum, term_name
from .checks import _refuse, _why_not_exact
from .norms import apply_ln_to_stack, frozen_norm
from .reading import _layer, _readout_refusal, _take, _value, _warn_if_pads, stream_at

SHORT = {"attention_output": "attn_out", "mixer_output": "mixer_out", "mlp_output": "mlp_out"}
MODES = {"all": None, "attn": ("attention_output", "mixer_output"), "mlp": ("mlp_output",)}


def _plan(cache, layer: int, mlp_input: bool, what: str) -> list[tuple[BlockSum, Expr]]:
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
    """Every addend of the plan as it reaches the stream: labels, value names, rows, and per block (block, part,
    (name, row) of its addends)."""
    labels, names_of, rows, parts = [], [], [], []
    for block, part in plan:
        names = names_in(part)
        mine = []
        for term in block.terms:
            name = term_name(term)
            if name in names:
                value = _take(_value(cache, name, block.layer), pos_slice, -2)
                labels.append(f"{block.layer}_{SHORT.get(name, name)}")
                names_of.append(name)
                rows.append(block.reaching(term, value))
                mine.append((name, len(rows) - 1))
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
                     for name in ("layer_input", *map(term_name, block.terms))]
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
    through the norm that reads that stream, frozen (``apply_ln_to_stack``): as many rows, which sum to the
    normed stream less the norm's bias.
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
        names = names_in(part)
        mine = [(name, count + k) for k, name in enumerate(n for n in map(term_name, block.terms) if n in names)]
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
