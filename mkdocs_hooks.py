"""mkdocs hooks: publish every page's Markdown source beside its HTML (``page/index.md``); list every family page."""

import shutil
from pathlib import Path


def on_post_page(output, page, config):
    source = Path(config["docs_dir"]) / page.file.src_path
    target = Path(config["site_dir"]) / page.file.dest_path
    target = target.with_name("index.md") if target.name == "index.html" else target.with_suffix(".md")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return output


def on_config(config):
    """Every generated family page in the navigation, under Documentation, after the families index."""
    docs = Path(config["docs_dir"])
    families = sorted(p.relative_to(docs).as_posix() for p in (docs / "families").glob("*.md") if p.name != "index.md")
    for section in config["nav"]:
        if isinstance(section, dict) and "Documentation" in section:
            section["Documentation"] = ["families/index.md", *families]
    return config
