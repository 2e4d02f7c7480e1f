"""Tokens as text: ``to_str_tokens``, ``test_prompt``, and a readable form where whitespace shows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import nnsight
import numpy as np
import torch

from ..spec.sourced import sourced
from .refusals import refuse_unsupported

SHOWN = {" ": "␣", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def visible(token: str) -> str:
    """``token`` with its whitespace shown: ``" Paris"`` -> ``"␣Paris"``, ``"\\n"`` -> ``"\\\\n"``.

    Other characters that print nothing are escaped as Python does; an empty token is ``"∅"``.
    """
    if not token:
        return "∅"
    return "".join(SHOWN.get(c, c if c.isprintable() else repr(c)[1:-1]) for c in token)


def to_str_tokens(model, text_or_ids, prepend_bos: bool | None = None) -> list[str] | list[list[str]]:
    """Each token as the text it decodes to, exactly as the model's traces tokenize the input.

    A string or a 1-D tensor or list of ids gives a list of strings, and so does a tensor or array of one row,
    ``[1, seq]`` (as TransformerLens squeezes it); a list of strings or a tensor of several rows gives one list per
    row (each prompt tokenized on its own, without padding). Special tokens the tokenizer adds (a BOS) are
    included, since the model reads them; ``prepend_bos`` (for strings) puts a BOS first (True) or leaves none
    (False), as ``to_tokens`` does.
    """
    tokenizer = model.tokenizer
    if isinstance(text_or_ids, str):
        if prepend_bos is None and getattr(model, "_nnterp_default_prepend_bos", None) is None:
            return [tokenizer.decode([i]) for i in tokenizer(text_or_ids).input_ids]
        return [tokenizer.decode([i]) for i in _row_ids(model, text_or_ids, prepend_bos, truncate=True)]
    if isinstance(text_or_ids, np.ndarray):
        text_or_ids = torch.from_numpy(text_or_ids)
    if isinstance(text_or_ids, torch.Tensor):
        if text_or_ids.dim() not in (0, 1, 2):
            raise ValueError(f"Token ids are [seq] or [batch, seq], not a tensor of shape {tuple(text_or_ids.shape)}.")
        if text_or_ids.dim() == 2 and text_or_ids.shape[0] == 1:
            text_or_ids = text_or_ids[0]  # one row: its tokens (TransformerLens's [1, seq])
        text_or_ids = text_or_ids.reshape(-1).tolist() if text_or_ids.dim() == 0 else text_or_ids.tolist()
    if isinstance(text_or_ids, (list, tuple)):
        if all(isinstance(item, (int, np.integer)) for item in text_or_ids):
            return [tokenizer.decode([int(i)]) for i in text_or_ids]
        # the rows: each a string or ids, so each gives a list of strings
        return [cast("list[str]", to_str_tokens(model, item, prepend_bos)) for item in text_or_ids]
    raise TypeError(f"to_str_tokens takes a string, a list of strings, or token ids, not {type(text_or_ids).__name__}.")


# -- TransformerLens's tokens: to_tokens and its neighbours ------------------------------------------------------


def tokenizer_prepends_bos(tokenizer) -> bool:
    """Whether the tokenizer puts a BOS token before every text itself (it gives one for an empty text)."""
    ids = tokenizer("").input_ids
    return bool(ids) and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id


def default_prepend_bos(model) -> bool:
    """Whether strings get a BOS token first by default: the model's own setting (a HookedTransformer's is
    TransformerLens's, True), else what its tokenizer does."""
    own = getattr(model, "_nnterp_default_prepend_bos", None)
    return tokenizer_prepends_bos(model.tokenizer) if own is None else own


def context_length(model) -> int | None:
    """The most positions the model reads (its config's ``n_positions`` / ``max_position_embeddings``), or None."""
    config = model._module.config.get_text_config()
    return next((getattr(config, key) for key in ("n_positions", "max_position_embeddings", "n_ctx")
                 if isinstance(getattr(config, key, None), int)), None)


