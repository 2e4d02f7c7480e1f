"""Heatmaps of the logit lens, of patching, of direct logit attribution and of attention patterns.

PNG with matplotlib; the lens, patching and attribution heatmaps also as interactive HTML where plotly is
installed; attention patterns as a self-contained interactive HTML page (no network needed).
Each ``plot_*`` writes a PNG at ``path`` and returns its path, or returns the matplotlib figure
when ``path`` is None (close it with ``matplotlib.pyplot.close(figure)``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from ..core.tokens import single_token, visible

CELL_FONT = 9  # points: cell labels
LABEL_FONT = 10  # points: ticks and axis labels
MARK = "#ff7f0e"  # the outline of a cell whose top token is the target


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files, no screen
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("Plots need matplotlib: pip install matplotlib (or nnterp[plots]).") from error
    return plt


def plot_logit_lens(model, prompt: str, path: str | Path | None, value: str = "layer_output", html: bool = True,
                    target=None, remote: bool | str = False):
    """A layers x positions heatmap of the lens's top-token probability, each cell labelled with its token.

    Whitespace in tokens is shown (``␣`` for a space). With ``target`` (one token, e.g. ``" Paris"``, or its
    id in any form ``nnterp.core.tokens.token_ids`` takes) every cell whose top token is the target is outlined.
    Writes a PNG at ``path`` and, when plotly is installed and ``html`` is True, an interactive HTML beside it.
    """
    from .lens import logit_lens

    target_id = None if target is None else single_token(model, target, "The target")
    probs = logit_lens(model, prompt, value=value, position=None, remote=remote)[0]  # [layers, seq, vocab]
    top_p, top_id = probs.max(dim=-1)
    tokens = [model.tokenizer.decode(int(t)) for t in model.tokenizer(prompt, return_tensors="pt").input_ids[0]]
    labels = [[model.tokenizer.decode(int(t)) for t in row] for row in top_id]
    title = f"Logit lens ({value}): top token and its probability"
    marked = [] if target_id is None else (top_id == target_id).nonzero().tolist()
    if target_id is not None:
        title += f"\noutlined: the top token is the target {visible(model.tokenizer.decode([target_id]))}"
    figure = _heatmap(top_p, labels, tokens, [str(i) for i in range(top_p.shape[0])], title=title,
                      colorbar="probability", cmap="viridis", vmin=0.0, vmax=1.0, marked=marked)
    if path is None:
        return figure
    if html:  # the target's cells in brackets there
        boxed = [[f"[{visible(label)}]" if [y, x] in marked else label for x, label in enumerate(row)]
                 for y, row in enumerate(labels)]
        _plotly_html(top_p, boxed, tokens, [str(i) for i in range(top_p.shape[0])], Path(path).with_suffix(".html"),
                     title.replace("outlined", "in brackets"), _plotly_colorscale("viridis"), zmin=0.0, zmax=1.0)
    return _save(figure, path)


def plot_patching(effects: torch.Tensor, tokens: Sequence[str], path: str | Path | None,
                  layers: Sequence[int] | None = None, title: str = "Activation patching", html: bool = True):
    """A layers x positions heatmap of an ``activation_patching`` result.

    The effect is signed, so the colours diverge from white at 0 (red below, blue above), on
    limits symmetric around 0.
    """
    _pyplot()  # a clear error where matplotlib is missing
    from matplotlib.colors import CenteredNorm

    layers = list(range(effects.shape[0])) if layers is None else list(layers)
    labels = [[f"{v:.2f}" for v in row] for row in effects.tolist()]
    rows = [str(i) for i in layers]
    halfrange = float(effects.abs().max()) or 1.0
    figure = _heatmap(effects, labels, list(tokens), rows, title=title, colorbar="metric", cmap="RdBu",
                      norm=CenteredNorm(vcenter=0.0, halfrange=halfrange))
    if path is None:
        return figure
    if html:
        _plotly_html(effects, labels, list(tokens), rows, Path(path).with_suffix(".html"), title,
                     _plotly_colorscale("RdBu"), zmin=-halfrange, zmax=halfrange)
    return _save(figure, path)


ATTRIBUTED = re.compile(r"^L(\d+)([HN]\d+)$|^(\d+)_(.+)$")  # L3H5, L3N17 / 3_attn_out, 3_mlp_out, 3_mamba


def plot_attribution(attributions: torch.Tensor, labels: Sequence[str], path: str | Path | None,
                     title: str = "Direct logit attribution", html: bool = True):
    """A layers x components heatmap of one logit's attributions, placed by their labels.

    ``attributions`` is ``[components]``, one prompt and position of ``logit_attrs`` (e.g. ``attrs[:, 0]``
    of a position-sliced stack), and ``labels`` their labels: ``{i}_attn_out``, ``{i}_mlp_out``, ...
    (``decompose_resid``) give one column per kind of contribution, ``L{i}H{h}`` (``stack_head_results``)
    one per head, ``L{i}N{n}`` one per neuron; a label of no block (``embed``, a bias, ``remainder``) is a
    row of its own, one cell in the first column. Signed, so coloured as ``plot_patching`` is.
    """
    _pyplot()  # a clear error where matplotlib is missing
    from matplotlib.colors import CenteredNorm

    values = torch.as_tensor(attributions).detach().float().cpu()
    if values.dim() != 1:
        raise ValueError(f"plot_attribution draws one logit's attributions, [components]; these are "
                         f"{list(values.shape)}: pick one prompt and position, e.g. attributions[:, 0] of a "
                         "position-sliced stack, or attributions[:, 0, -1].")
    labels = list(labels)
    if len(labels) != len(values):
        raise ValueError(f"{len(values)} attributions but {len(labels)} labels: pass the labels of the stack "
                         "(return_labels=True), with the bias rows logit_attrs(..., labels=...) adds.")
    cells = []  # (row, column) of each attribution
    for label in labels:
        match = ATTRIBUTED.match(label)
        cells.append((label, None) if match is None else (match[1] or match[3], match[2] or match[4]))
    repeated = sorted({label for label, cell in zip(labels, cells) if cells.count(cell) > 1})
    if repeated:
        raise ValueError(f"The labels {repeated} name the same cell more than once: one stack's labels, each once.")
    rows = list(dict.fromkeys(row for row, _ in cells))
    columns = list(dict.fromkeys(column for _, column in cells if column is not None)) or [""]
    grid = torch.full((len(rows), len(columns)), float("nan"))
    text = [[""] * len(columns) for _ in rows]
    for value, (row, column) in zip(values.tolist(), cells):
        y, x = rows.index(row), 0 if column is None else columns.index(column)
        grid[y, x], text[y][x] = value, f"{value:.2f}"
    halfrange = float(values.abs().max()) if len(values) else 0.0
    figure = _heatmap(grid, text, columns, rows, title=title, colorbar="logit attribution", cmap="RdBu",
                      norm=CenteredNorm(vcenter=0.0, halfrange=halfrange or 1.0))
    axes = figure.axes[0]
    for label in [t for t in axes.texts if grid.isnan()[round(t.get_position()[1]), round(t.get_position()[0])]]:
        label.remove()  # no attribution in the cell
    axes.set_xlabel("head" if all(c.startswith("H") for c in columns) else "component", fontsize=LABEL_FONT)
    if path is None:
        return figure
    if html:
        _plotly_html(grid, text, columns, rows, Path(path).with_suffix(".html"), title, _plotly_colorscale("RdBu"),
                     zmin=-halfrange, zmax=halfrange)
    return _save(figure, path)


def _heatmap(values: torch.Tensor, labels, columns, rows, title, colorbar, cmap, vmin=None, vmax=None, norm=None,
             marked=()):
    """The figure: one labelled cell per value; ``marked`` cells ``(row, column)`` outlined."""
    from matplotlib.patches import Rectangle

    plt = _pyplot()
    height, width = values.shape
    figure, axes = plt.subplots(figsize=(max(6, 0.9 * width + 3), max(4, 0.42 * height + 2)))
    image = axes.imshow(values.float().numpy(), aspect="auto", cmap=cmap, origin="lower", vmin=vmin, vmax=vmax,
                        norm=norm)
    axes.set_xticks(range(width), [visible(c) for c in columns], rotation=45, ha="right", fontsize=LABEL_FONT)
    axes.set_yticks(range(height), rows, fontsize=LABEL_FONT)
    axes.set_xlabel("position", fontsize=LABEL_FONT)
    axes.set_ylabel("layer", fontsize=LABEL_FONT)
    axes.set_title(title, fontsize=LABEL_FONT + 1)
    for y in range(height):
        for x in range(width):
            red, green, blue, _ = image.cmap(image.norm(float(values[y, x])))
            light = 0.299 * red + 0.587 * green + 0.114 * blue > 0.5  # dark text on a light cell
            axes.text(x, y, visible(labels[y][x])[:8], ha="center", va="center", fontsize=CELL_FONT,
                      color="black" if light else "white")
    for y, x in marked:
        axes.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor=MARK, linewidth=2.5, gid="target"))
    figure.colorbar(image, ax=axes, label=colorbar)
    figure.tight_layout()
    return figure


def _save(figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)
    return path


def _plotly_colorscale(name: str) -> list:
    """A matplotlib colour map as a plotly colorscale: the HTML shows the PNG's colours."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    cmap = colormaps[name]
    return [[i / 10, to_hex(cmap(i / 10))] for i in range(11)]


