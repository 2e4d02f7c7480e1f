"""Metrics of the logits, for activation patching: functions ``logits -> [batch]`` of the last position."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.tokens import single_token


def logit_difference(correct, incorrect, model=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric: last-position logit of ``correct`` minus that of ``incorrect``, per batch row.

    Each is one token in any form ``nnterp.core.tokens.token_ids`` takes (an id, a 0-d tensor, a NumPy integer; a
    string that is one token where ``model`` is given, which also checks the ids against its vocabulary).
    It reads the last column of the logits: each prompt's last token in ``activation_patching`` (never
    padded) and in a left-padded batch, a pad in a right-padded one.
    """
    correct = single_token(model, correct, "The correct token")
    incorrect = single_token(model, incorrect, "The incorrect token")
    return lambda logits: logits[:, -1, correct] - logits[:, -1, incorrect]


def target_probability(token, model=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric: last-position probability of ``token``, per batch row (the last column, and the token's forms,
    as ``logit_difference``)."""
    token = single_token(model, token, "The target token")
    return lambda logits: logits[:, -1].softmax(dim=-1)[:, token]
