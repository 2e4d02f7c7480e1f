"""Attribution graphs (circuit-tracer 0.5.0's): the direct effects between the nodes of the local replacement model.

Nodes, in circuit-tracer's order: the active features sorted by (layer, position, feature), then one error node per
(layer, position), layer-major, then one token node per position, then the logit nodes by decreasing probability.
``adjacency_matrix[target, source]`` is the source's direct effect on the target through the frozen replacement
(``replacement``): a feature's row is the effect on its pre-activation (``x @ W_enc``, the encoder's row injected
at the transcoder's input), a logit's row the effect on the demeaned logit as the head gives it (before a
soft-cap); a source's vector is ``activation * W_dec`` (summed over the layers a cross-layer transcoder writes
to), the error vector, or the token's embedding. Error, token and logit rows are zero, as are logit columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.refusals import refuse_unsupported
from ..spec.sourced import sourced
from .replacement import GraphUnavailable, replacement_pass
from .transcoders import Transcoders


@sourced
@dataclass(eq=False)
class Graph:
    """circuit-tracer's ``Graph``: ``input_tokens`` ``[n_pos]``, ``active_features`` ``[n_active, 3]`` (layer, pos,
    feature), ``activation_values`` ``[n_active]``, ``selected_features`` (the indices into ``active_features`` of
    the feature nodes), ``adjacency_matrix`` (rows targets, columns sources), ``logit_tokens``,
    ``logit_probabilities``; ``cfg`` the model's sizes and names, ``scan`` the transcoders'.
    ``replacement_logits`` are the replacement model's logits at the last position (the model's, within rounding)."""

    input_string: str
    input_tokens: torch.Tensor
    active_features: torch.Tensor
    activation_values: torch.Tensor
    selected_features: torch.Tensor
    adjacency_matrix: torch.Tensor
    logit_tokens: torch.Tensor
    logit_probabilities: torch.Tensor
    cfg: dict = field(default_factory=dict)
    scan: str | None = None
    replacement_logits: torch.Tensor | None = None

    @property
    def n_pos(self) -> int:
        return len(self.input_tokens)

    @property
    def n_layers(self) -> int:
        return int(self.cfg["n_layers"])

    def node_ids(self) -> list[str]:
        """circuit-tracer's node ids, in node order: ``{layer}_{feature}_{pos}``, ``0_{layer}_{pos}`` (errors),
        ``E_{token}_{pos}``, ``{n_layers + 1}_{token}_{n_pos - 1}`` (logits)."""
        ids = [f"{layer}_{feature}_{pos}" for layer, pos, feature in
               self.active_features[self.selected_features].tolist()]
        ids += [f"0_{layer}_{pos}" for layer in range(self.n_layers) for pos in range(self.n_pos)]
        ids += [f"E_{token}_{pos}" for pos, token in enumerate(self.input_tokens.tolist())]
        ids += [f"{self.n_layers + 1}_{token}_{self.n_pos - 1}" for token in self.logit_tokens.tolist()]
        return ids

    def to_json(self, path, slug: str = "graph", tokenizer=None, node_threshold: float = 0.8,
                edge_threshold: float = 0.98) -> Path:
        """circuit-tracer's graph files (``create_graph_files``): ``{slug}.json`` (metadata, qParams, the nodes and
        links left after ``prune_graph``) in folder ``path``, and ``graph-metadata.json`` beside it. Returns the
        graph's file."""
        from .export import write_json

        return write_json(self, Path(path), slug, tokenizer, node_threshold, edge_threshold)


def _input_ids(model, prompt) -> torch.Tensor:
    """circuit-tracer's tokens: ``add_special_tokens=False``; where the first id is not a special one, the first
    truthy id of [bos, pad, eos, *all_special_ids] is prepended."""
    tokenizer = model.tokenizer
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
    else:
        ids = torch.as_tensor(prompt).flatten().tolist()
    if not ids:
        raise ValueError("attribution_graph: the prompt has no tokens.")
    special = set(tokenizer.all_special_ids)
    if ids[0] not in special:
        candidates = [tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id,
                      *tokenizer.all_special_ids]
        first = next(filter(None, candidates), None)
        if first is None:
            raise ValueError("attribution_graph: the tokenizer has no special token to begin the prompt with (its "
                             "position 0 is a BOS whose features are zeroed); begin the prompt with one.")
        ids = [first, *ids]
    return torch.tensor(ids, dtype=torch.long)


