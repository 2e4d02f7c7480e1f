"""nnterp 1.x's ``nnterp.utils``: small helpers, kept for code that imports them."""

from __future__ import annotations

import sys

import nnsight
import torch
import transformers

from ..tools.hook_points import get_act_name  # noqa: F401 - TransformerLens's hook names from their shorthand

TraceTensor = torch.Tensor  # 1.x: a tensor, or nnsight's proxy of one (0.8 traces hold real tensors)
NNSIGHT_VERSION = nnsight.__version__
TRANSFORMERS_VERSION = transformers.__version__


class ArchitectureNotFound:
    """1.x's stand-in for a transformers class a version lacks."""


class DummyCache:
    """1.x handed this to a skipped block that returns a cache; nnterp 2 hands on what the block returns."""

    def to_legacy_cache(self):
        return None


def is_notebook() -> bool:
    try:
        shell = sys.modules["IPython"].get_ipython().__class__.__name__
    except (KeyError, AttributeError):
        return False
    return shell == "ZMQInteractiveShell"


def display_markdown(text: str) -> None:
    if is_notebook():
        from IPython.display import Markdown, display

        display(Markdown(text))
    else:
        print(text)


def display_source(source: str) -> None:
    display_markdown(f"```py\n{source}\n```")


def dummy_inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([[0, 1, 1]])}


def unpack_tuple(tensor_or_tuple):
    """The first element of a tuple, or the tensor itself."""
    return tensor_or_tuple[0] if isinstance(tensor_or_tuple, tuple) else tensor_or_tuple


def try_with_scan(model, function, error_to_throw: Exception, allow_dispatch: bool = True,
                  warn_if_scan_fails: bool = True, errors_to_raise=None) -> bool:
    """Run ``function`` in a ``scan`` (no weights), else in a ``trace``; True when the scan worked."""
    try:
        with model.scan(dummy_inputs()) as tracer:
            function()
            tracer.stop()
        return True
    except Exception as error:  # noqa: BLE001 - 1.x's contract: any failure falls back to a trace
        if errors_to_raise is not None and isinstance(error, errors_to_raise):
            raise
        if not allow_dispatch and not model.dispatched:
            raise error_to_throw from error
        try:
            with model.trace(dummy_inputs()) as tracer:
                function()
                tracer.stop()
        except Exception as second:  # noqa: BLE001
            raise error_to_throw from second
        return False


# -- TransformerLens's utils: the names its notebooks import from transformer_lens.utils -------------------------

def to_numpy(tensor):
    """TransformerLens's ``utils.to_numpy``: a tensor (detached, on the CPU; bfloat16 as float32), a list, a tuple or a
    number as a NumPy array; an array as it is."""
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return tensor
    if isinstance(tensor, (list, tuple)):
        return np.array(tensor)
    if isinstance(tensor, torch.Tensor):
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    if isinstance(tensor, (int, float, bool, str)):
        return np.array(tensor)
    raise ValueError(f"to_numpy takes a tensor, an array, a list, a tuple or a number, not {type(tensor).__name__}.")


def get_corner(tensor, n: int = 3):
    """TransformerLens's ``utils.get_corner``: the first ``n`` entries along every dimension."""
    return tensor[tuple(slice(n) for _ in range(tensor.ndim))]


def get_device() -> str:
    """TransformerLens's ``utils.get_device``: ``"cuda"`` where there is a GPU, ``"mps"`` where there is one and
    ``TRANSFORMERLENS_ALLOW_MPS=1`` says to use it, else ``"cpu"``."""
    import os

    if torch.cuda.is_available():
        return "cuda"
    mps = torch.backends.mps
    if mps.is_available() and mps.is_built() and os.environ.get("TRANSFORMERLENS_ALLOW_MPS", "") == "1":
        return "mps"
    return "cpu"


