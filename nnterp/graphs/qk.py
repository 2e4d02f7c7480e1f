"""Why a head attended where it did: one head's pre-softmax score at (query, key) as (query-side source) x
(key-side source) terms over an attribution graph's sources (QK attribution).

The replacement pass of the graph (``replacement``) freezes the attention patterns, every norm's scale (the q/k
norms' too) and cuts the MLPs into their transcoders' features and error nodes; the stream a block's attention
reads is then affine in the sources: the active features (``activation * W_dec``), the error nodes, the token
embeddings, and a constant (the biases of the projections, the norms and the transcoders, the positional
embeddings, position 0's MLP outputs: the ``bias`` source). The head's query at ``query`` and key at ``key``, after
the frozen norms, the projections and the rotary at their positions, are so each a sum of one vector per source
(its gradient through the pass dotted with the source's vector; the bias is the query less the sum of the
others), and the score is ``factor * query . key``: the terms ``factor * q_s . k_t`` sum to the model's own
``attention_scores`` at (head, query, key). ``factor`` is the attention's scaling, measured on the head's whole
causal pattern and checked to be one number there; where the model soft-caps its scores (Gemma-2's
``attn_logit_softcapping``), the cap's ratio at this pair (capped / uncapped) is frozen into it, as a norm's scale
is. A score that is not a scaled product of query and key (ALiBi's bias by distance) is refused with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..spec.errors import ValueUnavailable
from ..spec.sourced import sourced
from .replacement import GraphUnavailable, _attention_values_on, replacement_pass
from .rows import Rows
from .transcoders import Transcoders

BIAS = "bias"  # the id of the constant source


def _refuse(model, reason: str):
    raise GraphUnavailable(f"qk_attribution is unavailable on {model.family.name}: {reason}.")


@sourced
@dataclass(eq=False)
class QKAttribution:
    """Head ``head`` of block ``layer`` at (``query``, ``key``): ``sources`` the node ids (active features
    ``{layer}_{feature}_{pos}``, errors ``err_{layer}_{pos}``, tokens ``E_{token}_{pos}``, then ``bias``),
    ``query_vectors`` and ``key_vectors`` ``[sources, head_dim]`` each source's part of the query and the key (they
    sum to them), ``factor`` the scaling (times the frozen soft-cap ratio), ``score`` the model's score there;
    ``frozen`` says what the decomposition holds at the pass's values."""

    layer: int
    head: int
    query: int
    key: int
    sources: list[str]
    query_vectors: torch.Tensor
    key_vectors: torch.Tensor
    factor: float
    score: float
    frozen: list[str] = field(default_factory=list)

    def terms(self) -> torch.Tensor:
        """``[sources, sources]``: ``terms[s, t]`` the part of the score of query-side source ``s`` with key-side
        source ``t``; they sum to ``score``."""
        return self.factor * self.query_vectors @ self.key_vectors.T

    def query_effects(self) -> torch.Tensor:
        """Each source's part of the score through the query (a row of ``terms`` summed)."""
        return self.factor * self.query_vectors @ self.key_vectors.sum(0)

    def key_effects(self) -> torch.Tensor:
        """Each source's part of the score through the key (a column of ``terms`` summed)."""
        return self.factor * self.key_vectors @ self.query_vectors.sum(0)

    def loading(self, source: str) -> dict:
        """How much ``source`` (a node id) moves the head here: the norms of its parts of the query and of the
        key, and its effects on the score through each."""
        i = self.sources.index(source)
        return {"query_norm": float(self.query_vectors[i].norm()), "key_norm": float(self.key_vectors[i].norm()),
                "query_effect": float(self.query_effects()[i]), "key_effect": float(self.key_effects()[i])}

    def summary(self, top: int = 10) -> QKSummary:
        """The compact result: the ``top`` query-side and key-side sources by their effect on the score, and the
        ``top`` pairs by their term, found a block of query-side sources at a time (never the whole square)."""
        def ranked(effects, norms):
            order = torch.argsort(effects.abs(), descending=True)[:top].tolist()
            return [{"source": self.sources[i], "effect": float(effects[i]), "norm": float(norms[i])} for i in order]

        pairs: list[tuple[float, int, int]] = []
        for start in range(0, len(self.sources), 4096):
            block = self.factor * self.query_vectors[start:start + 4096] @ self.key_vectors.T
            values, flat = torch.topk(block.abs().flatten(), min(top, block.numel()))
            pairs += [(float(block.flatten()[f]), start + f // block.shape[1], f % block.shape[1])
                      for f in flat.tolist()]
        pairs = sorted(pairs, key=lambda p: -abs(p[0]))[:top]
        return QKSummary(self.layer, self.head, self.query, self.key, self.score, self.factor,
                         ranked(self.query_effects(), self.query_vectors.norm(dim=1)),
                         ranked(self.key_effects(), self.key_vectors.norm(dim=1)),
                         [{"query_source": self.sources[i], "key_source": self.sources[j], "term": term}
                          for term, i, j in pairs], list(self.frozen))


@sourced
@dataclass
class QKSummary:
    """The compact QK attribution of one head at one (query, key): ``top_query`` and ``top_key`` (``source``,
    ``effect`` on the score, ``norm`` of its part of the query or key), ``top_pairs`` (``query_source``,
    ``key_source``, ``term``). Written into a graph file as its ``qk`` section (``Graph.to_json(..., qk=[...])``)
    and read back by ``read_qk``."""

    layer: int
    head: int
    query: int
    key: int
    score: float
    factor: float
    top_query: list[dict]
    top_key: list[dict]
    top_pairs: list[dict]
    frozen: list[str]

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, entry: dict) -> QKSummary:
        missing = set(cls.__dataclass_fields__) - set(entry)
        if missing:
            raise ValueError(f"a qk entry lacks {sorted(missing)}")
        return cls(**{name: entry[name] for name in cls.__dataclass_fields__})


