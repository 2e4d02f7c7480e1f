"""circuit-tracer's graph files: ``{slug}.json`` (``metadata``, ``qParams``, ``nodes``, ``links``) for its frontend,
and ``graph-metadata.json`` listing the graphs of the folder."""

from __future__ import annotations

import json
from pathlib import Path

from .pruning import prune_graph


def _token_text(tokenizer, token: int) -> str:
    text = tokenizer.decode([token]) if tokenizer is not None else str(token)
    return text.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def _cantor(x: int, y: int) -> int:
    """circuit-tracer's feature number of (layer, feature): the Cantor pairing, one integer per pair."""
    return (x + y) * (x + y + 1) // 2 + y


def error_id(layer: int, pos: int) -> str:
    """An error node's id: ``err_{layer}_{pos}``. circuit-tracer 0.5.0 writes ``0_{layer}_{pos}``, which is also the
    id of feature ``layer`` of layer 0 at ``pos``; its frontend keys nodes and links by ``node_id`` alone (and
    reads a node's layer, position and kind from its own fields), so the ids have to differ."""
    return f"err_{layer}_{pos}"


def nodes_of(graph, node_mask, cumulative, tokenizer) -> dict[int, dict]:
    """The kept nodes, by index, as circuit-tracer's frontend reads them."""
    n_features, n_layers, n_pos = len(graph.selected_features), graph.n_layers, graph.n_pos
    errors_end = n_features + n_layers * n_pos
    tokens_end = errors_end + n_pos
    nodes = {}
    for index in node_mask.nonzero().flatten().tolist():
        influence = float(cumulative[index])
        if index < n_features:
            active = int(graph.selected_features[index])
            layer, pos, feature = graph.active_features[active].tolist()
            nodes[index] = dict(node_id=f"{layer}_{feature}_{pos}", feature=_cantor(layer, feature), layer=str(layer),
                                ctx_idx=pos, feature_type="cross layer transcoder", jsNodeId=f"{layer}_{feature}-0",
                                influence=influence, activation=float(graph.activation_values[active]))
        elif index < errors_end:
            layer, pos = divmod(index - n_features, n_pos)
            nodes[index] = dict(node_id=error_id(layer, pos), feature=-1, layer=str(layer), ctx_idx=pos,
                                feature_type="mlp reconstruction error", jsNodeId=f"{layer}_{pos}-0", influence=influence)
        elif index < tokens_end:
            pos = index - errors_end
            token = int(graph.input_tokens[pos])
            nodes[index] = dict(node_id=f"E_{token}_{pos}", feature=pos, layer="E", ctx_idx=pos,
                                feature_type="embedding", jsNodeId=f"E_{token}-{pos}", influence=influence)
        else:
            k = index - tokens_end
            token, probability = int(graph.logit_tokens[k]), float(graph.logit_probabilities[k])
            layer = str(n_layers + 1)
            nodes[index] = dict(node_id=f"{layer}_{token}_{n_pos - 1}", feature=token, layer=layer, ctx_idx=n_pos - 1,
                                feature_type="logit", token_prob=probability, is_target_logit=k == 0,
                                jsNodeId=f"L_{token}-{n_pos - 1}",
                                clerp=f'Output "{_token_text(tokenizer, token)}" (p={probability:.3f})')
    defaults = dict(token_prob=0.0, is_target_logit=False, run_idx=0, reverse_ctx_idx=0, clerp="", influence=None,
                    activation=None)
    return {index: {**defaults, **node} for index, node in nodes.items()}


def write_json(graph, folder: Path, slug: str, tokenizer, node_threshold: float, edge_threshold: float,
               qk: list | None = None) -> Path:
    node_mask, edge_mask, cumulative = prune_graph(graph, node_threshold, edge_threshold)
    nodes = nodes_of(graph, node_mask, cumulative, tokenizer)
    targets, sources = edge_mask.nonzero(as_tuple=True)
    links = [{"source": nodes[s]["node_id"], "target": nodes[t]["node_id"], "weight": float(graph.adjacency_matrix[t, s])}
             for t, s in zip(targets.tolist(), sources.tolist()) if s in nodes and t in nodes]
    linked = {link["source"] for link in links} | {link["target"] for link in links}
    used = [node for node in nodes.values() if node["node_id"] in linked or node["feature_type"] in ("embedding", "logit")]
    metadata = {"slug": slug, "scan": graph.scan or "", "transcoder_list": [],
                "prompt_tokens": [_token_text(tokenizer, t) for t in graph.input_tokens.tolist()],
                "prompt": graph.input_string, "node_threshold": node_threshold, "schema_version": 1}
    document = {"metadata": metadata,
                "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
                "nodes": used, "links": links}
    if qk:  # an optional section: the frontend reads the keys above alone
        document["qk"] = [summary.to_dict() for summary in qk]
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"{slug}.json"
    file.write_text(json.dumps(document, indent=2))
    index_file = folder / "graph-metadata.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else {"graphs": []}
    index["graphs"] = [g for g in index["graphs"] if g.get("slug") != slug] + [metadata]
    index_file.write_text(json.dumps(index, indent=2))
    return file