def _plotly_html(values, labels, columns, rows, path: Path, title: str, colorscale, zmin=None, zmax=None):
    try:
        import plotly.graph_objects as go
    except ModuleNotFoundError:
        return None  # interactive heatmaps are optional
    text = [[visible(label) for label in row] for row in labels]
    figure = go.Figure(go.Heatmap(z=values.float().tolist(), x=[visible(c) for c in columns], y=rows, text=text,
                                  texttemplate="%{text}", colorscale=colorscale, zmin=zmin, zmax=zmax))
    figure.update_layout(title=title.replace("\n", "<br>"), xaxis_title="position", yaxis_title="layer")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.write_html(path)
    return path


# -- attention patterns --------------------------------------------------------------------------

def _pattern(pattern: torch.Tensor, tokens: Sequence[str], heads) -> tuple[torch.Tensor, list[int]]:
    """``[heads, query, key]`` of the heads asked for, and their numbers; clear errors for other shapes."""
    pattern = pattern.detach().float().cpu()
    if pattern.dim() == 4:
        if pattern.shape[0] != 1:
            raise ValueError(f"The pattern holds {pattern.shape[0]} prompts: pick one, e.g. pattern[0] "
                             "([heads, query, key]).")
        pattern = pattern[0]
    if pattern.dim() == 2:
        pattern = pattern.unsqueeze(0)
    if pattern.dim() != 3 or pattern.shape[1] != pattern.shape[2]:
        raise ValueError("An attention pattern is [heads, query, key] (or [query, key], or [1, heads, query, key]) "
                         f"over one prompt's tokens, not a tensor of shape {tuple(pattern.shape)}.")
    if len(tokens) != pattern.shape[-1]:
        raise ValueError(f"The pattern covers {pattern.shape[-1]} tokens but {len(tokens)} tokens were given: pass "
                         "that prompt's tokens, e.g. model.to_str_tokens(prompt).")
    numbers = list(range(pattern.shape[0])) if heads is None else [heads] if isinstance(heads, int) else list(heads)
    for head in numbers:
        if not 0 <= head < pattern.shape[0]:
            raise IndexError(f"Head {head} is out of range: the pattern has {pattern.shape[0]} heads.")
    return pattern[numbers], numbers


