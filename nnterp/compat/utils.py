"""nnterp 1.x's ``nnterp.utils``: small helpers, kept for code that imports them."""

from __future__ import annotations

import sys

import nnsight
import torch
import transformers

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