def _select_logits(logits: torch.Tensor, max_n_logits: int, desired_logit_prob: float):
    """circuit-tracer's logit nodes: the top ``max_n_logits`` of the last position's softmax, cut where their
    cumulative probability reaches ``desired_logit_prob``."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probabilities, min(max_n_logits, probabilities.numel()))
    cut = int(torch.searchsorted(torch.cumsum(top.values, 0), torch.tensor(desired_logit_prob))) + 1
    return top.indices[:cut], top.values[:cut]


def attribution_graph(model, prompt, transcoders: Transcoders, max_n_logits: int = 10,
                      desired_logit_prob: float = 0.95, batch_size: int = 256,
                      max_feature_nodes: int | None = None, remote: bool | str = False) -> Graph:
    """The attribution graph of ``prompt`` (a string, or token ids) through ``transcoders`` (``load_transcoders``),
    as circuit-tracer 0.5.0's ``attribute``: one forward pass of the replacement model on ``batch_size`` copies of
    the prompt, and one backward pass per ``batch_size`` targets (features, then logits).

    ``max_feature_nodes`` keeps that many features as nodes, those of most influence on the logits (circuit-tracer
    ranks them as it visits them; here on the whole graph), their edges to the others dropped; None keeps every
    active feature. Refused (``GraphUnavailable``) where the replacement would not be exact: a block that is not a
    sum of its sublayers, a token mixer that is not attention, a norm that is not one scale per position, a pass
    that is still not linear in the stream once frozen.

    ``remote=True`` is refused (``GraphUnavailable``): the graph's pass is not a trace. It freezes the norms and
    makes each MLP's output a leaf with PyTorch hooks on the model's modules, keeps autograd's graph of the batch
    through one backward pass per batch of targets, and walks that graph to prove it linear; a server runs the
    trace a request sends and gives back its saved values, with none of the client's hooks and no autograd graph to
    inspect afterwards. Build the graph where the weights are loaded."""
    refuse_unsupported(model, "attribution_graph")
    if remote:
        raise GraphUnavailable(
            "attribution_graph(remote=True) is unavailable: the graph's pass freezes the norms and replaces the MLPs "
            "with PyTorch hooks on the model's modules, runs one backward pass per batch of targets on the autograd "
            "graph it keeps, and checks that graph is linear; a remote server runs only the trace a request sends "
            "and returns its saved values, with none of those hooks and no autograd graph. Build the graph where the "
            "model's weights are loaded (remote=False).")
    if batch_size < 1:
        raise ValueError("attribution_graph: batch_size is at least 1.")
    ids = _input_ids(model, prompt)
    dtype = next(model._module.parameters()).dtype
    device = next(model._module.parameters()).device
    transcoders = transcoders.to(device, dtype)
    run = replacement_pass(model, ids.to(device), transcoders, batch_size)
    n_layers, n_pos = model.num_layers, len(ids)
    logit_tokens, logit_probabilities = _select_logits(run.logits[0], max_n_logits, desired_logit_prob)

    acts = torch.stack(run.features)  # [layers, pos, d_transcoder]
    active = acts.nonzero()  # sorted by (layer, pos, feature), as a coalesced sparse tensor's indices
    activation_values = acts[tuple(active.T)]
    n_feat = len(active)
    sources = n_feat + n_layers * n_pos + n_pos
    n_logits = len(logit_tokens)
    # the rows are written into the matrix as they come: a feature's at its index, a logit's after the sources
    adjacency = torch.zeros(sources + n_logits, sources + n_logits, dtype=torch.float32)
    row_of = torch.cat([torch.arange(n_feat), torch.arange(sources, sources + n_logits)])
    vocab = run.readout.shape[-1]
    targets = [("feature", k) for k in range(n_feat)] + [("logit", k) for k in range(n_logits)]
    by_place: dict[tuple[int, int], torch.Tensor] = {}  # (layer, pos) -> the indices of its active features
    for layer, pos in torch.unique(active[:, :2], dim=0).tolist():
        by_place[(layer, pos)] = ((active[:, 0] == layer) & (active[:, 1] == pos)).nonzero().flatten()
    embeddings = run.embeddings[0].detach()
    for start in range(0, len(targets), batch_size):
        chunk = targets[start:start + batch_size]
        injections = [torch.zeros_like(x) for x in run.inputs]
        readout = torch.zeros_like(run.readout)
        for b, (kind, k) in enumerate(chunk):
            if kind == "feature":
                layer, pos, feature = active[k].tolist()
                injections[layer][b, pos] = transcoders.W_enc[layer][:, feature].to(injections[layer].dtype)
            else:  # the demeaned logit: W_U[:, token] minus the mean of W_U's columns
                readout[b] = -1.0 / vocab
                readout[b, logit_tokens[k]] += 1.0
        outputs = [(x, g) for x, g in zip(run.inputs, injections) if g.any()]
        if readout.any():
            outputs.append((run.readout, readout))
        grads = torch.autograd.grad([o for o, _ in outputs], [*run.sites, run.embeddings],
                                    grad_outputs=[g for _, g in outputs], retain_graph=True, allow_unused=True)
        site_grads = [torch.zeros_like(s) if g is None else g for s, g in zip(run.sites, grads[:-1])]
        embed_grad = torch.zeros_like(run.embeddings) if grads[-1] is None else grads[-1]
        count = len(chunk)
        # a feature's edge: the gradient at each output it writes to, dotted with activation * its decoder row
        # (per source layer and position, a product with the decoder rows of its active features alone)
        feature_edges = torch.zeros(count, n_feat, dtype=acts.dtype, device=acts.device)
        for source in range(n_layers):
            written = range(source, n_layers) if transcoders.cross_layer else (source,)
            for pos in range(n_pos):
                here = by_place.get((source, pos))
                if here is None:
                    continue
                features = active[here, 2]
                for target in written:
                    decoder = transcoders.decoder(source, target)[features]  # [n_here, d_model]
                    feature_edges[:, here] += site_grads[target][:count, pos] @ decoder.T
        feature_edges *= activation_values
        error_edges = torch.stack([(g[:count] * e).sum(-1) for g, e in zip(site_grads, run.errors)], 1).flatten(1)
        block = torch.cat([feature_edges, error_edges, (embed_grad[:count] * embeddings).sum(-1)], 1)
        adjacency[row_of[start:start + count], :sources] = block.float().cpu()
    selected = torch.arange(n_feat)
    if max_feature_nodes is not None and max_feature_nodes < n_feat:
        from .pruning import node_influence

        weights = torch.zeros(len(adjacency))
        weights[sources:] = logit_probabilities.float().cpu()
        influence = node_influence(adjacency, weights)[:n_feat]
        selected = torch.sort(torch.topk(influence, max_feature_nodes).indices).values
        keep = torch.cat([selected, torch.arange(n_feat, len(adjacency))])
        adjacency = adjacency[keep][:, keep]
    hf = model._module
    cfg = {"model_name": getattr(hf.config, "_name_or_path", "") or type(hf).__name__,
           "tokenizer_name": getattr(model.tokenizer, "name_or_path", ""), "family": model.family.name,
           "n_layers": n_layers, "d_model": model.hidden_size, "d_vocab": vocab, "d_transcoder": transcoders.d_transcoder,
           "transcoder_input": transcoders.input_value, "transcoder_output": transcoders.output_value,
           "cross_layer": transcoders.cross_layer}
    text = model.tokenizer.decode(ids)  # circuit-tracer's input_string: the tokens decoded, the BOS with them
    return Graph(text, ids.cpu(), active.cpu(), activation_values.float().cpu(), selected, adjacency,
                 logit_tokens.cpu(), logit_probabilities.float().cpu(), cfg, transcoders.scan,
                 run.logits[0].detach().float().cpu())


__all__ = ["Graph", "GraphUnavailable", "attribution_graph"]
