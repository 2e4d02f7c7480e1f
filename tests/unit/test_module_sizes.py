"""Small readable modules: none over 600 lines outside the family specs (a family's spec is one file by design)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nnterp"
MOST_LINES = 600


def test_no_module_outside_the_family_specs_is_over_600_lines():
    sizes = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")
             if "families" not in path.relative_to(PACKAGE).parts}
    assert not {path: lines for path, lines in sizes.items() if lines > MOST_LINES}
