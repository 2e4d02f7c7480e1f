"""The documentation: generated pages are fresh, every code block prints what the page says, the site builds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nnterp.documentation import GENERATED, generated_pages
from nnterp.documentation.doctest_runner import blocks, pictures, run_page
from nnterp.families import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
WRITTEN = sorted(p for p in DOCS.rglob("*.md") if not p.read_text().startswith(GENERATED))


def test_generated_pages_are_fresh():
    pages = generated_pages()
    stale = [name for name, text in pages.items() if not (DOCS / name).is_file() or (DOCS / name).read_text() != text]
    assert not stale, f"run `python -m nnterp docs`: stale or missing {stale}"
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if p.read_text().startswith(GENERATED)}
    assert on_disk == set(pages), f"generated pages no spec produces any more: {on_disk - set(pages)}"
    assert len([name for name in pages if name.startswith("families/") and name != "families/index.md"]) == len(FAMILIES)


def test_every_family_page_has_its_formula_and_reasons():
    pages = generated_pages()
    for name, text in pages.items():
        if name.startswith("families/") and name != "families/index.md":
            assert "layer_output = " in text and "| `layer_input` |" in text
    assert "unavailable: a parallel block" in pages["families/gpt-j.md"]
    assert "routed mixture of experts" in pages["families/mixtral.md"]


def test_the_families_index_counts_the_block_shapes_each_page_shows():
    pages = generated_pages()
    counts = dict(re.findall(r"^\| \[[^]]+\]\(([\w-]+\.md)\) \|.*\| (\d+) \|$", pages["families/index.md"], re.M))
    assert len(counts) == len(FAMILIES)
    for name, count in counts.items():
        assert len(re.findall(r"^## Values", pages[f"families/{name}"], re.M)) == int(count), name
    # Falcon: parallel with one norm (7B and the new architecture with one), sequential (RW), two norms (40B)
    assert counts["falcon.md"] == "3" and counts["gpt-neox.md"] == "2" and counts["qwen2-moe.md"] == "2"
    assert "## Values of `parallel_attn=False` (RW style)" in pages["families/falcon.md"]


@pytest.mark.real
@pytest.mark.parametrize("page", WRITTEN, ids=lambda p: str(p.relative_to(DOCS)))
def test_code_blocks_print_what_the_page_says(page, tmp_path):
    results = run_page(page, tmp_path)
    assert len(results) == len(blocks(page.read_text()))
    for code, expected, printed in results:
        if expected is not None:
            assert printed == expected, f"{page.name}: the block\n{code}\nprinted\n{printed}"
    for name in pictures(page.read_text()):  # each picture the page shows is drawn by its code
        assert (tmp_path / name).is_file(), f"{page.name} shows images/{name}, which its code does not draw"
        assert (DOCS / "images" / name).is_file(), f"run `python -m nnterp docs --pictures`: images/{name} is missing"


def test_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "residual-stream" / "index.md").is_file()  # each page as plain Markdown too
    assert (tmp_path / "site" / "families" / "gpt-2" / "index.html").is_file()
    navigation = (tmp_path / "site" / "index.html").read_text()  # every family page is in the navigation
    assert all(f"families/{path.stem}/" in navigation for path in (DOCS / "families").glob("*.md")
               if path.name != "index.md")