def read_qk(path) -> list[QKSummary]:
    """The ``qk`` section of a graph file written by ``Graph.to_json(..., qk=...)`` (empty where it has none)."""
    document = json.loads(Path(path).read_text())
    return [QKSummary.from_dict(entry) for entry in document.get("qk", [])]


def _source_ids(active: torch.Tensor, ids: torch.Tensor, n_layers: int) -> list[str]:
    from .export import error_id

    n_pos = len(ids)
    return ([f"{layer}_{feature}_{pos}" for layer, pos, feature in active.tolist()]
            + [error_id(layer, pos) for layer in range(n_layers) for pos in range(n_pos)]
            + [f"E_{token}_{pos}" for pos, token in enumerate(ids.tolist())] + [BIAS])


def _softcap(model, module) -> float | None:
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap is None:
        cap = getattr(model._module.config.get_text_config(), "attn_logit_softcapping", None)
    return float(cap) if cap else None


def _factor(model, layer: int, head: int, queries, keys, scores, cap: float | None):
    """The scaling of head ``head``'s scores (one number over its causal pattern) and its uncapped scores, or a
    refusal where the scores are not that number times query . key (a bias by position, a cap nnterp does not know).
    """
    q, k = queries[0, :, head].double(), keys[0, :, head].double()
    raw = q @ k.T
    s = scores[0, head].double()
    kept = torch.ones_like(s, dtype=torch.bool).tril() & (s > torch.finfo(scores.dtype).min / 2) & s.isfinite()
    uncapped = cap * torch.atanh((s / cap).clamp(-1, 1)) if cap else s
    factor = float((uncapped[kept] * raw[kept]).sum() / (raw[kept] * raw[kept]).sum().clamp(min=1e-300))
    far = (uncapped[kept] - factor * raw[kept]).abs().max() / uncapped[kept].abs().max().clamp(min=1e-300)
    if far > (1e-4 if torch.finfo(scores.dtype).bits >= 32 else 3e-2):
        _refuse(model, f"block {layer}'s scores are not one scaling times query . key (relative difference "
                       f"{far.item():.2g}): a bias by position (ALiBi) or a transformation of the scores that is "
                       "not bilinear in the stream")
    return factor, kept


