"""Tokens as text: ``to_str_tokens``, ``test_prompt``, and a readable form where whitespace shows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import nnsight
import numpy as np
import torch

from ..spec.sourced import sourced

SHOWN = {" ": "␣", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def visible(token: str) -> str:
    """``token`` with its whitespace shown: ``" Paris"`` -> ``"␣Paris"``, ``"\\n"`` -> ``"\\\\n"``.

    Other characters that print nothing are escaped as Python does; an empty token is ``"∅"``.
    """
    if not token:
        return "∅"
    return "".join(SHOWN.get(c, c if c.isprintable() else repr(c)[1:-1]) for c in token)


def to_str_tokens(model, text_or_ids) -> list[str] | list[list[str]]:
    """Each token as the text it decodes to, exactly as the model's traces tokenize the input.

    A string or a 1-D tensor or list of ids gives a list of strings; a list of strings or a 2-D
    tensor gives one list per row (each prompt tokenized on its own, without padding).
    Special tokens the tokenizer adds (a BOS) are included, since the model reads them.
    """
    tokenizer = model.tokenizer
    if isinstance(text_or_ids, str):
        return [tokenizer.decode([i]) for i in tokenizer(text_or_ids).input_ids]
    if isinstance(text_or_ids, torch.Tensor):
        if text_or_ids.dim() not in (1, 2):
            raise ValueError(f"Token ids are [seq] or [batch, seq], not a tensor of shape {tuple(text_or_ids.shape)}.")
        text_or_ids = text_or_ids.tolist()
    if isinstance(text_or_ids, (list, tuple)):
        if all(isinstance(item, int) for item in text_or_ids):
            return [tokenizer.decode([i]) for i in text_or_ids]
        # the rows: each a string or ids, so each gives a list of strings
        return [cast("list[str]", to_str_tokens(model, item)) for item in text_or_ids]
    raise TypeError(f"to_str_tokens takes a string, a list of strings, or token ids, not {type(text_or_ids).__name__}.")


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
                print_results: bool = True, remote: bool | str = False) -> AnswerTokens:
    """How the model ranks ``answer`` after ``prompt``: one ``AnswerToken`` per token of the answer.

    The answer's tokens follow the prompt's (tokenized on their own, as TransformerLens does) in
    one forward pass; each is ranked by the distribution at the position before it. With
    ``prepend_space`` an answer that does not start with whitespace gets a leading space, as a
    word after a space is usually tokenized. The answer may also be its token ids, one or a sequence, in any
    form ``token_ids`` takes (taken as they are). Prints the tokens, the ranks and the ``top_k`` most
    likely tokens (whitespace shown, ``␣`` for a space) unless ``print_results=False``.
    """
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
    prompt_ids = tokenizer(prompt).input_ids
    ids = torch.tensor([prompt_ids + answer_ids[:-1]])
    first = len(prompt_ids) - 1  # the position that predicts the answer's first token
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

__all__ = ["AnswerToken", "AnswerTokens", "single_token", "test_prompt", "to_str_tokens", "token_ids", "visible"]
