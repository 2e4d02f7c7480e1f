"""A graph's plot and its feature interventions.

The plot draws exactly the nodes ``prune_graph`` keeps (the mask itself checked against the closed-form influence)
and the kept edges between them. A feature intervention is checked against a plain PyTorch forward hook on the
unwrapped model's MLP that encodes its input with the transcoder read from the safetensors files here and adds
``(new - activation) * W_dec[feature]`` to its output, at the edited position.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from nnterp.graphs import (
    GraphUnavailable,
    TranscoderError,
    attribution_graph,
    feature_intervention,
    feature_intervention_generate,
    load_transcoders,
    plot_graph,
    prune_graph,
    write_random_transcoders,
)

from ..remote.test_remote import checkpoints, requests, server  # noqa: F401  (the remote harness's fixtures)
from ..remote.test_remote import load as load_remote
from .test_attribution_graph import PROMPT, _build, _influence


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny Llama in float64, JumpReLU transcoders reading each MLP's input, and its graph."""
    tmp_path = tmp_path_factory.mktemp("graph")
    model, hf, _, folder = _build("llama", tmp_path, "mlp.hook_in", jumprelu=True)
    graph = attribution_graph(model, PROMPT, load_transcoders(folder), batch_size=64)
    return model, hf, folder, graph


def test_the_plot_draws_the_pruned_graphs_nodes_and_edges(built, tmp_path):
    model, _, _, graph = built
    file = plot_graph(graph, tmp_path / "graph.png", tokenizer=model.tokenizer)
    assert file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and file.stat().st_size > 1000
    node_threshold = 0.5
    node_mask, edge_mask, _ = prune_graph(graph, node_threshold=node_threshold, edge_threshold=0.9)
    # the mask itself: tokens and logits kept, the kept features and errors among the fewest nodes covering
    # node_threshold of the influence (closed form), some features dropped
    n_feat, n_logits, n_pos = len(graph.selected_features), len(graph.logit_tokens), graph.n_pos
    weights = torch.zeros(len(graph.adjacency_matrix))
    weights[-n_logits:] = graph.logit_probabilities
    influence = _influence(graph.adjacency_matrix, weights)
    order = torch.argsort(influence, descending=True)
    covered = torch.cumsum(influence[order], 0) / influence.sum()
    top = set(order[: int((covered < node_threshold).sum()) + 1].tolist())
    inner = node_mask.clone()
    inner[-n_logits - n_pos:] = False
    assert node_mask[-n_logits - n_pos:].all() and set(inner.nonzero().flatten().tolist()) <= top
    assert 0 < node_mask[:n_feat].sum() < n_feat
    figure = plot_graph(graph, None, node_threshold=node_threshold, edge_threshold=0.9)
    axes = figure.axes[0]
    drawn_nodes = [url for c in axes.collections if type(c).__name__ == "PathCollection" for url in c.get_urls()]
    drawn_edges = [url for c in axes.collections if type(c).__name__ == "LineCollection" for url in c.get_urls()]
    ids = graph.node_ids()
    assert sorted(drawn_nodes) == sorted(ids[i] for i in node_mask.nonzero().flatten().tolist())
    kept = edge_mask & node_mask[:, None] & node_mask[None]
    assert sorted(drawn_edges) == sorted(f"{ids[s]}->{ids[t]}" for t, s in kept.nonzero().tolist())
    assert drawn_edges
    import matplotlib.pyplot as plt

    plt.close(figure)


