"""The rows of an attribution graph, computed on demand: one backward pass of the replacement per batch of targets.

With every feature kept, each feature's row and each logit's row is computed, and the square adjacency holds them.
With ``max_feature_nodes`` below the number of active features, the rows are computed in circuit-tracer 0.5.0's
order of visit: the logits' rows first, then the features in order of their influence on the logits as estimated
from the rows computed so far (re-ranked every ``REFRESH`` batches), until ``max_feature_nodes`` features have a
row. Only those rows are ever held (``[max_feature_nodes + n_logits, nodes]``), so memory grows linearly with the
active features, never with their square; the features never visited are not nodes of the graph.
"""

from __future__ import annotations

import torch

REFRESH = 4  # batches of features between two rankings (circuit-tracer's update_interval)


class Rows:
    """Rows of the graph of one replacement pass (``ReplacementPass``): ``features(indices)`` and ``logits(ks)``
    give ``[count, sources]`` (columns: the active features, the error nodes layer-major, the token nodes)."""

    def __init__(self, run, transcoders, active, activation_values, logit_tokens, vocab: int):
        self.run, self.transcoders, self.active = run, transcoders, active
        self.activation_values, self.logit_tokens, self.vocab = activation_values, logit_tokens, vocab
        self.n_layers, self.n_pos = len(run.inputs), run.embeddings.shape[1]
        self.n_feat = len(active)
        self.sources = self.n_feat + self.n_layers * self.n_pos + self.n_pos
        # (layer, pos, start, end): the active features, sorted by (layer, pos, feature), of each place are a range
        self.places: list[tuple[int, int, int, int]] = []
        if self.n_feat:
            places, counts = torch.unique_consecutive(active[:, :2], dim=0, return_counts=True)
            ends = torch.cumsum(counts, 0)
            for (layer, pos), end, count in zip(places.tolist(), ends.tolist(), counts.tolist()):
                self.places.append((layer, pos, end - count, end))
        self.embeddings = run.embeddings[0].detach()

    def features(self, indices: torch.Tensor) -> torch.Tensor:
        """The rows of active features ``indices``: the effect of every source on each one's pre-activation (its
        encoder's row injected where its transcoder reads)."""
        injections = [torch.zeros_like(x) for x in self.run.inputs]
        for b, (layer, pos, feature) in enumerate(self.active[indices].tolist()):
            encoder = self.transcoders.W_enc[layer][:, feature]
            injections[layer][b, pos] = encoder.to(injections[layer].dtype)
        outputs = [(x, g) for x, g in zip(self.run.inputs, injections) if g.any()]
        return self._rows(outputs, len(indices))

    def logits(self, ks: torch.Tensor) -> torch.Tensor:
        """The rows of logit nodes ``ks``: the effect on the logit less the mean of the logits, as the head gives it."""
        readout = torch.zeros_like(self.run.readout)
        for b, k in enumerate(ks.tolist()):
            readout[b] = -1.0 / self.vocab
            readout[b, self.logit_tokens[k]] += 1.0
        return self._rows([(self.run.readout, readout)], len(ks))

    def _rows(self, outputs, count: int) -> torch.Tensor:
        return self.block(outputs, count).float().cpu()

    def block(self, outputs, count: int, batched: bool = False) -> torch.Tensor:
        """``[count, sources]`` in the pass's dtype and device: copy ``b``'s gradient of ``outputs`` (``(tensor,
        grad_output)`` pairs) dotted with every source's vector. ``batched``: the pass is one copy of the prompt and
        each ``grad_output`` has ``count`` of its outputs' gradients stacked first (autograd's batched gradients)."""
        run = self.run
        grads = torch.autograd.grad([o for o, _ in outputs], [*run.sites, run.embeddings],
                                    grad_outputs=[g for _, g in outputs], retain_graph=True, allow_unused=True,
                                    is_grads_batched=batched)

        def rows_of(leaf, grad):
            if grad is None:
                return leaf.new_zeros(count, *leaf.shape[1:])
            return grad.reshape(count, *leaf.shape[1:]) if batched else grad[:count]
        site_grads = [rows_of(s, g) for s, g in zip(run.sites, grads[:-1])]
        embed_grad = rows_of(run.embeddings, grads[-1])
        # a feature's edge: the gradient at each output it writes to, dotted with activation * its decoder row
        # (per source layer and position, a product with the decoder rows of its active features alone)
        block = torch.zeros(count, self.sources, dtype=self.activation_values.dtype,
                            device=self.activation_values.device)
        feature_edges = block[:, :self.n_feat]
        for source, pos, start, end in self.places:
            features = self.active[start:end, 2]
            written = range(source, self.n_layers) if self.transcoders.cross_layer else (source,)
            for target in written:
                decoder = self.transcoders.decoder(source, target)[features]  # [n_here, d_model]
                feature_edges[:, start:end] += site_grads[target][:, pos] @ decoder.T
        feature_edges *= self.activation_values
        errors = block[:, self.n_feat:self.n_feat + self.n_layers * self.n_pos].view(count, self.n_layers, self.n_pos)
        for layer, (g, e) in enumerate(zip(site_grads, run.errors)):
            errors[:, layer] = (g * e).sum(-1)
        block[:, self.sources - self.n_pos:] = (embed_grad * self.embeddings).sum(-1)
        return block