def plot_attention(pattern: torch.Tensor, tokens: Sequence[str], path: str | Path | None, heads=None,
                   title: str = "Attention"):
    """One query x key heatmap per head of ``pattern`` (``[heads, query, key]``), token labels on the axes.

    ``pattern`` is e.g. ``cache["attention_probabilities", layer][0]`` and ``tokens`` the prompt's
    ``model.to_str_tokens(prompt)``; ``heads`` picks some heads (all by default).
    """
    pattern, numbers = _pattern(pattern, tokens, heads)
    plt = _pyplot()
    columns = min(4, len(numbers))
    grid_rows = -(-len(numbers) // columns)
    side = max(3.0, 0.28 * len(tokens) + 1.5)
    figure, axes = plt.subplots(grid_rows, columns, figsize=(side * columns + 1, side * grid_rows + 0.5), squeeze=False,
                             layout="constrained")
    labels = [visible(t) for t in tokens]
    for k, head in enumerate(numbers):
        ax = axes[k // columns][k % columns]
        image = ax.imshow(pattern[k].numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
        ax.set_title(f"head {head}", fontsize=LABEL_FONT)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=CELL_FONT)
        ax.set_yticks(range(len(labels)), labels, fontsize=CELL_FONT)
        ax.set_xlabel("key", fontsize=LABEL_FONT)
        ax.set_ylabel("query", fontsize=LABEL_FONT)
    for k in range(len(numbers), grid_rows * columns):
        axes[k // columns][k % columns].axis("off")
    figure.suptitle(title, fontsize=LABEL_FONT + 2)
    figure.colorbar(image, ax=axes, label="probability")
    if path is None:
        return figure
    return _save(figure, path)


def attention_html(pattern: torch.Tensor, tokens: Sequence[str], path: str | Path | None = None, heads=None,
                   title: str = "Attention") -> Path | str:
    """An interactive page of ``pattern`` (``[heads, query, key]``): pick a head, hover a cell or a token.

    Self-contained (inline script and style, nothing fetched), so it opens offline. The numbers
    are in the page as JSON, in ``<script type="application/json" id="nnterp-attention">``
    (``{"title", "tokens", "heads", "patterns": [head][query][key]}``). Writes the page at ``path``
    and returns its path, or returns the HTML text when ``path`` is None.
    """
    pattern, numbers = _pattern(pattern, tokens, heads)
    data = {"title": title, "tokens": list(tokens), "heads": numbers, "patterns": pattern.tolist()}
    payload = json.dumps(data).replace("</", "<\\/")  # no "</script>" inside the script element
    page = ATTENTION_PAGE.replace("__TITLE__", _escape(title)).replace("__DATA__", payload)
    if path is None:
        return page
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


ATTENTION_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
#heads button { margin: 0 .3em .3em 0; padding: .2em .6em; border: 1px solid #888; background: #fff; cursor: pointer; }
#heads button.on { background: #2166ac; color: #fff; }
#grid { display: inline-grid; gap: 1px; background: #ddd; border: 1px solid #ddd; margin-top: .8em; }
#grid div { width: 22px; height: 22px; }
#grid .label { width: auto; height: auto; background: #fff; font-size: 12px; padding: 0 4px; white-space: pre; }
#tokens span { display: inline-block; margin: 2px; padding: 2px 4px; border: 1px solid #ccc; white-space: pre;
               cursor: pointer; }
#info { margin: .8em 0; min-height: 1.2em; font-family: monospace; }
</style></head>
<body>
<h2>__TITLE__</h2>
<div id="heads"></div>
<div id="info">Hover a cell, or a token to see where it attends.</div>
<div id="tokens"></div>
<div id="grid"></div>
<script type="application/json" id="nnterp-attention">__DATA__</script>
<script>
(function () {
  const data = JSON.parse(document.getElementById("nnterp-attention").textContent);
  const shown = t => t === "" ? "\u2205" : t.replace(/ /g, "\u2423").replace(/\n/g, "\\n").replace(/\t/g, "\\t");
  const tokens = data.tokens.map(shown);
  const n = tokens.length;
  const colour = p => "rgba(33, 102, 172, " + Math.max(0, Math.min(1, p)).toFixed(3) + ")";
  const info = document.getElementById("info");
  let head = 0;
  const buttons = data.heads.map((h, k) => {
    const b = document.createElement("button");
    b.textContent = "head " + h;
    b.onclick = () => { head = k; draw(); };
    document.getElementById("heads").appendChild(b);
    return b;
  });
  const grid = document.getElementById("grid");
  grid.style.gridTemplateColumns = "auto repeat(" + n + ", 22px)";
  const cells = [];
  grid.appendChild(document.createElement("div")).className = "label";
  for (let k = 0; k < n; k++) {
    const label = grid.appendChild(document.createElement("div"));
    label.className = "label";
    label.textContent = k;
    label.title = "key " + k + ": " + tokens[k];
  }
  for (let q = 0; q < n; q++) {
    const label = grid.appendChild(document.createElement("div"));
    label.className = "label";
    label.textContent = q + " " + tokens[q];
    cells.push([]);
    for (let k = 0; k < n; k++) {
      const cell = grid.appendChild(document.createElement("div"));
      cell.onmouseenter = () => {
        info.textContent = "head " + data.heads[head] + ": query " + q + " " + tokens[q] + " \u2192 key " + k +
          " " + tokens[k] + ": " + data.patterns[head][q][k].toFixed(4);
      };
      cells[q].push(cell);
    }
  }
  const spans = tokens.map((t, q) => {
    const s = document.createElement("span");
    s.textContent = t;
    s.onmouseenter = () => {
      spans.forEach((other, k) => { other.style.background = colour(data.patterns[head][q][k]); });
      info.textContent = "head " + data.heads[head] + ": where query " + q + " " + t + " attends";
    };
    s.onmouseleave = () => spans.forEach(other => { other.style.background = "#fff"; });
    document.getElementById("tokens").appendChild(s);
    return s;
  });
  function draw() {
    buttons.forEach((b, k) => b.classList.toggle("on", k === head));
    for (let q = 0; q < n; q++) for (let k = 0; k < n; k++) cells[q][k].style.background = colour(data.patterns[head][q][k]);
  }
  draw();
})();
</script>
</body></html>
"""
