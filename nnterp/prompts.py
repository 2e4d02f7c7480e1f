"""Prompts with target tokens: first-token handling and target probabilities per category."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm


def first_tokens(tokenizer, word: str) -> list[int]:
    """The first token of ``" word"`` and of ``"word"`` (deduplicated), as a model may continue with either.

    The leading-space form comes first. Tokens are taken from the word in context after a
    neutral prefix, so tokenizers that add a prefix space or a BOS token do not shift them.
    """
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


@dataclass
class Prompt:
    """A prompt and, per category, the token ids whose probabilities count for it."""

    text: str
    targets: dict[str, list[int]]
    target_words: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_strings(cls, text: str, targets: dict[str, str | Sequence[str]], tokenizer) -> Prompt:
        """``targets`` maps a category to a word or words; each word counts with and without a leading space."""
        words = {k: [v] if isinstance(v, str) else list(v) for k, v in targets.items()}
        ids = {k: sorted({t for w in ws for t in first_tokens(tokenizer, w)}) for k, ws in words.items()}
        return cls(text, ids, words)

    def collisions(self) -> set[int]:
        """Token ids that count for more than one category (which would make their probabilities overlap)."""
        seen, shared = set(), set()
        for ids in self.targets.values():
            shared |= seen & set(ids)
            seen |= set(ids)
        return shared

    def target_probabilities(self, probs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sum of each category's token probabilities over the last dimension of ``probs``."""
        return {k: probs[..., ids].sum(dim=-1) for k, ids in self.targets.items()}


def run_prompts(model, prompts: Sequence[Prompt], batch_size: int = 32,
                get_probs: Callable | None = None, progress: bool = True,
                remote: bool | str = False) -> dict[str, torch.Tensor]:
    """Target probabilities of every prompt, batched with left padding.

    ``get_probs(model, texts)`` returns next-token probabilities ``[batch, vocab]`` (the default)
    or ``[batch, layers, vocab]`` (e.g. ``nnterp.lens.logit_lens``). Returns, per category, a
    ``[prompts]`` or ``[prompts, layers]`` tensor. ``remote=True`` runs the default on the remote model.
    """
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
    """``[batch, vocab]`` next-token probabilities of a (left-padded) batch."""
    import nnsight

    with torch.no_grad(), model.trace(list(texts), remote=remote):
        probs = nnsight.save(model.next_token_probs)
    return probs.float().cpu()
