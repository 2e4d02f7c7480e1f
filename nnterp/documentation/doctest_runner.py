"""Run the Python blocks of a documentation page and compare what they print with the page.

A ```python block followed by a ```text block must print exactly that text. The blocks of one
page run in order in one namespace, from a real file (nnsight reads a trace's source back), in
a scratch folder as the working directory: the files they write (the pictures a page shows,
``![...](images/NAME.png)``) land there.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import tempfile
from pathlib import Path

FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)
SEPARATOR = "<<<nnterp-doc-block>>>"
PICTURE = re.compile(r"!\[[^\]]*\]\((?:\.\./)*images/([\w.-]+\.png)\)")


def blocks(markdown: str) -> list[tuple[str, str | None]]:
    """(code, expected output or None) for each python block of a page."""
    fences = [(m.group(1), m.group(2)) for m in FENCE.finditer(markdown)]
    result = []
    for i, (language, body) in enumerate(fences):
        if language == "python":
            following = fences[i + 1] if i + 1 < len(fences) else None
            result.append((body, following[1] if following and following[0] == "text" else None))
    return result


def pictures(markdown: str) -> list[str]:
    """The file names of the PNG pictures a page shows from the docs' ``images/`` folder."""
    return PICTURE.findall(markdown)


def run_page(path: Path, folder: Path | None = None) -> list[tuple[str, str | None, str]]:
    """(code, expected, printed) for every python block of the page at ``path``, run in ``folder``
    (a temporary one by default) as the working directory."""
    page = blocks(path.read_text())
    if not page:
        return []
    source = "\n".join(f"{code}\nprint({SEPARATOR!r})\n" for code, _ in page)
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / f"{path.stem.replace('-', '_')}_blocks.py"
        script.write_text(source)
        out, before = io.StringIO(), os.getcwd()
        try:
            os.chdir(folder or scratch)
            with contextlib.redirect_stdout(out):
                runpy.run_path(str(script), run_name="__docs__")
        finally:
            os.chdir(before)
    printed = out.getvalue().split(SEPARATOR + "\n")[: len(page)]
    return [(code, expected, text) for (code, expected), text in zip(page, printed)]
