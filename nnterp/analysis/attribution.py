"""Direct logit attribution: a stack's rows through the final norm frozen as it was in the pass, on the head's rows
of some tokens (``logit_attrs``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..core.tokens import token_ids
from .checks import _refuse
from .norms import _frozen_at
from .reading import _take, _warn_if_pads


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
                batch_slice=None, has_batch_dim: bool = True, incl_bias: bool = False,
                labels: Sequence[str] | None = None, before_logits_transform: bool = False):
    """Direct logit attribution: each row of ``residual_stack`` (rows that sum to the stream the final norm reads,
    e.g. ``decompose_resid()``), through the final norm frozen as it was in the pass (``apply_ln_to_stack``),
    dotted with the head's row of ``tokens`` (minus ``incorrect_tokens``'s: a logit difference). ``[rows, batch,
    pos]``, one value per row of the stack, as in TransformerLens; tokens broadcast as there (an id, a string,
    ``[batch]`` with a position-sliced stack, ``[batch, pos]``).

    The rows sum to the model's logit (or logit difference), within rounding, less the biases' term: the final
    norm's bias dotted with the head's row, plus the head's bias of the token (``ln_final.bias @ W[t] + b[t]``,
    each minus the incorrect token's), which is TransformerLens's ``b_U[t]`` after ``fold_ln``. ``incl_bias=True``
    adds that term as rows of its own after the stack's (``ln_final_bias``, ``lm_head_bias``, where they exist),
    so ``logit_attrs(stack[:0], ..., incl_bias=True).sum(0)`` is the term alone. A model that scales its logits
    (Cohere, Granite) has that factor in every row, the term's included; one that softcaps them is refused, as no
    sum of rows is the capped logit: ``before_logits_transform=True`` attributes the head's output before the cap.
    With ``labels``, returns ``(attributions, labels)``, the bias rows' labels added with them."""
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
