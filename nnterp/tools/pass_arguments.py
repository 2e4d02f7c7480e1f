"""The arguments of one pass of TransformerLens's methods and of ``run_with_cache``: the inputs as the batch a trace
runs on (strings tokenized as ``to_tokens`` does, token ids masked and positioned as TransformerLens does on a
``HookedTransformer``), the arguments nnterp refuses with what to do instead, and what a pass returns (logits, the
next-token loss)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import BatchEncoding

from ..core.tokens import tl_attention_mask, tl_inputs

RETURN_TYPES = ("logits", "loss", "both", None)
# TransformerLens's arguments nnterp has no use for, each with what to do instead
FOREIGN_ARGUMENTS = {
    "device": "nnterp runs where the model's weights are and caches there: move a tensor with cache[name].to(device), "
              "or the model itself",
    "return_cache_object": "nnterp always returns its ActivationCache (cache[name] gives each tensor)",
    "incl_bwd": "run_with_cache runs without gradients: save values in a model.trace and call .backward() there",
    "pos_slice": "slice the cached tensors (cache['resid_post', 5][:, pos])",
    "fwd_hooks": "run_with_hooks(input, fwd_hooks=[...]) runs hooks; with model.hooks(fwd_hooks=[...]): run_with_cache "
                 "applies them",
    "bwd_hooks": "nnterp runs no backward hooks: save values in a model.trace and call .backward() there",
    "start_at_layer": "nnterp runs the model from its tokens: edit the stream in a trace "
                      "(model.layers[k].layer_input = x) to start from a stream of your own",
    "attention_mask": "pass the tokenizer's output (a mapping with input_ids and attention_mask) as the input",
    "loss_per_token": "run_with_cache returns the mean loss: model.loss_per_token(input) gives it per token",
}


def _refuse_foreign_arguments(arguments: dict, generating: bool, what: str = "run_with_cache",
                              accepted: str | None = None) -> None:
    for name in arguments:
        if name in FOREIGN_ARGUMENTS:
            raise TypeError(f"{what} got {name}=, a TransformerLens argument nnterp does not take: "
                            f"{FOREIGN_ARGUMENTS[name]}.")
    if arguments and accepted:
        raise TypeError(f"{what} got {', '.join(sorted(arguments))}: its arguments are {accepted}.")
    if arguments and not generating:
        raise TypeError(f"{what} got {', '.join(sorted(arguments))}: generation settings, and it generates only with "
                        "max_new_tokens=N. Its arguments are names, layers, remote, names_filter, remove_batch_dim, "
                        "stop_at_layer, return_type, prepend_bos, padding_side, max_new_tokens and steer.")


def _one_prompt(ids: torch.Tensor) -> None:
    if ids.shape[0] != 1:
        raise ValueError(f"remove_batch_dim=True takes one prompt, not a batch of {ids.shape[0]}.")


def _returned(model, logits, ids, mask, return_type):
    """What the pass returns for ``return_type``: the logits, the mean next-token loss over the real tokens, both
    (a ``(logits, loss)`` pair), or None. The logits keep their batch dimension even with ``remove_batch_dim``
    (TransformerLens's removes it from the cache only)."""
    if return_type is None:
        return None
    if return_type != "logits":
        loss = lm_loss(logits, ids, mask)
    return {"logits": lambda: logits, "loss": lambda: loss, "both": lambda: (logits, loss)}[return_type]()


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None = None,
            per_token: bool = False) -> torch.Tensor:
    """The next-token cross-entropy: ``[batch, seq - 1]`` per token (0 where the token or the one it predicts is a
    pad), or its mean over the real predictions."""
    log_probs = logits.float().log_softmax(-1)[:, :-1]
    ids = ids.to(logits.device)
    losses = -log_probs.gather(-1, ids[:, 1:, None])[..., 0]
    if mask is not None:
        real = (mask[:, :-1].bool() & mask[:, 1:].bool()).to(logits.device)
        losses = losses.masked_fill(~real, 0.0)
        count = real.sum()
    else:
        count = torch.tensor(losses.numel())
    return losses if per_token else losses.sum() / count



def _inputs(model, prompts, prepend_bos: bool | None = None, padding_side: str | None = None) -> BatchEncoding:
    """``_batch``; on a ``HookedTransformer``, with TransformerLens's positions where the mask has pads: each token at
    its place among its row's real tokens (nnsight supplies them only where the tokenizer pads on the left)."""
    batch = _batch(model, prompts, prepend_bos, padding_side)
    mask = batch["attention_mask"]
    if getattr(model, "_nnterp_default_prepend_bos", None) is not None and not bool(mask.all()):
        batch["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return batch


def _batch(model, prompts, prepend_bos: bool | None = None, padding_side: str | None = None) -> BatchEncoding:
    """The batch a trace runs on: strings tokenized as the model's traces tokenize them (with or without a BOS token
    first: ``prepend_bos``, the model's ``to_tokens``), or ids as given (a tensor, or a tokenizer's output: a mapping
    with ``input_ids`` and, for a padded batch, ``attention_mask``)."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(isinstance(p, str) for p in prompts)):
        if (prepend_bos is not None or padding_side is not None
                or getattr(model, "_nnterp_default_prepend_bos", None) is not None):
            return tl_inputs(model, prompts, prepend_bos, padding_side)
    elif padding_side is not None:
        raise TypeError("padding_side applies to strings: these inputs are already token ids.")
    if isinstance(prompts, Mapping):
        if "input_ids" not in prompts:
            raise TypeError(f"A mapping of inputs holds 'input_ids' (and 'attention_mask'), as a tokenizer returns; "
                            f"this one has {sorted(prompts)}.")
        ids = _batch(model, prompts["input_ids"])["input_ids"]
        mask = prompts.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
        mask = mask.unsqueeze(0) if mask.dim() == 1 else mask
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}: give one "
                             "mask entry per token.")
        return BatchEncoding({"input_ids": ids, "attention_mask": mask})
    if isinstance(prompts, torch.Tensor):
        ids = prompts.unsqueeze(0) if prompts.dim() == 1 else prompts
        if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
            raise ValueError(f"Token ids are an integer tensor [batch, seq] or [seq], not {ids.dtype} {tuple(ids.shape)}.")
        # TransformerLens's methods mask the leading pads of ids padded on the left, as TransformerLens does
        tl = getattr(model, "_nnterp_default_prepend_bos", None) is not None
        mask = tl_attention_mask(model, ids, prepend_bos) if tl else torch.ones_like(ids)
        return BatchEncoding({"input_ids": ids, "attention_mask": mask.to(ids.device)})
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts is a string, a non-empty list of strings, or a tensor of token ids.")
    return model.tokenizer(prompts, return_tensors="pt", padding=True)