def test_prompt(prompt: str, answer, model, prepend_space_to_answer: bool = True, print_details: bool = True,
                prepend_bos: bool | None = None, top_k: int = 10):
    """TransformerLens's ``utils.test_prompt(prompt, answer, model, ...)``, printing TransformerLens's table: the
    prompt's and the answer's tokens, then for each answer token its rank (from 0, as TransformerLens counts),
    logit and probability and the ``top_k`` most likely tokens, and last the ranks of the answer tokens (printed
    without ``print_details`` too). The prompt is tokenized as ``model.to_tokens(prompt, prepend_bos=...)``; an
    answer of several strings ranks each one's first token after the prompt. The pass runs with the hooks on the
    model (``with model.hooks(...)``, ``add_hook``), as TransformerLens's ``model(tokens)`` does. Returns nnterp's
    ``AnswerToken`` of each answer token (its ``rank`` counted from 1)."""
    from ..core.tokens import AnswerToken, AnswerTokens, to_str_tokens, to_string, to_tokens, visible
    from .transformer_lens.hooks import run_with_hooks

    answers = [answer] if isinstance(answer, str) else list(answer)
    if not answers or not all(isinstance(a, str) for a in answers):
        raise TypeError("utils.test_prompt's answer is a string or a list of strings (for token ids: "
                        "model.test_prompt(prompt, ids)).")
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    several = len(answers) > 1
    prompt_ids = to_tokens(model, prompt, prepend_bos=prepend_bos, move_to_device=False)
    rows = [to_tokens(model, a, prepend_bos=False, move_to_device=False)[0] for a in answers]
    rows = [row[:1] for row in rows] if several else rows
    tokens = torch.cat([prompt_ids.repeat(len(rows), 1), torch.stack(rows)], dim=1)
    prompt_pieces = to_str_tokens(model, prompt, prepend_bos=prepend_bos)
    answer_pieces: list = [to_str_tokens(model, a, prepend_bos=False) for a in answers]
    lines = []
    if print_details:
        lines.append(f"Tokenized prompt: {prompt_pieces}")
        lines.append(f"Tokenized answers: {answer_pieces}" if several else f"Tokenized answer: {answer_pieces[0]}")
    with torch.no_grad():  # TransformerLens's model(tokens): the hooks on the model (add_hook, model.hooks) apply
        logits = run_with_hooks(model, tokens).float().cpu()
    probs = logits.softmax(-1)
    start, found, ranks = prompt_ids.shape[1], [], []
    for index in range(start, start + (1 if several else len(answer_pieces[0]))):
        ids, p = tokens[:, index], probs[:, index - 1]
        order = p.argsort(-1, descending=True)
        rank = order.argsort(-1)[torch.arange(len(rows)), ids].tolist()  # from 0: the answer's place in the order
        pieces = [a[index - start] for a in answer_pieces]
        ranks.append(list(zip(pieces, rank)))
        for k, token in enumerate(ids.tolist()):
            top = order[k, :top_k].tolist()
            found.append(AnswerToken(token=pieces[k], id=token, rank=rank[k] + 1, probability=float(p[k, token]),
                                     logit=float(logits[k, index - 1, token]),
                                     top=[(visible(model.tokenizer.decode([t])), float(p[k, t])) for t in top]))
        if print_details:
            lines.append(f"Performance on answer token{'s' if several else ''}:")
            lines += [f"Rank: {rank[k]: <8} Logit: {float(logits[k, index - 1, t]):5.2f} Prob: {float(p[k, t]):6.2%} "
                      f"Token: |{pieces[k]}|" for k, t in enumerate(ids.tolist())]
            lines += [f"Top {i}th token. Logit: {float(logits[0, index - 1, t]):5.2f} Prob: {float(p[0, t]):6.2%} "
                      f"Token: |{to_string(model, torch.tensor(t))}|" for i, t in enumerate(order[0, :top_k].tolist())]
    lines.append(f"Ranks of the answer tokens: {ranks if several else [r[0] for r in ranks]}")
    report = "\n".join(lines)
    print(report)
    return AnswerTokens(found, report, printed=True)


test_prompt.__test__ = False  # type: ignore[attr-defined]  # a library function, not a test for pytest to collect