def test_the_plot_draws_a_selected_heads_query_key_and_top_sources(built):
    import matplotlib.pyplot as plt

    from nnterp.graphs import qk_attribution

    model, _, folder, graph = built
    summary = qk_attribution(model, graph, load_transcoders(folder), 2, 1, graph.n_pos - 1, 3).summary(top=4)
    figure = plot_graph(graph, None, qk=summary)
    axes = figure.axes[0]
    stars = [c for c in axes.collections if list(c.get_urls()) == ["qk:query", "qk:key"]]
    assert len(stars) == 1
    assert stars[0].get_offsets().tolist() == [[graph.n_pos - 1, 3], [3, 3]]  # block 2's row, at the positions
    lines = [c for c in axes.collections if type(c).__name__ == "LineCollection" and
             any(url.startswith("qk:") for url in c.get_urls())]
    expected = [f"qk:{t['source']}->{side}" for side, tops in (("query", summary.top_query), ("key", summary.top_key))
                for t in tops if t["source"] != "bias"]
    assert len(lines) == 1 and list(lines[0].get_urls()) == expected and expected
    # each line ends at its side's star, and starts at its source's (position, layer) cell
    for url, segment in zip(expected, lines[0].get_segments()):
        source, side = url[3:].rsplit("->", 1)
        assert segment[1].tolist() == ([graph.n_pos - 1, 3] if side == "query" else [3, 3])
        pos = int(source.split("_")[2])  # {layer}_{feature}_{pos}, err_{layer}_{pos}, E_{token}_{pos}
        assert abs(segment[0][0] - pos) <= 0.4 + 1e-9  # a kept node is spread across its cell
    plt.close(figure)
    # the graph drawn without a head has none of it
    figure = plot_graph(graph, None)
    assert not [url for c in figure.axes[0].collections for url in (c.get_urls() or []) if url and url.startswith("qk:")]
    plt.close(figure)


def _hooked(hf, folder, edits, n_pos):
    """Forward hooks on each edited layer's MLP: the transcoder's features of its input, the edit's change of the
    decoded output added at the edited position (on the prompt's pass alone: ``n_pos`` positions)."""
    handles = []
    for layer in sorted({edit[0] for edit in edits}):
        tc = load_file(str(folder / f"layer_{layer}.safetensors"))
        W_enc, b_enc, W_dec = tc["W_enc"].double(), tc["b_enc"].double(), tc["W_dec"].double()
        threshold = tc["activation_function.threshold"].double()
        mine = [(pos, feature, value) for lay, pos, feature, value in edits if lay == layer]

        def hook(module, args, out, W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, threshold=threshold, mine=mine):
            x = args[0]
            if x.shape[1] != n_pos:  # a generated step: no edit
                return out
            pre = x.double() @ W_enc.T + b_enc
            act = torch.relu(pre) * (pre > threshold).double()
            out = out.clone()
            for pos, feature, value in mine:
                out[0, pos] += ((value - act[0, pos, feature]) * W_dec[feature]).to(out.dtype)
            return out
        handles.append(hf.model.layers[layer].mlp.register_forward_hook(hook))
    return handles


def test_feature_interventions_are_a_plain_hooks_edit_of_the_mlp_output(built):
    model, hf, folder, graph = built
    transcoders = load_transcoders(folder)
    # the graph's feature of most activation at layer 0 turned off, and one of layer 1 tripled
    first = [k for k, (layer, _, _) in enumerate(graph.active_features.tolist()) if layer == 0]
    second = [k for k, (layer, _, _) in enumerate(graph.active_features.tolist()) if layer == 1]
    off = max(first, key=lambda k: float(graph.activation_values[k]))
    up = max(second, key=lambda k: float(graph.activation_values[k]))
    edits = [(*graph.active_features[off].tolist(), 0.0),
             (*graph.active_features[up].tolist(), 3 * float(graph.activation_values[up]))]
    ids = graph.input_tokens[None]
    with torch.no_grad():
        clean = hf(input_ids=ids).logits[0]
        handles = _hooked(hf, folder, edits, ids.shape[1])
        try:
            expected = hf(input_ids=ids).logits[0]
            expected_ids = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                                       do_sample=False)[0]
        finally:
            for handle in handles:
                handle.remove()
    logits = feature_intervention(model, graph, transcoders, edits)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    assert (logits - clean).abs().max() > 1e-3  # the edit changed the model
    # the prompt as a string: tokenized as the graph was
    torch.testing.assert_close(feature_intervention(model, PROMPT, transcoders, edits), expected, rtol=0, atol=1e-10)
    generated = feature_intervention_generate(model, graph, transcoders, edits, max_new_tokens=5)
    assert torch.equal(generated, expected_ids)


