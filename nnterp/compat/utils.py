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
    """TransformerLens's ``utils.test_prompt(prompt, answer, model, ...)``: nnterp's ``model.test_prompt`` with
    TransformerLens's arguments. The prompt is tokenized as ``model.to_tokens(prompt, prepend_bos=...)``; an answer
    of several strings ranks each one's first token after the prompt, as TransformerLens does. The pass runs with the
    hooks on the model (``with model.hooks(...)``, ``add_hook``), as TransformerLens's ``model(tokens)`` does. It
    prints nnterp's report (ranks from 1) and returns it: one ``AnswerToken`` per answer token."""
    from ..core.tokens import AnswerTokens

    answers = [answer] if isinstance(answer, str) else list(answer)
    if not answers or not all(isinstance(a, str) for a in answers):
        raise TypeError("utils.test_prompt's answer is a string or a list of strings (for token ids: "
                        "model.test_prompt(prompt, ids)).")
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    prompt_ids = model.to_tokens(prompt, prepend_bos=prepend_bos)[0].tolist()
    tokenizer = model.tokenizer

    def logits_of(ids):  # TransformerLens's model(tokens): the hooks on the model (add_hook, model.hooks) apply
        return model.run_with_hooks(ids)

    if len(answers) == 1:
        return model.test_prompt(prompt_ids, answers[0], top_k=top_k, prepend_space=False,
                                 print_results=print_details, logits_of=logits_of)
    results = [model.test_prompt(prompt_ids, tokenizer.encode(a, add_special_tokens=False)[:1], top_k=top_k,
                                 print_results=print_details, logits_of=logits_of) for a in answers]
    return AnswerTokens([r[0] for r in results], "\n".join(r.report for r in results), printed=print_details)


test_prompt.__test__ = False  # type: ignore[attr-defined]  # a library function, not a test for pytest to collect
