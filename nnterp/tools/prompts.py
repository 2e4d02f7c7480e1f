"""Prompts with target tokens: first-token handling and target probabilities per category."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..core.tokens import token_ids
from .refusals import refuse_unsupported


def first_tokens(tokenizer, word: str) -> list[int]:
    """The first token of ``" word"`` and of ``"word"`` (deduplicated), as a model may continue with either.

    The leading-space form comes first. Tokens are taken from the word in context after a
    neutral prefix, so tokenizers that add a prefix space or a BOS token do not shift them.
    """
    from nnsight import Envoy

    if isinstance(tokenizer, Envoy):
        raise TypeError("first_tokens takes the tokenizer, not the model: first_tokens(model.tokenizer, word).")
    word = word.strip()
    ids = []
    for text in (" " + word, word):
        prefix = tokenizer("\n", add_special_tokens=False).input_ids
        full = tokenizer("\n" + text, add_special_tokens=False).input_ids
        if full[: len(prefix)] == prefix and len(full) > len(prefix):
            token = full[len(prefix)]
        else:
            token = tokenizer(text, add_special_tokens=False).input_ids[0]
        if token not in ids:
            ids.append(token)
    return ids


@dataclass(init=False)
class Prompt:
    """A prompt and, per category, the token ids whose probabilities count for it.

    ``Prompt(text, targets, target_words)``; 1.x's keywords (``prompt=``, ``target_tokens=``,
    ``target_strings=``) and attribute names name the same fields.
    """

    text: str
    targets: dict[str, list[int]]
    target_words: dict[str, list[str]] = field(default_factory=dict)

    def __init__(self, text: str | None = None, targets: dict[str, list[int]] | None = None,
                 target_words: dict[str, list[str]] | None = None, *, prompt: str | None = None,
                 target_tokens: dict[str, list[int]] | None = None, target_strings=None):
        self.text = text if text is not None else prompt
        targets = targets if targets is not None else target_tokens
        self.target_words = dict(target_words if target_words is not None else (target_strings or {}))
        if self.text is None or targets is None:
            raise TypeError("Prompt needs its text and its targets: Prompt(text, {category: [token ids]}).")
        # ids in any form token_ids takes, kept as lists (a bare id would sum over the batch); negatives refused
        self.targets = {category: token_ids(None, ids, f"The target {category!r}").reshape(-1).tolist()
                        for category, ids in targets.items()}

    @classmethod
    def from_strings(cls, text: str, targets: dict[str, str | Sequence[str]] | str | Sequence[str], tokenizer) -> Prompt:
        """``targets`` maps a category to a word or words (one word or a list: category ``"target"``); each
        word counts with and without a leading space. ``tokenizer`` may be the model (its tokenizer is used)."""
        if isinstance(targets, (str, list, tuple)):
            targets = {"target": targets}
        tokenizer = tokenizer_of(tokenizer)
        words = {k: [v] if isinstance(v, str) else list(v) for k, v in targets.items()}
        ids = {k: sorted({t for w in ws for t in first_tokens(tokenizer, w)}) for k, ws in words.items()}
        return cls(text, ids, words)

    # 1.x names of the fields
    prompt = property(lambda self: self.text)
    target_tokens = property(lambda self: self.targets)
    target_strings = property(lambda self: self.target_words)

    def collisions(self) -> set[int]:
        """Token ids that count for more than one category (which would make their probabilities overlap)."""
        seen, shared = set(), set()
        for ids in self.targets.values():
            shared |= seen & set(ids)
            seen |= set(ids)
        return shared

    def has_no_collisions(self, ignore_targets: None | str | list[str] = None) -> bool:
        """1.x: True when no token counts for two categories (those in ``ignore_targets`` aside)."""
        ignored = {ignore_targets} if isinstance(ignore_targets, str) else set(ignore_targets or [])
        tokens = [t for category, ids in self.targets.items() if category not in ignored for t in ids]
        return len(tokens) == len(set(tokens))

    def target_probabilities(self, probs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sum of each category's token probabilities over the last dimension of ``probs``."""
        return {k: probs[..., ids].sum(dim=-1) for k, ids in self.targets.items()}

    def get_target_probs(self, probs: torch.Tensor, layer: int | None = None) -> dict[str, torch.Tensor]:
        """1.x: ``probs`` is ``[batch, layers, vocab]``; per category ``[batch, layers]`` (``[batch]`` at ``layer``)."""
        result = {k: p.cpu() for k, p in self.target_probabilities(probs).items()}
        return result if layer is None else {k: p[:, layer] for k, p in result.items()}

    def run(self, nn_model, get_probs: Callable) -> dict[str, torch.Tensor]:
        """1.x: ``get_probs(model, text)`` gives ``[batch, layers, vocab]``; the categories' probabilities."""
        with torch.no_grad():
            return self.get_target_probs(get_probs(nn_model, self.text))


def tokenizer_of(tokenizer_or_model):
    """The tokenizer itself, or a model's (an nnsight model or a StandardizedTransformer)."""
    from nnsight import Envoy

    if isinstance(tokenizer_or_model, Envoy):
        tokenizer = getattr(tokenizer_or_model, "tokenizer", None)
        if tokenizer is None:
            raise TypeError("A tokenizer was expected; this model has none. Pass its tokenizer.")
        return tokenizer
    return tokenizer_or_model


def run_prompts(model, prompts: Sequence[Prompt], batch_size: int = 32,
                get_probs: Callable | None = None, progress: bool = True,
                remote: bool | str = False) -> dict[str, torch.Tensor]:
    """Target probabilities of every prompt, batched (padded on either side: each prompt's own last token counts).

    ``get_probs(model, texts)`` returns next-token probabilities ``[batch, vocab]`` (the default)
    or ``[batch, layers, vocab]`` (e.g. ``nnterp.tools.lens.logit_lens``). Returns, per category, a
    ``[prompts]`` or ``[prompts, layers]`` tensor. ``remote=True`` runs the default on the remote model.
    """
    refuse_unsupported(model, "run_prompts")
    get_probs = get_probs or (lambda model, texts: next_token_probabilities(model, texts, remote))
    results: dict[str, list[torch.Tensor]] = {}
    batches = range(0, len(prompts), batch_size)
    for start in tqdm(batches, desc="prompts", disable=not progress or len(batches) < 2):
        batch = prompts[start:start + batch_size]
        probs = get_probs(model, [p.text for p in batch])
        for row, prompt in enumerate(batch):
            for category, p in prompt.target_probabilities(probs[row]).items():
                results.setdefault(category, []).append(p)
    return {category: torch.stack(values) for category, values in results.items()}


def next_token_probabilities(model, texts: Sequence[str], remote: bool | str = False) -> torch.Tensor:
    """``[batch, vocab]`` next-token probabilities after each text's own last token, whichever side pads."""
    import nnsight

    from ..spec.selection import token_index

    inputs = model.tokenizer(list(texts), return_tensors="pt", padding=True)
    rows, last = torch.arange(len(texts)), token_index(inputs.attention_mask, -1)
    with torch.no_grad(), model.trace(inputs, remote=remote):
        logits = model.logits
        probs = nnsight.save(logits[rows, last.to(logits.device)].softmax(dim=-1))
    return probs.float().cpu()
