"""circuit-tracer's pruning: the nodes and edges of most influence on the logits.

A node's influence is what flows to it from the logits (weighted by their probabilities) through the adjacency
made of absolute values, each row normalized to sum to one, summed over paths of every length (the matrix power
series, finite on a graph without cycles). The nodes of most influence are kept until ``node_threshold`` of all
the nodes' influence is covered (tokens and logits always kept); the edges of most influence among them (an edge's
score is its normalized weight times its target's influence, the logits' own weights added) until
``edge_threshold`` is; then features and errors without an outgoing edge, and features without an incoming one, are
dropped, until no more are. As circuit-tracer 0.5.0's, the edge mask may keep edges of nodes dropped in the first
of those passes where no second pass runs: the graph files keep only edges between kept nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec.sourced import sourced


def normalized(matrix: torch.Tensor) -> torch.Tensor:
    """``|matrix|`` with each row summing to one (a zero row stays zero)."""
    absolute = matrix.abs()
    return absolute / absolute.sum(1, keepdim=True).clamp(min=1e-10)


def influence(matrix: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights @ (M + M^2 + ...)``: what reaches each node from the weighted targets along paths of every length."""
    step = weights @ matrix
    total = step.clone()
    for _ in range(len(matrix)):  # a path is at most as long as the graph has nodes
        if not step.any():
            break
        step = step @ matrix
        total += step
    return total


def node_influence(adjacency: torch.Tensor, logit_weights: torch.Tensor) -> torch.Tensor:
    return influence(normalized(adjacency), logit_weights)


def edge_influence(adjacency: torch.Tensor, logit_weights: torch.Tensor) -> torch.Tensor:
    matrix = normalized(adjacency)
    reached = influence(matrix, logit_weights) + logit_weights
    return matrix * reached[:, None]


def threshold_of(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The smallest score among the largest ones that together cover ``fraction`` of the scores' sum."""
    ordered = torch.sort(scores, descending=True).values
    covered = torch.cumsum(ordered, 0) / ordered.sum()
    return ordered[min(int(torch.searchsorted(covered, fraction)), len(ordered) - 1)]


@sourced
@dataclass(eq=False)
class Pruned:
    """``node_mask`` ``[nodes]``, ``edge_mask`` ``[nodes, nodes]`` (rows targets), ``cumulative_scores`` (each node's
    share of the influence covered by the nodes of at least its influence)."""

    node_mask: torch.Tensor
    edge_mask: torch.Tensor
    cumulative_scores: torch.Tensor

    def __iter__(self):
        return iter((self.node_mask, self.edge_mask, self.cumulative_scores))


def prune_graph(graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """circuit-tracer's ``prune_graph``: ``(node_mask, edge_mask, cumulative_scores)``."""
    adjacency = graph.adjacency_matrix.float()
    n_tokens, n_logits, n_features = len(graph.input_tokens), len(graph.logit_tokens), len(graph.selected_features)
    weights = torch.zeros(len(adjacency))
    weights[-n_logits:] = graph.logit_probabilities.float()
    nodes = node_influence(adjacency, weights)
    node_mask = nodes >= threshold_of(nodes, node_threshold)  # over every node's influence, as circuit-tracer
    node_mask[-n_logits - n_tokens:] = True
    pruned = adjacency.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    scores = edge_influence(pruned, weights)
    edge_mask = scores >= threshold_of(scores.flatten(), edge_threshold)
    inner = slice(0, len(adjacency) - n_logits - n_tokens)  # features and errors

    def drop_the_unconnected():
        node_mask[inner] &= edge_mask[:, inner].any(0)  # an outgoing edge
        node_mask[:n_features] &= edge_mask[:n_features].any(1)  # an incoming edge

    before = node_mask.clone()
    drop_the_unconnected()
    while not torch.equal(node_mask, before):  # each pass can leave more nodes without edges
        before = node_mask.clone()
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        drop_the_unconnected()
    ordered, order = torch.sort(nodes, descending=True)
    cumulative = torch.zeros_like(nodes)
    cumulative[order] = torch.cumsum(ordered, 0) / ordered.sum()
    return Pruned(node_mask, edge_mask, cumulative)
