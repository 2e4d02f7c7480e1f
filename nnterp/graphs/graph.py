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
from .rows import Rows, all_rows, visited_rows
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
        """The graph files' node ids, in node order, each distinct: ``{layer}_{feature}_{pos}`` (features),
        ``err_{layer}_{pos}`` (errors; circuit-tracer's ``0_{layer}_{pos}`` collides with layer 0's features),
        ``E_{token}_{pos}``, ``{n_layers + 1}_{token}_{n_pos - 1}`` (logits), as circuit-tracer's otherwise."""
        from .export import error_id

        ids = [f"{layer}_{feature}_{pos}" for layer, pos, feature in
               self.active_features[self.selected_features].tolist()]
        ids += [error_id(layer, pos) for layer in range(self.n_layers) for pos in range(self.n_pos)]
        ids += [f"E_{token}_{pos}" for pos, token in enumerate(self.input_tokens.tolist())]
        ids += [f"{self.n_layers + 1}_{token}_{self.n_pos - 1}" for token in self.logit_tokens.tolist()]
        return ids

    def to_json(self, path, slug: str = "graph", tokenizer=None, node_threshold: float = 0.8,
                edge_threshold: float = 0.98, qk=()) -> Path:
        """circuit-tracer's graph files (``create_graph_files``): ``{slug}.json`` (metadata, qParams, the nodes and
        links left after ``prune_graph``) in folder ``path``, and ``graph-metadata.json`` beside it. Returns the
        graph's file. ``qk``: QK attributions' summaries (``QKSummary``), written as the file's ``qk`` section
        (``read_qk`` reads it back)."""
        from .export import write_json

        return write_json(self, Path(path), slug, tokenizer, node_threshold, edge_threshold, list(qk))


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


def _active_features(features: list[torch.Tensor]):
    """``(active, values)``: the nonzero features of every layer (``features[l]`` ``[pos, d_transcoder_l]``: the
    layers' transcoders may differ in width) as ``(layer, pos, feature)`` rows sorted by layer, position, feature,
    as a coalesced sparse tensor's indices, and their activations."""
    active, values = [], []
    for layer, acts in enumerate(features):
        here = acts.nonzero()
        active.append(torch.cat([torch.full_like(here[:, :1], layer), here], 1))
        values.append(acts[tuple(here.T)])
    return torch.cat(active), torch.cat(values)


def attribution_graph(model, prompt, transcoders: Transcoders, max_n_logits: int = 10,
                      desired_logit_prob: float = 0.95, batch_size: int = 256,
                      max_feature_nodes: int | None = None, remote: bool | str = False) -> Graph:
    """The attribution graph of ``prompt`` (a string, or token ids) through ``transcoders`` (``load_transcoders``),
    as circuit-tracer 0.5.0's ``attribute``: one forward pass of the replacement model on ``batch_size`` copies of
    the prompt, and one backward pass per ``batch_size`` targets (features, then logits).

    ``max_feature_nodes`` keeps that many features as nodes, visited in circuit-tracer's order (``rows``): the
    logits' rows first, then batches of features in order of their influence on the logits through the rows
    computed so far; only their rows are computed and held (memory linear in the active features), their edges
    from the features never visited dropped. None keeps every active feature (the square adjacency of all). Refused (``GraphUnavailable``) where the replacement would not be exact: a block that is not a
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
    if max_feature_nodes is not None and max_feature_nodes < 1:
        raise ValueError("attribution_graph: max_feature_nodes is at least 1 (None keeps every active feature).")
    ids = _input_ids(model, prompt)
    dtype = next(model._module.parameters()).dtype
    device = next(model._module.parameters()).device
    transcoders = transcoders.to(device, dtype)
    with torch.enable_grad():  # the pass keeps autograd's graph, even where the caller is in torch.no_grad()
        run = replacement_pass(model, ids.to(device), transcoders, batch_size)
        logit_tokens, logit_probabilities = _select_logits(run.logits[0], max_n_logits, desired_logit_prob)
        active, activation_values = _active_features(run.features)
        vocab = run.readout.shape[-1]
        rows = Rows(run, transcoders, active, activation_values, logit_tokens, vocab)
        if max_feature_nodes is None or max_feature_nodes >= len(active):
            selected, adjacency = torch.arange(len(active)), all_rows(rows, batch_size)
        else:  # circuit-tracer's order of visit: only the rows of the features kept are computed
            selected, adjacency = visited_rows(rows, max_feature_nodes, batch_size,
                                               logit_probabilities.float().cpu())
    hf = model._module
    cfg = {"model_name": getattr(hf.config, "_name_or_path", "") or type(hf).__name__,
           "tokenizer_name": getattr(model.tokenizer, "name_or_path", ""), "family": model.family.name,
           "n_layers": model.num_layers, "d_model": model.hidden_size, "d_vocab": vocab,
           "d_transcoder": transcoders.d_transcoder,
           "transcoder_input": transcoders.input_value, "transcoder_output": transcoders.output_value,
           "cross_layer": transcoders.cross_layer}
    text = model.tokenizer.decode(ids)  # circuit-tracer's input_string: the tokens decoded, the BOS with them
    return Graph(text, ids.cpu(), active.cpu(), activation_values.float().cpu(), selected, adjacency,
                 logit_tokens.cpu(), logit_probabilities.float().cpu(), cfg, transcoders.scan,
                 run.logits[0].detach().float().cpu())


__all__ = ["Graph", "GraphUnavailable", "attribution_graph"]
