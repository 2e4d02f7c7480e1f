"""mkdocs hook: publish every page's Markdown source beside its HTML (``page/index.md``)."""

import shutil
from pathlib import Path


def on_post_page(output, page, config):
    source = Path(config["docs_dir"]) / page.file.src_path
    target = Path(config["site_dir"]) / page.file.dest_path
    target = target.with_name("index.md") if target.name == "index.html" else target.with_suffix(".md")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return output
