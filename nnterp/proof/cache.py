"""Where nnterp keeps what it computes once: converted models, validation results."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$NNTERP_CACHE``, else ``$XDG_CACHE_HOME/nnterp``, else ``~/.cache/nnterp``."""
    if os.environ.get("NNTERP_CACHE"):
        return Path(os.environ["NNTERP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nnterp"
