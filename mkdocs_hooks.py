"""mkdocs hooks: publish every page's Markdown source beside its HTML (``page/index.md``); list every family page,
by group and by name."""

import re
import shutil
from pathlib import Path

INDEX = "families/index.md"  # generated (``python -m nnterp docs``): a section per group, a link per family
SECTION = re.compile(r"^## (.+)$")
FAMILY = re.compile(r"^\| \[([^]]+)\]\(([\w.-]+\.md)\) \|")


def on_post_page(output, page, config):
    source = Path(config["docs_dir"]) / page.file.src_path
    target = Path(config["site_dir"]) / page.file.dest_path
    target = target.with_name("index.md") if target.name == "index.html" else target.with_suffix(".md")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return output


def family_sections(docs: Path) -> list[dict]:
    """The families index's sections as navigation: ``[{group: [{family name: page}, ...]}, ...]``.

    Read from the generated index, not the file names: it titles each page with its family's name and
    places it in its group, from the specs. A family page the index does not list is an error.
    """
    sections: list[dict] = []
    for line in (docs / INDEX).read_text().splitlines():
        if match := SECTION.match(line):
            sections.append({match[1]: []})
        elif (match := FAMILY.match(line)) and sections:
            next(iter(sections[-1].values())).append({match[1]: f"families/{match[2]}"})
    listed = {path for section in sections for pages in section.values() for page in pages for path in page.values()}
    pages = {p.relative_to(docs).as_posix() for p in (docs / "families").glob("*.md") if p.name != "index.md"}
    if pages - listed or listed - pages:
        raise ValueError(f"{INDEX} and the family pages disagree (not listed: {sorted(pages - listed)}, missing: "
                         f"{sorted(listed - pages)}): run `python -m nnterp docs`.")
    return sections


def on_config(config):
    """Under Documentation, after the pages mkdocs.yml lists (the families index, coverage), a section per group."""
    groups = family_sections(Path(config["docs_dir"]))
    titles = {title for group in groups for title in group}
    for section in config["nav"]:
        if isinstance(section, dict) and "Documentation" in section:
            # the groups once, where mkdocs serve hands the hook a config it has already extended
            listed = [entry for entry in section["Documentation"] if not (isinstance(entry, dict) and set(entry) <= titles)]
            section["Documentation"] = [*listed, *groups]
            return config
    raise ValueError("mkdocs.yml has no Documentation section for the family pages")