def _row_ids(model, text: str, prepend_bos: bool | None, truncate: bool) -> list[int]:
    """One text's ids, with a BOS token first (``prepend_bos`` True), without one (False), or as the model's default
    (None); cut to the model's context length where ``truncate``."""
    tokenizer = model.tokenizer
    want = default_prepend_bos(model) if prepend_bos is None else bool(prepend_bos)
    ids = list(tokenizer(text).input_ids)
    has = tokenizer_prepends_bos(tokenizer) and bool(ids) and ids[0] == tokenizer.bos_token_id
    if want and not has:
        if tokenizer.bos_token_id is None:
            if prepend_bos:
                raise ValueError("prepend_bos=True, but the tokenizer has no BOS token to prepend.")
        else:
            ids = [tokenizer.bos_token_id, *ids]
    elif has and not want:
        ids = ids[1:]
    limit = context_length(model)
    return ids[:limit] if truncate and limit else ids


def tokenized(model, texts, prepend_bos: bool | None = None, padding_side: str | None = None,
              truncate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)`` ``[batch, seq]`` of a text or a list of texts, padded on ``padding_side`` (None: the
    tokenizer's), with a BOS first as ``prepend_bos`` says (see ``to_tokens``)."""
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"to_tokens takes a string or a non-empty list of strings, not {texts!r}.")
    side = padding_side or getattr(model.tokenizer, "padding_side", None) or "right"
    if side not in ("left", "right"):
        raise ValueError(f"padding_side is 'left' or 'right', not {padding_side!r}.")
    rows = [_row_ids(model, text, prepend_bos, truncate) for text in texts]
    width = max(map(len, rows))
    pad = model.tokenizer.pad_token_id
    pad = model.tokenizer.eos_token_id if pad is None else pad
    if pad is None and any(len(row) < width for row in rows):
        raise ValueError("The texts have different lengths and the tokenizer has no pad (or EOS) token to pad with.")
    ids = torch.full((len(rows), width), 0 if pad is None else pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, row in enumerate(rows):
        where = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[k, where] = torch.tensor(row, dtype=torch.long)
        mask[k, where] = 1
    return ids, mask


def to_tokens(model, input, prepend_bos: bool | None = None, padding_side: str | None = None,
              move_to_device: bool = True, truncate: bool = True) -> torch.Tensor:
    """A text or a list of texts as token ids ``[batch, seq]`` (TransformerLens's ``to_tokens``).

    ``prepend_bos``: True puts the tokenizer's BOS token first (its id, where the tokenizer adds none itself),
    False leaves it out (removing one the tokenizer adds), None does as ``model.cfg.default_prepend_bos`` says (on
    a ``StandardizedTransformer``, what the tokenizer does; on a ``HookedTransformer``, True, as in
    TransformerLens). Several texts are padded on ``padding_side`` (None: the tokenizer's side). ``truncate`` cuts
    each to the model's context length. The ids are on the model's device (``move_to_device``).
    """
    ids, _ = tokenized(model, input, prepend_bos, padding_side, truncate)
    return ids.to(_device(model)) if move_to_device else ids


def _device(model) -> torch.device:
    parameter = next(model._module.parameters(), None)
    return torch.device("cpu") if parameter is None or parameter.device.type == "meta" else parameter.device


def tl_attention_mask(model, ids: torch.Tensor, prepend_bos: bool | None = None,
                      padding_side: str | None = None) -> torch.Tensor:
    """The mask TransformerLens gives token ids it is handed without one: where the tokenizer pads on the left
    (``padding_side``, None: the tokenizer's), each row's leading pad tokens are masked, except the last of them
    where it is the BOS a prompt starts with (pad and BOS one token, ``prepend_bos``); on the right, nothing is
    masked (a causal model's real tokens never read the pads after them)."""
    ids = torch.as_tensor(ids)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    mask = torch.ones_like(ids)
    tokenizer = model.tokenizer
    side = padding_side or getattr(tokenizer, "padding_side", None) or "right"
    if side != "left" or tokenizer.pad_token_id is None:
        return mask
    leading = (ids != tokenizer.pad_token_id).long().cumsum(-1) == 0
    mask[leading] = 0
    want_bos = default_prepend_bos(model) if prepend_bos is None else bool(prepend_bos)
    if want_bos and tokenizer.bos_token_id == tokenizer.pad_token_id:  # the last leading pad is the prompt's BOS
        last = leading.sum(-1) - 1
        rows = (last >= 0).nonzero().flatten()
        mask[rows, last[rows]] = 1
    return mask


def tl_inputs(model, texts, prepend_bos: bool | None = None, padding_side: str | None = None):
    """The batch a trace runs on for texts tokenized as ``to_tokens`` does: ids and the attention mask."""
    from transformers import BatchEncoding

    ids, mask = tokenized(model, texts, prepend_bos, padding_side)
    return BatchEncoding({"input_ids": ids, "attention_mask": mask})


def to_string(model, tokens) -> str | list[str]:
    """Token ids as text: one string for ``[seq]`` (or one id), a list of strings for ``[batch, seq]``
    (TransformerLens's ``to_string``, decoded as it is, without cleaning up spaces)."""
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(np.asarray(tokens) if not isinstance(tokens, list) or not tokens or not isinstance(
            tokens[0], torch.Tensor) else torch.stack(tokens))
    if tokens.dim() == 2:
        return model.tokenizer.batch_decode(tokens.tolist(), clean_up_tokenization_spaces=False)
    if tokens.dim() <= 1:
        return model.tokenizer.decode(tokens.reshape(-1).tolist(), clean_up_tokenization_spaces=False)
    raise ValueError(f"to_string takes ids [seq] or [batch, seq], not a tensor of shape {tuple(tokens.shape)}.")


def to_single_token(model, string: str) -> int:
    """The id of a string that is one token (tokenized without a BOS); a clear error for a string of several."""
    if not isinstance(string, str):
        raise TypeError(f"to_single_token takes a string, not {type(string).__name__}.")
    ids = to_tokens(model, string, prepend_bos=False, move_to_device=False)[0]
    if ids.numel() != 1:
        pieces = [model.tokenizer.decode([int(i)]) for i in ids]
        raise ValueError(f"{string!r} is {ids.numel()} tokens {pieces}, not a single token.")
    return int(ids[0])


def get_token_position(model, single_token, input, mode: str = "first", prepend_bos: bool | None = None,
                       padding_side: str | None = None) -> int:
    """Where ``single_token`` (an id, or a string that is one token) first (``mode="first"``) or last (``"last"``)
    occurs in ``input``: a text (tokenized as ``to_tokens`` does) or ids ``[seq]`` / ``[1, seq]``."""
    if mode not in ("first", "last"):
        raise ValueError(f"mode is 'first' or 'last', not {mode!r}.")
    tokens = to_tokens(model, input, prepend_bos, padding_side, move_to_device=False) if isinstance(
        input, str) else torch.as_tensor(input)
    if tokens.dim() == 2:
        if tokens.shape[0] != 1:
            raise ValueError(f"get_token_position reads one sequence: ids [seq] or [1, seq], not {tuple(tokens.shape)}.")
        tokens = tokens[0]
    if tokens.dim() != 1:
        raise ValueError(f"get_token_position reads ids [seq] or [1, seq], not a tensor of shape {tuple(tokens.shape)}.")
    token = to_single_token(model, single_token) if isinstance(single_token, str) else _single(
        model, single_token, "The token")
    found = (tokens == token).nonzero().flatten()
    if not len(found):
        raise ValueError(f"The token {token} ({model.tokenizer.decode([token])!r}) does not occur in the input.")
    return int(found[0] if mode == "first" else found[-1])


ACCEPTED = ("give an id (an int, a NumPy integer or a 0-d integer tensor), a string that is one token, or a list "
            "or tensor of them")


def token_ids(model, tokens, what: str = "The token") -> torch.Tensor:
    """``tokens`` as a long tensor of ids, the shape given (0-d for one token), every id in the vocabulary.

    Accepted: an int, a NumPy integer, a string that is one token (``" Paris"``), a tensor or NumPy array of ids,
    and lists or tuples of these (nested: ``[batch, pos]``). A float, or a float tensor, is taken where it is a
    whole number. Refused, naming what was given: booleans, fractional values, ids below 0 (torch would count
    them from the end of the vocabulary) or past the vocabulary, and a string of several tokens. ``what`` names
    the argument in the errors. ``model`` gives the tokenizer and the vocabulary size; with None, strings are
    refused and only ids below 0 are.
    """
    given = tokens
    if isinstance(tokens, str):
        return torch.tensor(_string_token(model, tokens, what))
    if isinstance(tokens, (bool, np.bool_)):
        raise TypeError(f"{what} {tokens!r} is a boolean, not a token: {ACCEPTED}.")
    if isinstance(tokens, (int, np.integer)):
        tokens = torch.tensor(int(tokens))
    elif isinstance(tokens, (float, np.floating)):
        tokens = torch.tensor(float(tokens), dtype=torch.float64)
    elif isinstance(tokens, np.ndarray) and tokens.dtype.kind in "biuf":
        tokens = torch.from_numpy(tokens)
    elif isinstance(tokens, (list, tuple, np.ndarray)):
        parts = [token_ids(model, token, what) for token in tokens]
        if len({part.shape for part in parts}) > 1:
            raise ValueError(f"{what} {tokens!r} is ragged (its entries hold different numbers of tokens): {ACCEPTED}.")
        return torch.stack(parts) if parts else torch.empty(0, dtype=torch.long)
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{what} {tokens!r} ({type(tokens).__name__}) is not a token: {ACCEPTED}.")
    if tokens.dtype == torch.bool:
        raise TypeError(f"{what} {tokens!r} is a boolean tensor, not token ids: {ACCEPTED}.")
    if tokens.is_complex() or (tokens.is_floating_point()
                               and not bool((tokens.isfinite() & (tokens == tokens.round())).all())):
        raise ValueError(f"{what} {tokens!r} is not a whole number: {ACCEPTED}.")  # never truncated
    vocab = getattr(model, "vocab_size", None)
    outside = (tokens < 0) if vocab is None else (tokens < 0) | (tokens >= vocab)
    if bool(outside.any()):  # checked before the cast, so that no float wraps around
        bad = int(tokens[outside].flatten()[0])
        where = "" if isinstance(given, int) else f" (given {given!r})"
        if vocab is None:
            raise ValueError(f"{what} id {bad} is negative{where}: ids count from 0, never from the end.")
        raise ValueError(f"{what} id {bad} is outside the vocabulary (0 to {vocab - 1}){where}.")
    return tokens.long()


def _string_token(model, token: str, what: str) -> int:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise TypeError(f"{what} {token!r} is a string, and there is no tokenizer here to read it with: give its id.")
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        raise ValueError(f"{what} {token!r} is {len(ids)} tokens {pieces}: give one token, e.g. {pieces[0] if pieces else ''!r} "
                         "(a word after a space usually starts with the space, e.g. ' Paris').")
    return ids[0]


def single_token(model, token, what: str = "The token") -> int:
    """The id of ``token``, one token in any form ``token_ids`` takes (an id, a string that is one token, ...)."""
    ids = token_ids(model, token, what)
    if ids.dim() != 0:
        raise ValueError(f"{what} {token!r} is {ids.numel()} tokens: give one.")
    return int(ids)


_single = single_token  # get_token_position's argument is TransformerLens's, named single_token too


@sourced
@dataclass(frozen=True)
class AnswerToken:
    """How the model ranks one token of the answer, at the position that predicts it."""

    token: str
    id: int
    rank: int  # 1 for the most likely token
    probability: float
    logit: float
    top: list[tuple[str, float]]  # the most likely tokens there, readable, with their probabilities

    def __str__(self) -> str:
        top = " | ".join(f"{token} {p:.4f}" for token, p in self.top)
        return (f"{visible(self.token)}: rank {self.rank}, probability {self.probability:.4f}, "
                f"logit {self.logit:.3f}\n  top {len(self.top)}: {top}")


class AnswerTokens(list):
    """``test_prompt``'s result: a list of ``AnswerToken``, printed as its report. A notebook shows the report once:
    the call prints it, so its first display as a cell's value shows nothing more."""

    def __init__(self, tokens, report: str, printed: bool):
        list.__init__(self, tokens)
        self.report, self._printed = report, printed

    def __str__(self) -> str:
        return self.report

    def __repr__(self) -> str:
        return "AnswerTokens([" + ", ".join(f"{visible(t.token)!r}: rank {t.rank}" for t in self) + "])"

    def _ipython_display_(self) -> None:
        if not self._printed:
            print(self.report)
        self._printed = False  # shown again when asked again


def test_prompt(model, prompt: str, answer, top_k: int = 10, prepend_space: bool = True,
                print_results: bool = True, remote: bool | str = False, logits_of=None) -> AnswerTokens:
    """How the model ranks ``answer`` after ``prompt``: one ``AnswerToken`` per token of the answer.

    The answer's tokens follow the prompt's (tokenized on their own, as TransformerLens does) in
    one forward pass; each is ranked by the distribution at the position before it (the prompt may be its token
    ids). With
    ``prepend_space`` an answer that does not start with whitespace gets a leading space, as a
    word after a space is usually tokenized. The answer may also be its token ids, one or a sequence, in any
    form ``token_ids`` takes (taken as they are). ``logits_of(ids)``, where given, runs the forward pass instead of
    a trace of the model (``[1, seq, vocab]``). Prints the tokens, the ranks and the ``top_k`` most
    likely tokens (whitespace shown, ``␣`` for a space) unless ``print_results=False``.
    """
    refuse_unsupported(model, "test_prompt")
    tokenizer = model.tokenizer
    if isinstance(answer, str):
        if prepend_space and answer and not answer[0].isspace():
            answer = " " + answer
        answer_ids = tokenizer.encode(answer, add_special_tokens=False)
    else:
        ids = token_ids(model, answer, "The answer")
        if ids.dim() > 1:
            raise ValueError(f"The answer is one sequence of tokens, not a tensor of shape {tuple(ids.shape)}.")
        answer_ids = ids.reshape(-1).tolist()
    if not answer_ids:
        raise ValueError("test_prompt needs a non-empty answer.")
    if isinstance(prompt, str):
        prompt_ids = tokenizer(prompt).input_ids
    else:  # the prompt's token ids, as given (TransformerLens's utils.test_prompt passes them with its BOS)
        prompt_ids = token_ids(model, prompt, "The prompt").reshape(-1).tolist()
    ids = torch.tensor([prompt_ids + answer_ids[:-1]])
    first = len(prompt_ids) - 1  # the position that predicts the answer's first token
    if logits_of is not None:  # the caller's forward pass (TransformerLens's utils.test_prompt: with its hooks)
        with torch.no_grad():
            logits = logits_of(ids)[0, first:].detach().float().cpu()
    else:
        with torch.no_grad(), model.trace(ids, remote=remote):
            logits = nnsight.save(model.logits[0, first:].detach().float().cpu())
    probs = logits.softmax(dim=-1)
    results = []
    for k, token_id in enumerate(answer_ids):
        p = probs[k]
        top = p.topk(min(top_k, p.shape[0]))
        results.append(AnswerToken(
            token=tokenizer.decode([token_id]), id=token_id, rank=int((p > p[token_id]).sum()) + 1,
            probability=float(p[token_id]), logit=float(logits[k, token_id]),
            top=[(visible(tokenizer.decode([int(i)])), float(q)) for i, q in zip(top.indices, top.values)]))
    report = "\n".join([f"Prompt: {[visible(tokenizer.decode([i])) for i in prompt_ids]}",
                         f"Answer: {[visible(tokenizer.decode([i])) for i in answer_ids]}",
                         *map(str, results)])
    if print_results:
        print(report)
    return AnswerTokens(results, report, printed=print_results)


test_prompt.__test__ = False  # type: ignore[attr-defined]  # a library function, not a test for pytest to collect

__all__ = ["AnswerToken", "AnswerTokens", "default_prepend_bos", "get_token_position", "single_token", "test_prompt",
           "tl_attention_mask", "tl_inputs", "to_single_token", "to_str_tokens", "to_string", "to_tokens", "token_ids", "tokenized",
           "tokenizer_prepends_bos", "visible"]