def qk_attribution(model, graph_or_prompt, transcoders: Transcoders, layer: int, head: int, query: int,
                   key: int) -> QKAttribution:
    """Head ``head`` of block ``layer``'s pre-softmax score at position ``query`` attending to ``key`` as terms
    over the sources of the graph of ``graph_or_prompt`` (an ``attribution_graph``'s ``Graph``, or the prompt it
    would be built from) through ``transcoders`` (the graph's). One pass of the replacement model on the prompt
    and one backward pass of ``2 * head_dim`` batched gradients (each coordinate of the query and of the key).
    Refused (``GraphUnavailable``) where the graph is, and where the score is not bilinear in the stream once the
    norms and the soft-cap are frozen (ALiBi's bias by distance); ``ValueError`` for a key the block masks at the
    query, a head or a position out of range."""
    from .graph import Graph, _active_features, _input_ids

    graph = graph_or_prompt if isinstance(graph_or_prompt, Graph) else None
    ids = graph.input_tokens if graph is not None else _input_ids(model, graph_or_prompt)
    n_pos = len(ids)
    if not 0 <= layer < model.num_layers:
        raise ValueError(f"qk_attribution: layer {layer} is not a block of the model (0 to {model.num_layers - 1}).")
    if not 0 <= key <= query < n_pos:
        raise ValueError(f"qk_attribution: the key position ({key}) is at most the query position ({query}), both "
                         f"positions of the prompt's {n_pos} tokens (the attention is causal).")
    parameter = next(model._module.parameters())
    transcoders = transcoders.to(parameter.device, parameter.dtype)
    reads = ((layer, "queries"), (layer, "keys"), (layer, "attention_scores"))
    with _attention_values_on(model), torch.enable_grad():
        try:
            for _, name in reads:
                model.location(layer, f"self_attn.{name}")
        except ValueUnavailable as error:
            _refuse(model, f"block {layer}'s {error.key} cannot be read ({error.reason})")
        attention = model._module.get_submodule(
            model.block_path(layer, model.location(layer, "self_attn.queries").path))
        run = replacement_pass(model, ids.to(parameter.device), transcoders, 1, reads=reads, linear=reads[:2])
        queries, keys, scores = (run.values[r] for r in reads)  # [1, seq, heads, head_dim], [1, heads, seq, seq]
        heads, kv_heads, d = queries.shape[2], keys.shape[2], queries.shape[3]
        if not 0 <= head < heads:
            raise ValueError(f"qk_attribution: head {head} is not a head of block {layer} (0 to {heads - 1}).")
        kv_head = head // (heads // kv_heads)  # grouped queries: each key head serves heads // kv_heads heads
        active, values = _active_features(run.features)
        if graph is not None and not torch.equal(active.cpu(), graph.active_features):
            raise ValueError("qk_attribution: the graph's active features are not those of this model, prompt and "
                             "transcoders: pass the transcoders the graph was built with.")
        cap = _softcap(model, attention)
        factor, kept = _factor(model, layer, head, queries.detach(), keys.detach()[:, :, kv_head:kv_head + 1]
                               .expand(-1, -1, heads, -1), scores.detach(), cap)
        if not kept[query, key]:
            raise ValueError(f"qk_attribution: block {layer} masks key {key} at query {query} (its score is the "
                             "mask's, not a product of query and key).")
        # one backward pass of 2 * head_dim gradients batched over one copy of the pass: each coordinate of the
        # query, then of the key
        q_grad = queries.new_zeros(2 * d, *queries.shape)
        k_grad = keys.new_zeros(2 * d, *keys.shape)
        for b in range(d):
            q_grad[b, 0, query, head, b] = 1
            k_grad[d + b, 0, key, kv_head, b] = 1
        rows = Rows(run, transcoders, active, values, torch.zeros(0, dtype=torch.long), 1)
        block = rows.block([(queries, q_grad), (keys, k_grad)], 2 * d, batched=True).detach()
    q_total, k_total = queries[0, query, head].detach(), keys[0, key, kv_head].detach()
    query_vectors, key_vectors = block[:d].T, block[d:].T  # [sources, head_dim]
    query_vectors = torch.cat([query_vectors, (q_total - query_vectors.sum(0))[None].to(block.dtype)])
    key_vectors = torch.cat([key_vectors, (k_total - key_vectors.sum(0))[None].to(block.dtype)])
    score = scores[0, head, query, key].detach()
    frozen = ["the attention patterns of every block", "every norm's scale (the q/k norms' too)",
              "the MLPs: their transcoders' features and error nodes"]
    if cap:  # the cap's ratio at this pair, frozen: factor * query . key is the model's capped score
        uncapped = cap * float(torch.atanh((score.double() / cap).clamp(-1, 1)))
        if uncapped != 0:  # (at 0 the ratio's limit is 1)
            factor *= float(score) / uncapped
        frozen.append(f"the soft-cap's ratio at this pair (tanh(s / {cap:g}) * {cap:g} / s)")
    return QKAttribution(layer, head, query, key, _source_ids(active.cpu(), ids.cpu(), model.num_layers),
                         query_vectors.cpu(), key_vectors.cpu(), factor, float(score), frozen)


__all__ = ["QKAttribution", "QKSummary", "qk_attribution", "read_qk"]
