"""Attribution graphs with transcoders, as circuit-tracer 0.5.0 defines them, on the families whose blocks are sums.

``load_transcoders(folder)`` reads circuit-tracer's transcoders (per layer or cross layer); ``attribution_graph(model,
prompt, transcoders)`` builds the graph of the local replacement model (``replacement``: attention patterns and norm
scales frozen at the pass's values, each MLP replaced by its transcoder plus an error node) and its rows (``rows``:
with ``max_feature_nodes``, only the features visited in circuit-tracer's order have one); ``prune_graph`` and
``Graph.to_json`` are circuit-tracer's pruning and graph files; ``plot_graph`` draws a pruned graph;
``feature_intervention`` (and ``_generate``) edits a graph's features as the model runs; ``qk_attribution`` splits
one head's pre-softmax score at (query, key) into terms over the graph's sources (``qk``).
"""

from __future__ import annotations

from .graph import Graph, attribution_graph
from .interventions import feature_intervention, feature_intervention_generate, transcoder_dictionary
from .plot import plot_graph
from .pruning import Pruned, prune_graph
from .qk import QKAttribution, QKSummary, qk_attribution, read_qk
from .replacement import GraphUnavailable, ReplacementPass, replacement_pass
from .transcoders import TranscoderError, Transcoders, load_transcoders, standard_site, write_random_transcoders

__all__ = ["Graph", "GraphUnavailable", "Pruned", "QKAttribution", "QKSummary", "ReplacementPass", "TranscoderError", "Transcoders",
           "attribution_graph", "feature_intervention", "feature_intervention_generate", "load_transcoders",
           "plot_graph", "prune_graph", "qk_attribution", "read_qk", "replacement_pass", "standard_site",
           "transcoder_dictionary", "write_random_transcoders"]
