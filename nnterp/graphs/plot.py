"""A pruned attribution graph drawn with matplotlib: the nodes ``prune_graph`` keeps, by (layer, position).

Token nodes on the bottom row, then one row per layer (its features as circles, its error nodes as grey squares),
the logit nodes on the top row (they are the last position's), spread across it; nodes sharing a (layer, position) are spread across the
cell. Each kept edge between kept nodes is a line, blue for a positive weight and red for a negative one, its width
and opacity growing with its weight's magnitude. Each node's circuit-tracer id is the url of its point (and each
edge's ``source->target`` the url of its line): ``figure.axes[0].collections`` say what was drawn.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..tools.plots import LABEL_FONT, _pyplot, _save
from .pruning import prune_graph

POSITIVE, NEGATIVE = "#1f77b4", "#d62728"
KINDS = {"feature": ("o", "#ff7f0e"), "error": ("s", "#7f7f7f"), "token": ("D", "#2ca02c"), "logit": ("^", "#9467bd")}


def _kind(graph, index: int) -> str:
    n_features, n_layers, n_pos = len(graph.selected_features), graph.n_layers, graph.n_pos
    if index < n_features:
        return "feature"
    if index < n_features + n_layers * n_pos:
        return "error"
    return "token" if index < n_features + n_layers * n_pos + n_pos else "logit"


def _cell(graph, index: int, kind: str) -> tuple[float, float]:
    """The node's (position, row): row 0 the tokens, row l + 1 layer l, row n_layers + 1 the logits (no one
    position: the last's, spread across the row)."""
    n_features, n_pos = len(graph.selected_features), graph.n_pos
    if kind == "feature":
        layer, pos, _ = graph.active_features[graph.selected_features[index]].tolist()
        return pos, layer + 1
    if kind == "error":
        layer, pos = divmod(index - n_features, n_pos)
        return pos, layer + 1
    if kind == "token":
        return index - n_features - graph.n_layers * n_pos, 0
    return None, graph.n_layers + 1  # the logits: one row of their own, across the width


def layout(graph, kept: list[int]) -> dict[int, tuple[float, float]]:
    """Each kept node's (x, y): its cell, the nodes of one cell spread evenly across 0.8 of its width."""
    cells: dict[tuple, list[int]] = {}
    for index in kept:
        cells.setdefault(_cell(graph, index, _kind(graph, index)), []).append(index)
    places = {}
    for (x, y), members in cells.items():
        if x is None:  # the logits, most probable first, spread over the positions
            x, spread = (graph.n_pos - 1) / 2, 0.45 * graph.n_pos
        else:
            spread = 0.4
        for k, index in enumerate(members):
            offset = 0.0 if len(members) == 1 else -spread + 2 * spread * k / (len(members) - 1)
            places[index] = (x + offset, y)
    return places


def _source_place(graph, source: str, places: dict, index_of: dict):
    """Where a QK source is drawn: its node's place where the pruned graph kept it, else its (position, layer) cell;
    None for the bias (no place in the stream)."""
    if source in index_of and index_of[source] in places:
        return places[index_of[source]]
    parts = source.split("_")
    if parts[0] == "E":
        return float(parts[2]), 0.0
    if parts[0] == "err":
        return float(parts[2]), float(parts[1]) + 1
    if len(parts) == 3:
        return float(parts[2]), float(parts[0]) + 1
    return None


def _draw_head(ax, graph, qk, places: dict, ids: list[str]) -> None:
    """A selected head's QK attribution over the graph: stars at its block's row at the query and key positions,
    a dashed line from each top query-side source to the query and from each top key-side source to the key (blue
    where it raises the score, red where it lowers it); urls ``qk:{source}->query`` / ``->key``."""
    from matplotlib.collections import LineCollection

    ends = {"query": (float(qk.query), qk.layer + 1.0), "key": (float(qk.key), qk.layer + 1.0)}
    stars = ax.scatter([e[0] for e in ends.values()], [e[1] for e in ends.values()], marker="*", s=160,
                       c="#17becf", edgecolors="black", linewidths=0.5, zorder=3,
                       label=f"block {qk.layer} head {qk.head}: query, key")
    stars.set_urls([f"qk:{name}" for name in ends])
    index_of = {node: i for i, node in enumerate(ids)}
    segments, colours, widths, urls = [], [], [], []
    for side, tops in (("query", qk.top_query), ("key", qk.top_key)):
        largest = max((abs(t["effect"]) for t in tops), default=0.0) or 1.0
        for top in tops:
            place = _source_place(graph, top["source"], places, index_of)
            if place is None:
                continue
            segments.append([place, ends[side]])
            colours.append(POSITIVE if top["effect"] > 0 else NEGATIVE)
            widths.append(0.5 + 2.5 * abs(top["effect"]) / largest)
            urls.append(f"qk:{top['source']}->{side}")
    if segments:
        lines = LineCollection(segments, colors=colours, linewidths=widths, linestyles="dashed", alpha=0.8, zorder=2)
        lines.set_urls(urls)
        ax.add_collection(lines)


