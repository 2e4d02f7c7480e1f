"""Logit-lens and patching heatmaps: PNG with matplotlib, interactive HTML with plotly where installed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files, no screen
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("Plots need matplotlib: pip install matplotlib (or nnterp[plots]).") from error
    return plt


def plot_logit_lens(model, prompt: str, path: str | Path, value: str = "layer_output", html: bool = True) -> Path:
    """A layers x positions heatmap of the lens's top-token probability, each cell labelled with its token.

    Writes a PNG at ``path`` and, when plotly is installed and ``html`` is True, an interactive
    HTML beside it. Returns the PNG's path.
    """
    from .lens import logit_lens

    probs = logit_lens(model, prompt, value=value, position=None)[0]  # [layers, seq, vocab]
    top_p, top_id = probs.max(dim=-1)
    tokens = [model.tokenizer.decode(int(t)) for t in model.tokenizer(prompt, return_tensors="pt").input_ids[0]]
    labels = [[model.tokenizer.decode(int(t)) for t in row] for row in top_id]
    return _heatmap(top_p, labels, tokens, [str(i) for i in range(top_p.shape[0])], path,
                    title=f"Logit lens ({value}): top token and its probability", colorbar="probability",
                    html=html, vmin=0.0, vmax=1.0)


def plot_patching(effects: torch.Tensor, tokens: Sequence[str], path: str | Path, layers: Sequence[int] | None = None,
                  title: str = "Activation patching", html: bool = True) -> Path:
    """A layers x positions heatmap of an ``activation_patching`` result."""
    layers = list(range(effects.shape[0])) if layers is None else list(layers)
    labels = [[f"{v:.2f}" for v in row] for row in effects.tolist()]
    return _heatmap(effects, labels, list(tokens), [str(i) for i in layers], path, title=title,
                    colorbar="metric", html=html)


def _heatmap(values: torch.Tensor, labels, columns, rows, path, title, colorbar, html, vmin=None, vmax=None) -> Path:
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = values.shape
    figure, axes = plt.subplots(figsize=(max(6, 1.1 * width + 2), max(4, 0.32 * height + 1.5)))
    image = axes.imshow(values.float().numpy(), aspect="auto", cmap="viridis", origin="lower", vmin=vmin, vmax=vmax)
    axes.set_xticks(range(width), [repr(c)[1:-1] for c in columns], rotation=45, ha="right")
    axes.set_yticks(range(height), rows)
    axes.set_xlabel("position")
    axes.set_ylabel("layer")
    axes.set_title(title)
    for y in range(height):
        for x in range(width):
            bright = image.norm(float(values[y, x])) > 0.6  # dark text on the light end of the colour map
            axes.text(x, y, repr(labels[y][x])[1:-1][:8], ha="center", va="center", fontsize=6,
                      color="black" if bright else "white")
    figure.colorbar(image, ax=axes, label=colorbar)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    if html:
        _plotly_html(values, labels, columns, rows, path.with_suffix(".html"), title)
    return path


def _plotly_html(values, labels, columns, rows, path: Path, title: str) -> Path | None:
    try:
        import plotly.graph_objects as go
    except ModuleNotFoundError:
        return None  # interactive plots are optional
    figure = go.Figure(go.Heatmap(z=values.float().tolist(), x=[repr(c) for c in columns], y=rows, text=labels,
                                  texttemplate="%{text}", colorscale="Viridis"))
    figure.update_layout(title=title, xaxis_title="position", yaxis_title="layer")
    figure.write_html(path)
    return path
