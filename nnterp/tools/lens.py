"""The logit lens: every layer's stream read through the model's own readout (final norm, head); the tuned lens:
each layer's stream through its translator first (``lens=load_tuned_lens(folder)``)."""

from __future__ import annotations

from collections.abc import Sequence

import nnsight
import torch

from ..core.tokens import single_token, visible
from ..spec.catalog import ADDED, STREAM
from ..spec.selection import block_calls, calls_in_forward_order, token_index
from .refusals import own_tool, refuse_unsupported

STREAM_VALUES = STREAM + ADDED  # [batch, seq, hidden] values the readout reads: the stream, or what is added to it


def logit_lens(model, prompts: str | Sequence[str], layers=None, value: str = "layer_output",
               position: int | None = -1, remote: bool | str = False, return_inv_logits: bool = False,
               lens=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Next-token probabilities from each layer's ``value``, through ``model.project_on_vocab``.

    Returns ``[prompts, layers, vocab]`` at ``position`` of each prompt's own tokens (the last by
    default), or ``[prompts, layers, seq, vocab]`` over the padded batch with ``position=None``.
    The layers come back in the order asked for, repeats included. On a model whose blocks run several
    times per pass (a looped one), ``layers`` may name one run of a block as ``(layer, run)``, and by default
    the rows are every block call of the pass, in forward order (``model.schedule``). ``value`` is a
    ``[batch, seq, hidden]`` value: the stream (``layer_input``, ``layer_mid``, ``layer_output``)
    or a contribution (``attention_output``, ``mixer_output``, ``mlp_output``). On the last layer's
    ``layer_output`` the lens is the model's own next-token distribution. The readout runs inside
    the trace, so ``remote=True`` runs the whole lens on the remote model. ``return_inv_logits=True``
    (1.x) also returns the lens of the negated streams.

    ``lens`` (a ``TunedLens``, ``nnterp.load_tuned_lens``) makes it the tuned lens: each layer's stream goes
    through its translator, ``h + h @ weight.T + bias``, before the readout (the last block's output as it is);
    ``value`` is then ``layer_output`` or ``layer_input``, the streams it was trained on.
    """
    refuse_unsupported(model, "logit_lens")
    own = own_tool(model, "logit_lens")
    if own is not None:
        return own(prompts, layers, value, position, remote=remote, return_inv_logits=return_inv_logits, lens=lens)
    name = value.rpartition(".")[2]
    if name not in STREAM_VALUES:
        raise ValueError(f"logit_lens reads one of {', '.join(STREAM_VALUES)}, not {value!r}.")
    model.refuse_unreadable_stream()  # before the trace: a family whose readout mixes more than one stream
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    calls = block_calls(model, layers)
    if lens is not None:
        _check_lens(model, lens, name, calls)
    ordered = calls_in_forward_order(model, calls)
    inputs = model.tokenizer(prompts, return_tensors="pt", padding=True)
    rows = torch.arange(len(prompts))
    index = None if position is None else token_index(inputs.attention_mask, position)
    signs = (1, -1) if return_inv_logits else (1,)
    with torch.no_grad(), model.trace(inputs, remote=remote) as tracer:
        per_layer = {}
        for i, run in ordered:
            hidden = model.read_value(i, name, run=run)
            # one token per prompt, keeping the sequence dimension a stream readout (DeepSeek-V4) expects
            hidden = hidden if index is None else hidden[rows, index.to(hidden.device)].unsqueeze(1)
            streams = [sign * hidden for sign in signs]
            if lens is not None:  # the tuned lens: each stream through its layer's translator first
                streams = [lens.translate(stream, i, name) for stream in streams]
            per_layer[(i, run)] = [model.project_on_vocab(stream).float().softmax(dim=-1).cpu() for stream in streams]
        lenses = nnsight.save([torch.stack([per_layer[call][k] for call in calls], dim=1) for k in range(len(signs))])
        tracer.stop()  # the readout ran here: the model's own head after the last layer read is not needed
    lenses = [lens if position is None else lens[:, :, 0] for lens in lenses]
    return tuple(lenses) if return_inv_logits else lenses[0]


def _check_lens(model, lens, value: str, calls) -> None:
    from .tuned_lens import TunedLens

    if not isinstance(lens, TunedLens):
        raise TypeError(f"lens is a TunedLens (nnterp.load_tuned_lens), not {type(lens).__name__}.")
    lens.check(model)
    lens.translator(0, value)  # the streams between blocks only, with the reason
    if any(run is not None for _, run in calls):
        raise ValueError("A tuned lens has one translator per layer, and this model runs some blocks several times "
                         "per pass: which run a translator was trained on is not known.")


def top_tokens(model, probs: torch.Tensor, k: int = 5, readable: bool = True) -> list:
    """The ``k`` most likely ``(token, probability)`` pairs for each distribution in ``probs`` (nested lists).

    Tokens are shown readable by default, whitespace visible (``"␣Paris"``, ``"\\n"``, see
    ``nnterp.core.tokens.visible``); ``readable=False`` gives the exact decoded text (``" Paris"``).
    """
    probs = probs.detach()
    if probs.dim() == 1:
        top = probs.topk(k)
        decoded = (model.tokenizer.decode(int(t)) for t in top.indices)
        return [(visible(t) if readable else t, float(p)) for t, p in zip(decoded, top.values)]
    return [top_tokens(model, row, k, readable) for row in probs]


def _lens_table(model, probs: torch.Tensor, target=None, k: int = 3) -> str:
    """One prompt's lens ``[layers, vocab]`` as a text table (used by the CLI and the demo); ``target`` is one token
    in any form ``nnterp.core.tokens.token_ids`` takes."""
    lines = []
    target_id = None if target is None else single_token(model, target, "The target")
    column = "" if target_id is None else f"{'P(' + repr(model.tokenizer.decode([target_id])) + ')':>12}  {'rank':>6}  "
    header = f"  {'layer':>5}  " + column + f"top-{k}"
    lines.append(header)
    for i, (p, top) in enumerate(zip(probs, top_tokens(model, probs, k))):
        shown = ", ".join(f"'{tok}' {q:.2f}" for tok, q in top)
        if target_id is None:
            lines.append(f"  {i:>5}  {shown}")
        else:
            rank = int((p > p[target_id]).sum()) + 1
            lines.append(f"  {i:>5}  {float(p[target_id]):>12.4f}  {rank:>6}  {shown}")
    return "\n".join(lines)


__all__ = ["logit_lens", "top_tokens"]