def plot_graph(graph, path: str | Path | None = None, node_threshold: float = 0.8, edge_threshold: float = 0.98,
               tokenizer=None, title: str | None = None, qk=None):
    """The graph pruned by ``prune_graph(graph, node_threshold, edge_threshold)``, drawn (see the module): a PNG at
    ``path`` (its path returned), or the matplotlib figure where ``path`` is None. ``tokenizer`` labels the tokens
    and logits with their text (their ids otherwise). ``qk``: a selected head's ``QKSummary`` (or
    ``QKAttribution``), drawn over the graph: its query and key, and the top sources of each."""
    plt = _pyplot()
    from matplotlib.collections import LineCollection

    pruned = prune_graph(graph, node_threshold, edge_threshold)
    kept = pruned.node_mask.nonzero().flatten().tolist()
    places = layout(graph, kept)
    ids = graph.node_ids()
    kept_set = set(kept)
    targets, sources = pruned.edge_mask.nonzero(as_tuple=True)
    edges = [(s, t) for t, s in zip(targets.tolist(), sources.tolist()) if s in kept_set and t in kept_set]
    figure, ax = plt.subplots(figsize=(max(6.0, 1.2 * graph.n_pos + 2), max(4.0, 0.22 * graph.n_layers + 3)))
    if edges:
        weights = torch.tensor([float(graph.adjacency_matrix[t, s]) for s, t in edges])
        strength = (weights.abs() / weights.abs().max().clamp(min=1e-30)).tolist()
        lines = LineCollection([[places[s], places[t]] for s, t in edges],
                               colors=[(POSITIVE if w > 0 else NEGATIVE) for w in weights.tolist()],
                               linewidths=[0.3 + 2.7 * a for a in strength], alpha=0.6, zorder=1)
        lines.set_urls([f"{ids[s]}->{ids[t]}" for s, t in edges])
        ax.add_collection(lines)
    for kind, (marker, colour) in KINDS.items():
        members = [index for index in kept if _kind(graph, index) == kind]
        if members:
            points = ax.scatter([places[i][0] for i in members], [places[i][1] for i in members], marker=marker,
                                c=colour, s=36, edgecolors="black", linewidths=0.4, zorder=2, label=kind)
            points.set_urls([ids[i] for i in members])

    if qk is not None:
        _draw_head(ax, graph, qk.summary() if hasattr(qk, "summary") else qk, places, ids)

    def text(token: int) -> str:
        return repr(tokenizer.decode([token])) if tokenizer is not None else str(token)

    n_layers, n_pos = graph.n_layers, graph.n_pos
    ax.set_xticks(range(n_pos), [text(t) for t in graph.input_tokens.tolist()], rotation=45, ha="right",
                  fontsize=LABEL_FONT)
    ax.set_yticks(range(n_layers + 2), ["tokens", *[str(i) for i in range(n_layers)], "logits"], fontsize=LABEL_FONT)
    ax.set_xlim(-0.6, n_pos - 0.4)
    ax.set_ylim(-0.6, n_layers + 2.4)  # room for the logits' labels
    ax.set_ylabel("layer", fontsize=LABEL_FONT)
    first_logit = len(ids) - len(graph.logit_tokens)
    for index in (i for i in kept if _kind(graph, i) == "logit"):
        token, probability = int(graph.logit_tokens[index - first_logit]), graph.logit_probabilities[index - first_logit]
        ax.annotate(f"{text(token)} {float(probability):.2f}", places[index], xytext=(0, 6), rotation=45,
                    textcoords="offset points", ha="left", va="bottom", fontsize=LABEL_FONT - 2)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=LABEL_FONT - 2, frameon=False)
    kept_features = int(pruned.node_mask[:len(graph.selected_features)].sum())
    ax.set_title(title or f"Attribution graph: {kept_features} features, {len(edges)} edges kept "
                          f"(node {node_threshold}, edge {edge_threshold})", fontsize=LABEL_FONT, pad=48)
    figure.tight_layout()
    return figure if path is None else _save_small(figure, path)


def _save_small(figure, path) -> Path:
    """The PNG in 256 colours: thousands of antialiased lines make a true-colour PNG of megabytes."""
    from PIL import Image  # matplotlib's own dependency

    path = _save(figure, path)
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE)
    small.save(path, optimize=True)
    return path


__all__ = ["layout", "plot_graph"]
