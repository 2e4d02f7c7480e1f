"""The built site: its navigation (every family page titled by its family, in its group; Coverage), the API
reference (every exported name, no internals), table code that never breaks inside a name, the install steps."""

from __future__ import annotations

import functools
import http.server
import inspect
import os
import re
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path

import pytest

import nnterp
from nnterp.families import FAMILIES, Family

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ["Decoders", "Hybrids", "Recurrent", "Looped", "Multimodal"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(folder)], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


class Navigation(HTMLParser):
    """A built page's primary navigation as a tree of ``{"title", "href", "children"}`` (no tables of contents)."""

    def __init__(self):
        super().__init__()
        self.root = {"title": None, "href": None, "children": []}
        self.items = [self.root]
        self.navs: list[str] = []  # the classes of the <nav> elements we are in
        self.done = self.in_title = False

    def inside(self) -> bool:
        return not self.done and bool(self.navs) and "md-nav--primary" in self.navs[0] and not any(
            "md-nav--secondary" in nav for nav in self.navs)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "nav" and not self.done:
            self.navs.append(attrs.get("class") or "")
        if not self.inside():
            return
        if tag == "li":
            item = {"title": None, "href": None, "children": []}
            self.items[-1]["children"].append(item)
            self.items.append(item)
        elif tag == "a" and len(self.items) > 1 and self.items[-1]["href"] is None:
            self.items[-1]["href"] = attrs.get("href")
        elif tag == "span" and "md-ellipsis" in (attrs.get("class") or ""):
            self.in_title = True

    def handle_endtag(self, tag):
        if tag == "nav" and self.navs and not self.done:
            self.navs.pop()
            self.done = not self.navs and self.root["children"] != []
        elif tag == "li" and self.inside() and len(self.items) > 1:
            self.items.pop()
        elif tag == "span":
            self.in_title = False

    def handle_data(self, data):
        if self.in_title and self.inside() and len(self.items) > 1 and self.items[-1]["title"] is None and data.strip():
            self.items[-1]["title"] = data.strip()


def navigation(site: Path) -> dict:
    parser = Navigation()
    parser.feed((site / "index.html").read_text())
    return parser.root


def section(tree: dict, title: str) -> dict:
    found = [item for item in tree["children"] if item["title"] == title]
    assert len(found) == 1, f"{title!r} in {[item['title'] for item in tree['children']]}"
    return found[0]


def heading(site: Path, href: str) -> str:
    """The page's own title (its <h1>), as a reader sees it."""
    html = (site / href / "index.html").read_text()
    return re.sub(r"<[^>]+>", "", re.search(r"<h1[^>]*>(.*?)</h1>", html, re.S)[1]).strip()


def test_coverage_and_the_families_index_are_in_the_navigation(site):
    documentation = section(navigation(site), "Documentation")
    pages = {item["title"]: item["href"] for item in documentation["children"] if not item["children"]}
    assert pages == {"Families": "families/", "Coverage": "coverage/"}
    assert heading(site, "coverage") == "Coverage"


def test_family_pages_are_titled_by_their_family_and_grouped(site):
    documentation = section(navigation(site), "Documentation")
    groups = {item["title"]: item["children"] for item in documentation["children"] if item["children"]}
    assert list(groups) == GROUPS
    titles = {title: [page["title"] for page in pages] for title, pages in groups.items()}
    every = [name for names in titles.values() for name in names]
    assert sorted(every) == sorted(family.name for family in FAMILIES)  # each family once, by the name of its spec
    for pages in groups.values():
        assert [page["title"] for page in pages] == sorted((page["title"] for page in pages), key=str.casefold)
        for page in pages:  # the title is the heading of the page it opens
            assert page["href"].startswith("families/") and heading(site, page["href"]) == page["title"]
    known = {  # what mixes the tokens in these architectures, and how their passes run
        "Decoders": {"GPT-2", "Llama", "GLM", "GLM-4", "Mixtral", "Gemma-3", "OPT", "LongCat-Flash"},
        "Hybrids": {"Jamba", "Bamba", "Qwen3-Next", "Qwen3.5", "RecurrentGemma", "Falcon-H1", "Kimi-Linear", "LFM2",
                    "Nemotron-H", "MiniMax"},
        "Recurrent": {"Mamba", "Mamba-2", "Falcon-Mamba", "RWKV", "xLSTM", "Zamba", "Zamba2"},
        "Looped": {"Dory", "HRM-Text"},
        "Multimodal": {"GOT-OCR2", "Fuyu", "Emu3", "Moshi", "Phi-4-multimodal", "Gemma-3 (image-text)"},
    }
    for group, names in known.items():
        assert names <= set(titles[group]), (group, names - set(titles[group]))
    assert set(known["Recurrent"]) == set(titles["Recurrent"])