def test_gemma2_transcoders_of_the_normalized_input_are_edited_as_a_plain_hook_does(tmp_path):
    """circuit-tracer's Gemma-2 hooks: the transcoder reads pre_feedforward_layernorm's output before its (1 + w)
    weight (TransformerLens's ln2.hook_normalized) and writes after post_feedforward_layernorm (hook_mlp_out)."""
    model, hf, _, folder = _build("gemma2", tmp_path, "ln2.hook_normalized", jumprelu=True, skip=True)
    edits = [(0, 3, 2, 0.0), (1, 5, 7, 4.0)]
    ids = attribution_graph(model, PROMPT, load_transcoders(folder), batch_size=64).input_tokens[None]
    with torch.no_grad():
        clean = hf(input_ids=ids).logits[0]
    features, handles = {}, []
    for layer in {edit[0] for edit in edits}:
        tc = load_file(str(folder / f"layer_{layer}.safetensors"))
        block = hf.model.layers[layer]

        def read(module, args, out, tc=tc, layer=layer):
            x = out.double() / (1 + module.weight.double())  # hook_normalized: before the (1 + w) weight
            pre = x @ tc["W_enc"].double().T + tc["b_enc"].double()
            features[layer] = torch.relu(pre) * (pre > tc["activation_function.threshold"].double()).double()

        def write(module, args, out, tc=tc, layer=layer):
            out = out.clone()
            for lay, pos, feature, value in edits:
                if lay == layer:
                    change = (value - features[layer][0, pos, feature]) * tc["W_dec"][feature].double()
                    out[0, pos] += change.to(out.dtype)
            return out
        handles += [block.pre_feedforward_layernorm.register_forward_hook(read),
                    block.post_feedforward_layernorm.register_forward_hook(write)]
    with torch.no_grad():
        try:
            expected = hf(input_ids=ids).logits[0]
        finally:
            for handle in handles:
                handle.remove()
    logits = feature_intervention(model, PROMPT, load_transcoders(folder), edits)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-9)
    assert (logits - clean).abs().max() > 1e-3


def test_interventions_that_cannot_be_made_are_refused(built, tmp_path):
    model, _, folder, graph = built
    transcoders = load_transcoders(folder)
    with pytest.raises(IndexError, match="positions 0..8"):
        feature_intervention(model, graph, transcoders, [(0, 9, 0, 0.0)])
    with pytest.raises(IndexError, match="features 0..15"):
        feature_intervention(model, graph, transcoders, [(0, 1, 16, 0.0)])
    with pytest.raises(ValueError, match="An edit is"):
        feature_intervention(model, graph, transcoders, [(0, 1, 0)])
    cross = write_random_transcoders(tmp_path / "clt", model.num_layers, model.hidden_size, 16, cross_layer=True)
    with pytest.raises(TranscoderError, match="cross-layer"):
        feature_intervention(model, graph, load_transcoders(cross), [(0, 1, 0, 0.0)])


def test_a_remote_graph_is_refused_with_the_reason(built):
    model, _, folder, _ = built
    with pytest.raises(GraphUnavailable, match=r"remote=True\) is unavailable: .*PyTorch hooks"):
        attribution_graph(model, PROMPT, load_transcoders(folder), remote="http://localhost:1")


def test_feature_interventions_run_remotely_bit_exactly(checkpoints, requests, tmp_path):  # noqa: F811
    """The server has no nnterp: the splices and the transcoders ship with the request."""
    model = load_remote("llama", checkpoints)
    transcoders = load_transcoders(write_random_transcoders(tmp_path / "tc", model.num_layers, model.hidden_size, 16,
                                                            jumprelu=True))
    edits = [(0, 2, 3, 0.0), (1, 4, 5, 2.5)]
    here = feature_intervention(model, PROMPT, transcoders, edits)
    there = feature_intervention(model, PROMPT, transcoders, edits, remote=True)
    assert requests and torch.equal(here, there)
    generated = feature_intervention_generate(model, PROMPT, transcoders, edits, max_new_tokens=3)
    assert torch.equal(generated, feature_intervention_generate(model, PROMPT, transcoders, edits, max_new_tokens=3,
                                                                remote=True))
