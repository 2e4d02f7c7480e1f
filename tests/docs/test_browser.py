"""The built site in a headless Chromium, at 1280 and 1920 px: every page of the navigation renders
with its title, no table or code block runs past the page's width, every picture loads."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (1280, 1920)
CHROMIUM = next((path for path in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if path and os.access(path, os.X_OK)), None)
sync_playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (./run.sh test does)").sync_playwright
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install chromium (./run.sh test does)")

# what overflows, per page: the document, a table's scroll container, a code block; and the pictures
MEASURE = """() => {
  const wide = e => e.scrollWidth > e.clientWidth + 1;
  const name = e => e.tagName.toLowerCase() + ' ' + (e.textContent || '').trim().slice(0, 60);
  return {
    title: (document.querySelector('article h1') || {}).textContent || '',
    documentOverflows: wide(document.documentElement),
    wideTables: [...document.querySelectorAll('article .md-typeset__scrollwrap, article table')].filter(wide).map(name),
    wideCode: [...document.querySelectorAll('article pre > code')].filter(wide).map(name),
    images: [...document.images].map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0]),
  };
}"""


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built strictly and served on a free local port: its base URL."""
    folder = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(folder)], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def navigation(browser, site) -> list[str]:
    """Every page the home page's navigation links to (the full navigation: all tabs and sections)."""
    page = browser.new_page()
    page.route(lambda url: not url.startswith(site), lambda route: route.abort())
    page.goto(site)
    links = page.eval_on_selector_all(".md-nav--primary a.md-nav__link[href]", "links => links.map(a => a.href)")
    page.close()
    return list(dict.fromkeys(link.split("#")[0] for link in links if link.startswith(site)))


def test_every_page_renders_fits_and_shows_its_pictures(browser, site):
    pages = navigation(browser, site)
    assert len(pages) > 40 and site + "availability/" in pages and site + "api/" in pages, pages
    errors: list[str] = []
    page = browser.new_page(viewport={"width": WIDTHS[0], "height": 1000})
    page.route(lambda url: not url.startswith(site), lambda route: route.abort())  # the web fonts: offline here
    page.on("pageerror", lambda error: errors.append(str(error)))
    problems, pictures = [], {}
    for url in pages:
        response = page.goto(url, wait_until="load")
        for width in WIDTHS:  # one load, laid out at each width
            page.set_viewport_size({"width": width, "height": 1000})
            seen = page.evaluate(MEASURE)
            where = f"{url[len(site):] or 'home'} at {width} px"
            if not response.ok or not seen["title"].strip():
                problems.append(f"{where}: status {response.status}, title {seen['title']!r}")
            if seen["documentOverflows"] or seen["wideTables"] or seen["wideCode"]:
                problems.append(f"{where}: wider than the page: {seen['wideTables'] + seen['wideCode']}")
            pictures.update({f"{where}: {src}": loaded for src, loaded in seen["images"]})
    page.close()
    assert not problems and not errors, problems + errors
    assert not [picture for picture, loaded in pictures.items() if not loaded]
    shown = {picture.rpartition(" ")[2].rpartition("/")[2] for picture in pictures}
    assert {"logit-lens.png", "patching.png", "logo.svg"} <= shown, shown