def all_rows(rows: Rows, batch_size: int) -> torch.Tensor:
    """The square adjacency with every active feature's row and every logit's (error and token rows zero)."""
    n_logits = len(rows.logit_tokens)
    size = rows.sources + n_logits
    adjacency = torch.zeros(size, size)
    for chunk in torch.arange(rows.n_feat).split(batch_size):
        adjacency[chunk, :rows.sources] = rows.features(chunk)
    for chunk in torch.arange(n_logits).split(batch_size):
        adjacency[rows.sources + chunk, :rows.sources] = rows.logits(chunk)
    return adjacency


def partial_influence(matrix: torch.Tensor, row_nodes: torch.Tensor, logit_weights: torch.Tensor) -> torch.Tensor:
    """Each node's influence on the logits through the rows computed so far: ``matrix[r]`` is node
    ``row_nodes[r]``'s row (absolute values, each row normalized to sum to one), the logits (the last nodes)
    weighted by ``logit_weights``, summed over paths of every length."""
    normalized = matrix.abs()
    normalized /= normalized.sum(1, keepdim=True).clamp(min=1e-8)
    flow = torch.zeros(matrix.shape[1])
    flow[-len(logit_weights):] = logit_weights
    total = torch.zeros(matrix.shape[1])
    for _ in range(len(matrix) + 1):  # a path visits each row's node at most once
        flow = flow[row_nodes] @ normalized
        if not flow.any():
            break
        total += flow
    return total


def visited_rows(rows: Rows, max_feature_nodes: int, batch_size: int, logit_weights: torch.Tensor):
    """``(selected, adjacency)``: the ``max_feature_nodes`` features visited in order of influence (sorted indices
    into the active features) and the square adjacency over them, the error, token and logit nodes."""
    n_logits, n_feat = len(rows.logit_tokens), rows.n_feat
    total = rows.sources + n_logits
    matrix = torch.zeros(max_feature_nodes + n_logits, total)
    row_nodes = torch.zeros(max_feature_nodes + n_logits, dtype=torch.long)
    for chunk in torch.arange(n_logits).split(batch_size):
        matrix[chunk, :rows.sources] = rows.logits(chunk)
        row_nodes[chunk] = rows.sources + chunk
    filled, visited = n_logits, torch.zeros(n_feat, dtype=torch.bool)
    while filled - n_logits < max_feature_nodes:
        ranking = torch.argsort(partial_influence(matrix[:filled], row_nodes[:filled], logit_weights)[:n_feat],
                                descending=True)
        pending = ranking[~visited[ranking]][:min(REFRESH * batch_size, max_feature_nodes + n_logits - filled)]
        for chunk in pending.split(batch_size):
            matrix[filled:filled + len(chunk), :rows.sources] = rows.features(chunk)
            row_nodes[filled:filled + len(chunk)] = chunk
            visited[chunk] = True
            filled += len(chunk)
    selected = visited.nonzero().flatten()
    columns = torch.cat([selected, torch.arange(n_feat, total)])
    matrix = matrix[:, columns][torch.argsort(row_nodes)]  # rows: the selected features in order, then the logits
    adjacency = torch.zeros(len(columns), len(columns))
    adjacency[:max_feature_nodes] = matrix[:max_feature_nodes]
    adjacency[-n_logits:] = matrix[max_feature_nodes:]
    return selected, adjacency
