"""nnterp 1.x's ``nnterp.prompt_utils``: prompts with targets, run in batches, with 1.x's signatures and shapes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm as _tqdm

from ..tools.prompts import Prompt, first_tokens, tokenizer_of  # noqa: F401
from .legacy import deprecated


class TokenizationError(Exception):
    """A word's first token could not be found."""


def get_first_tokens(words: str | list[str], llm_or_tokenizer, use_hacky_implementation: bool = False) -> list[int]:
    """The first tokens of ``"word"`` and ``" word"`` for every word (the model's tokenizer when given a model)."""
    deprecated("get_first_tokens(words, tokenizer)", "nnterp.first_tokens(tokenizer, word)")
    tokenizer = tokenizer_of(llm_or_tokenizer)
    tokens = []
    for word in [words] if isinstance(words, str) else words:
        tokens += first_tokens(tokenizer, word)
    return list(dict.fromkeys(tokens))


def next_token_probs_unsqueeze(nn_model, prompt: str | list[str], remote=False, **_kwargs) -> torch.Tensor:
    """``[batch, 1, vocab]``: next-token probabilities with a layer dimension of one (1.x's default)."""
    from ..tools.prompts import next_token_probabilities

    return next_token_probabilities(nn_model, [prompt] if isinstance(prompt, str) else prompt, remote).unsqueeze(1)


@torch.no_grad()
def run_prompts(nn_model, prompts: list[Prompt], batch_size: int = 32, get_probs_func: Callable | None = None,
                func_kwargs: dict | None = None, remote: bool = False, tqdm=_tqdm) -> dict[str, torch.Tensor]:
    """1.x: per target, ``[prompts, layers]`` probabilities (``[prompts, 1]`` with the default next-token probs)."""
    deprecated("nnterp.prompt_utils.run_prompts(model, prompts, get_probs_func=f)",
               "nnterp.run_prompts(model, prompts, get_probs=f) (returns [prompts] for next-token probabilities)")
    from nnsight import Envoy

    if not isinstance(nn_model, Envoy):
        raise TypeError(f"run_prompts takes the model first, got {type(nn_model).__name__}.")
    if not prompts:
        return {}
    keys = set(prompts[0].targets)
    for prompt in prompts:
        if set(prompt.targets) != keys:
            raise ValueError(f"All prompts must have the same target keys. Got {keys} and {set(prompt.targets)}")
    get_probs_func = get_probs_func or next_token_probs_unsqueeze
    starts = range(0, len(prompts), batch_size)
    if tqdm is not None:
        starts = tqdm(starts, desc="Running prompts")
    probs = torch.cat([get_probs_func(nn_model, [p.text for p in prompts[i:i + batch_size]], remote=remote,
                                      **(func_kwargs or {})) for i in starts])
    return {target: torch.stack([probs[i, :, prompt.targets[target]].sum(dim=-1) for i, prompt in enumerate(prompts)]
                                ).cpu() for target in prompts[0].targets}


__all__ = ["Prompt", "TokenizationError", "get_first_tokens", "next_token_probs_unsqueeze", "run_prompts"]