def test_a_family_page_the_index_does_not_list_fails_the_build(tmp_path):
    sys.path.insert(0, str(ROOT))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(ROOT))
    (tmp_path / "families").mkdir()
    shutil.copyfile(ROOT / "docs" / "families" / "index.md", tmp_path / "families" / "index.md")
    for page in (ROOT / "docs" / "families").glob("*.md"):
        shutil.copyfile(page, tmp_path / "families" / page.name)
    assert len(mkdocs_hooks.family_sections(tmp_path)) == len(GROUPS)
    (tmp_path / "families" / "unlisted.md").write_text("# Unlisted\n")
    with pytest.raises(ValueError, match="unlisted.md"):
        mkdocs_hooks.family_sections(tmp_path)


def test_the_api_reference_has_every_exported_name_and_no_internals(site):
    html = (site / "api" / "index.html").read_text()
    ids = set(re.findall(r'id="([^"]+)"', html))
    exported = [getattr(nnterp, name) for name in nnterp.__all__]
    missing = [f"{obj.__module__}.{obj.__qualname__}" for obj in exported if inspect.isclass(obj) or inspect.isfunction(obj)
               if f"{obj.__module__}.{obj.__qualname__}" not in ids and f"nnterp.{obj.__name__}" not in ids]
    assert not missing, missing
    errors = [obj for obj in vars(nnterp.spec.errors).values() if inspect.isclass(obj) and issubclass(obj, Exception)
              and obj.__module__ == "nnterp.spec.errors"]
    assert errors and all(f"nnterp.spec.errors.{error.__name__}" in ids for error in errors)
    assert f"{Family.__module__}.Family" in ids
    # the class's section: its own members, then the tools it carries as methods
    start, end = html.index('id="nnterp.StandardizedTransformer"'), html.index('id="nnterp.core.order.Availability"')
    headings = [re.sub(r"<[^>]+>|\s", "", text) for text in re.findall(r"<h[2-4][^>]*>(.*?)</h[2-4]>", html[start:end], re.S)]
    for method in ("run_with_cache", "to_str_tokens", "test_prompt", "availability", "order"):
        assert any(text.startswith(method) or f"StandardizedTransformer.{method}" in text for text in headings), method
    for internal in ("__repr__", "run_slot", "interleave", "__init__", "_place_values"):
        assert f"nnterp.StandardizedTransformer.{internal}" not in ids, internal


def test_the_manual_install_is_the_readmes():
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("To use the library in your own environment"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    expected = re.findall(r"`(pip install [^`]+)`", paragraph)
    index = (ROOT / "docs" / "index.md").read_text()
    block = next(body for body in re.findall(r"```bash\n(.*?)```", index, re.S) if "pip install" in body)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip().startswith("pip install")]
    assert expected and commands == expected


# -- in a browser: table code is never broken inside a name --------------------------------------------------------

CHROMIUM = next((path for path in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if path and os.access(path, os.X_OK)), None)

# every code element in a table broken across lines between two characters of a name (a break at a space, or
# after a dot of a dotted path, is allowed)
BROKEN = """() => [...document.querySelectorAll('article table code')].filter(code => {
  const range = document.createRange(), walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
  let top = null, previous = ' ';
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (let i = 0; i < node.data.length; i++) {
      range.setStart(node, i); range.setEnd(node, i + 1);
      const box = range.getClientRects()[0], c = node.data[i];
      if (!box) { previous = c; continue; }
      if (top !== null && box.top > top + 2 && c !== ' ' && previous !== ' ' && previous !== '.') return true;
      top = box.top; previous = c;
    }
  }
  return false;
}).map(code => code.textContent)"""


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install chromium (./run.sh test does)")
def test_table_code_never_breaks_inside_a_name(site):
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    broken = {}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.route(lambda url: not url.startswith(base), lambda route: route.abort())
            for path in ("families/xglm/", "families/zamba/", "families/gpt-2/", "families/dbrx/", "names/"):
                page.goto(base + path, wait_until="load", timeout=120_000)
                for width in (1280, 1920):
                    page.set_viewport_size({"width": width, "height": 1000})
                    if found := page.evaluate(BROKEN):
                        broken[f"{path} at {width} px"] = found
            browser.close()
    finally:
        server.shutdown()
    assert not broken, broken
