"""Attribution graphs against a frozen replacement model built here, independently, with plain PyTorch.

Ground truth: the unwrapped transformers model in eager attention, run with forward hooks at the module boundaries
the family matrix writes down (``tests/families/test_families.py``'s ``CASES``): every softmax of the pass replayed
at its clean value (the attention patterns frozen), every norm recomputed from its own definition at the scale it
had in the clean pass, each MLP's output replaced by the transcoder's decoded features (read from the safetensors
files here) plus the clean pass's remainder, the token embeddings' rows zeroable. That replacement is affine in its
sources, so a source's column of the graph is the change of every target when that source is removed (finite
differences, exact up to rounding in float64), and each row plus the targets' value with every source removed is
the target's value (circuit-tracer's completeness: the sources explain every feature's pre-activation and logit).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nnterp import StandardizedTransformer
from nnterp.graphs import (
    GraphUnavailable,
    TranscoderError,
    attribution_graph,
    load_transcoders,
    prune_graph,
    write_random_transcoders,
)

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import CASES

PROMPT = "the cat sat on the mat in Paris"
D_TC = 16
# case -> the transcoders' feature_input_hook (circuit-tracer's names): the MLP norm's output or the MLP's input
FAMILY_CASES = {
    "llama": "hook_resid_mid", "gpt2": "ln2.hook_normalized", "gptj": "mlp.hook_in",
    "gpt_neox_parallel": "ln2.hook_normalized", "gemma2": "ln2.hook_normalized", "granite": "hook_resid_mid",
    "mixtral": "hook_resid_mid", "bloom": "hook_resid_mid", "mistral": "mlp.hook_in", "qwen2": "ln2.hook_normalized",
    "qwen3": "mlp.hook_in", "gemma": "ln2.hook_normalized", "phi": "mlp.hook_in", "stablelm_sequential": "mlp.hook_in",
    "cohere": "ln2.hook_normalized", "falcon_rw_rope": "mlp.hook_in", "olmo2": "mlp.hook_in",
    "gpt_neo": "ln2.hook_normalized", "starcoder2": "hook_resid_mid", "qwen2_moe": "mlp.hook_in",
    "gemma3": "ln2.hook_normalized", "gpt_neox_sequential": "mlp.hook_in", "olmoe": "mlp.hook_in",
    "opt": "ln2.hook_normalized", "falcon_7b_parallel": "mlp.hook_in", "mpt": "hook_resid_mid", "phi3": "mlp.hook_in",
    "gpt_bigcode": "ln2.hook_normalized", "codegen": "mlp.hook_in", "glm": "ln2.hook_normalized",
    "deepseek_v3": "mlp.hook_in", "qwen3_moe": "hook_resid_mid", "gpt_oss": "mlp.hook_in", "olmo": "ln2.hook_normalized",
    "biogpt": "mlp.hook_in", "smollm3": "mlp.hook_in", "glm4": "mlp.hook_in",
    "apertus": "mlp.hook_in", "persimmon": "ln2.hook_normalized", "stablelm_parallel": "mlp.hook_in",
    "falcon_40b_two_norms": "ln2.hook_normalized", "minicpm3": "mlp.hook_in", "hyperclovax": "mlp.hook_in",
    "vaultgemma": "ln2.hook_normalized", "nanochat": "mlp.hook_in", "llama4": "mlp.hook_in",
}
FLOAT32 = {"mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "qwen3_moe", "gpt_oss"}  # transformers' grouped experts run in float32 at the least
INPUT_VALUE = {"ln2.hook_normalized": "mlp_norm_output", "mlp.hook_in": "mlp_input", "hook_resid_mid": "layer_mid"}


def _first(value):
    return value[0] if isinstance(value, (tuple, list)) else value


def _is_norm(module):
    return "Norm" in type(module).__name__ or isinstance(module, nn.LayerNorm)


def _norm(module, x, scale=None):
    """The norm's own definition: ``(x - mean) / sqrt(mean((x - mean)^2) + eps) * weight + bias`` (no centring on an
    RMSNorm, Gemma's weight applied as ``1 + weight``), at ``scale`` where given. ``(output, scale)``."""
    name = type(module).__name__
    centred = isinstance(module, nn.LayerNorm) or ("LayerNorm" in name and "RMS" not in name)
    eps = next((getattr(module, e) for e in ("eps", "variance_epsilon", "epsilon") if hasattr(module, e)), 1e-5)
    v = x - x.mean(-1, keepdim=True) if centred else x
    if scale is None:
        scale = (v.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    out = v / scale
    if weight is not None:
        out = out * (weight + 1 if "Gemma" in name else weight)
    return (out if bias is None else out + bias), scale


class Replacement:
    """The frozen replacement of one prompt, in plain PyTorch: ``run(...)`` gives every target's value."""

    def __init__(self, hf, blocks, truth, folder, ids, input_value):
        self.hf, self.blocks, self.truth, self.ids, self.input_value = hf, blocks, truth, ids, input_value
        self.n = len(blocks)
        self.cross_layer = (folder / "W_enc_0.safetensors").is_file()
        if self.cross_layer:  # W_enc_i: W_enc_i, b_enc_i, b_dec_i; W_dec_i: [d_tc, L - i, d_model]
            files = [{k.rpartition("_")[0]: v for k, v in load_file(str(folder / f"W_enc_{i}.safetensors")).items()}
                     | {"W_dec": load_file(str(folder / f"W_dec_{i}.safetensors"))[f"W_dec_{i}"]}
                     for i in range(self.n)]
        else:
            files = [load_file(str(folder / f"layer_{i}.safetensors")) for i in range(self.n)]
        self.W_enc = [f["W_enc"].T.double() for f in files]
        self.b_enc = [f["b_enc"].double() for f in files]
        self.W_dec = [f["W_dec"].double() for f in files]
        self.b_dec = [f["b_dec"].double() for f in files]
        self.threshold = [f.get("activation_function.threshold", f.get("threshold")) for f in files]
        self.W_skip = [f.get("W_skip") for f in files]
        self.norms = [(name, m) for name, m in hf.named_modules() if _is_norm(m)]
        clean = self._pass(record=True)
        self.softmaxes, self.scales = clean["softmaxes"], clean["scales"]
        self.scores = clean["scores"]  # each attention's scores (its softmax's input), in the model's own pass
        assert len(self.softmaxes) >= self.n, "the attention does not run a softmax the replacement can freeze"
        self.acts = []
        for i in range(self.n):
            pre = clean["inputs"][i] @ self.W_enc[i] + self.b_enc[i]
            act = torch.relu(pre) * (1 if self.threshold[i] is None else (pre > self.threshold[i]).double())
            act[0] = 0  # position 0: no active features
            self.acts.append(act)
        self.errors = [clean["outputs"][i] - self._decode(i, self.acts, clean["inputs"][i]) for i in range(self.n)]
        self.logits = clean["logits"]

    def _decode(self, i, acts, x):
        if self.cross_layer:  # every earlier layer's features write to layer i
            return sum(acts[s] @ self.W_dec[s][:, i - s] for s in range(i + 1)) + self.b_dec[i]
        out = acts[i] @ self.W_dec[i] + self.b_dec[i]
        return out if self.W_skip[i] is None else out + x @ self.W_skip[i].double().T

    def _place(self, i, name):
        """(module, side, factor): a truth's third element names the block attribute the block multiplies the
        module's tensor by as it adds it (Granite's residual multiplier), which the value includes."""
        path, side, *scale = self.truth(i)[name]
        factor = float(getattr(self.blocks[i], scale[0])) if scale else 1.0
        return (self.blocks[i].get_submodule(path) if path else self.blocks[i]), side, factor

    def _pass(self, record=False, acts=None, errors=None, zero_tokens=()):
        got = {"softmaxes": [], "scales": {}, "inputs": {}, "outputs": {}, "scores": []}
        handles, count = [], [0]
        plain = torch.nn.functional.softmax

        def softmax(*args, **kwargs):
            out = plain(*args, **kwargs)
            if args[0].dim() == 4:  # an attention's scores (a router's softmax reads [tokens, experts])
                got["scores"].append(args[0].detach().clone())
            if record:
                got["softmaxes"].append(out)
                return out
            frozen = self.softmaxes[count[0]]
            count[0] += 1
            assert frozen.shape == out.shape
            return frozen

        for name, module in self.norms:
            def norm_hook(m, args, kwargs, out, name=name):
                x = args[0] if args else next(iter(kwargs.values()))
                if record:
                    y, scale = _norm(m, x.double())
                    torch.testing.assert_close(y, _first(out).double(), rtol=1e-5, atol=1e-6)  # the definition is right
                    got["scales"].setdefault(name, []).append(scale)
                    return out
                scale = self.scales[name][got["scales"].setdefault(name, 0)]
                got["scales"][name] += 1
                y = _norm(m, x.double(), scale)[0].to(_first(out).dtype)
                return (y, *out[1:]) if isinstance(out, tuple) else y
            handles.append(module.register_forward_hook(norm_hook, with_kwargs=True))
        for i in range(self.n):
            module, side, _ = self._place(i, self.input_value)

            def read_input(x, i=i, module=module):
                x = x.to(torch.float64, copy=True).reshape(self.ids.shape[1], -1)
                if self.input_value == "mlp_norm_output":  # TransformerLens's hook_normalized: before weight, bias
                    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
                    x = x if bias is None else x - bias
                    x = x if weight is None else x / (weight + 1 if "Gemma" in type(module).__name__ else weight)
                got["inputs"][i] = x
            if side == "out":
                handles.append(module.register_forward_hook(lambda m, a, o, read=read_input: read(_first(o))))
            else:
                handles.append(module.register_forward_pre_hook(
                    lambda m, a, k, read=read_input: read(a[0] if a else k["hidden_states"]), with_kwargs=True))
            module, _, factor = self._place(i, "mlp_output")

            def replace(m, a, out, i=i, factor=factor):
                tensor = _first(out)
                # a copy: a block may add to its MLP's output in place (Falcon's parallel blocks); the value is what
                # the block adds (times its factor), and the transcoder's output is handed back through it
                got["outputs"][i] = tensor.to(torch.float64, copy=True).reshape(self.ids.shape[1], -1) * factor
                if record:
                    return out
                new = (self._decode(i, acts, got["inputs"][i]) + errors[i]) / factor
                new = new.reshape(tensor.shape).to(tensor.dtype)
                return (new, *out[1:]) if isinstance(out, tuple) else new
            handles.append(module.register_forward_hook(replace))

        def embed(m, a, out):
            out = out.clone()
            out[:, list(zero_tokens)] = 0
            return out
        handles.append(self.hf.get_input_embeddings().register_forward_hook(embed))
        handles.append(self.hf.get_output_embeddings().register_forward_hook(
            lambda m, a, o: got.__setitem__("readout", _first(o)[0, -1].double())))
        try:
            with torch.no_grad(), _patched(softmax):
                got["logits"] = self.hf(input_ids=self.ids).logits[0, -1]
        finally:
            for handle in handles:
                handle.remove()
        if not record:
            assert count[0] == len(self.softmaxes), "a softmax of the clean pass was not replayed"
        return got

    def run(self, acts=None, errors=None, zero_tokens=()):
        """Every target's value: the active features' pre-activations (``x @ W_enc``, no bias) and the readout (the
        head's output at the last position, demeaned), with the sources given (the clean ones by default)."""
        got = self._pass(acts=acts or self.acts, errors=errors or self.errors, zero_tokens=zero_tokens)
        return got["inputs"], got["readout"] - got["readout"].mean()


@contextlib.contextmanager
def _patched(softmax):
    saved = torch.nn.functional.softmax, torch.softmax
    torch.nn.functional.softmax = torch.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax, torch.softmax = saved


def _targets(replacement, graph, inputs, readout):
    """The graph's target values from a pass: features' pre-activations, then logits."""
    features = [float(inputs[layer][pos] @ replacement.W_enc[layer][:, feature])
                for layer, pos, feature in graph.active_features.tolist()]
    return torch.tensor(features + readout[graph.logit_tokens].tolist(), dtype=torch.float64)


def _build(case, tmp_path, input_hook, dtype=torch.float64, **transcoder_options):
    config_factory, truth, _, _ = CASES[case]
    hf = build_tiny(config_factory(), dtype)
    hf.set_attn_implementation("eager")
    for config in {id(c): c for c in (hf.config, *(m.config for m in hf.modules() if hasattr(m, "config")))}.values():
        config._attn_implementation = "eager"  # a model that reads it at run time (Falcon) and refuses to set it
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    folder = write_random_transcoders(tmp_path / "tc", model.num_layers, model.hidden_size, D_TC,
                                      feature_input_hook=input_hook, feature_output_hook="hook_mlp_out",
                                      dtype=dtype, **transcoder_options)
    truth = truth if callable(truth) else (lambda i, truth=truth: truth)
    return model, hf, truth, folder


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_the_graph_is_the_frozen_replacements_direct_effects(case, tmp_path):
    _check(case, tmp_path, jumprelu=case == "llama", skip=case == "gemma2")


def test_a_cross_layer_transcoders_features_write_to_every_later_layer(tmp_path):
    graph = _check("llama", tmp_path, cross_layer=True, jumprelu=True)
    assert graph.cfg["cross_layer"]
    n_feat = len(graph.selected_features)
    layers = graph.active_features[:, 0]
    # a layer-0 feature's edges to the features of layer 2 go through what it writes to layer 1 and to layer 2
    assert graph.adjacency_matrix[:n_feat][layers == 2][:, :n_feat][:, layers == 0].abs().sum() > 0


def _check(case, tmp_path, widen=None, **options):
    """The graph of ``case`` against the frozen replacement built here; returns the graph. ``widen``: the layers
    whose transcoder is replaced by one of 24 features (the others have ``D_TC``)."""
    input_hook = FAMILY_CASES[case]
    dtype = torch.float32 if case in FLOAT32 else torch.float64
    model, hf, truth, folder = _build(case, tmp_path, input_hook, dtype, **options)
    if widen:
        wide = write_random_transcoders(tmp_path / "wide", model.num_layers, model.hidden_size, 24, seed=1,
                                        feature_input_hook=input_hook, dtype=dtype, **options)
        for layer in widen:
            (wide / f"layer_{layer}.safetensors").replace(folder / f"layer_{layer}.safetensors")
    graph = attribution_graph(model, PROMPT, load_transcoders(folder), batch_size=64)
    ids = graph.input_tokens[None]
    assert ids[0, 0] == model.tokenizer.bos_token_id and ids.shape[1] == len(PROMPT.split()) + 1
    replacement = Replacement(hf, model.layers._module, truth, folder, ids, INPUT_VALUE[input_hook])
    # the replacement's logits are the model's (eager attention), bit for bit
    with torch.no_grad():
        plain = hf(input_ids=ids).logits[0, -1]
    if dtype == torch.float64:
        assert torch.equal(graph.replacement_logits.double(), plain.float().double()), case
    else:  # the experts' grouped products sum in another order over 64 copies of the prompt than over one
        torch.testing.assert_close(graph.replacement_logits, plain, rtol=1e-5, atol=1e-6)
    # the active features and their activations
    # the active features and their activations (each layer's: the layers' transcoders may differ in width)
    active = torch.cat([torch.cat([torch.full((len(a.nonzero()), 1), layer), a.nonzero()], 1)
                        for layer, a in enumerate(replacement.acts)])
    assert torch.equal(graph.active_features, active), case
    values = torch.cat([a[tuple(a.nonzero().T)].float().double() for a in replacement.acts])
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(graph.activation_values.double(), values, **tolerance)
    # completeness: each target's row plus its value with every source removed is its value
    n_feat, n_layers, n_pos = len(graph.selected_features), model.num_layers, ids.shape[1]
    sources = n_feat + n_layers * n_pos + n_pos
    target_rows = torch.cat([torch.arange(n_feat), torch.arange(sources, sources + len(graph.logit_tokens))])
    rows = graph.adjacency_matrix[target_rows].double()
    full = _targets(replacement, graph, *replacement.run())
    zero_acts = [torch.zeros_like(a) for a in replacement.acts]
    zero_errors = [e.clone() for e in replacement.errors]
    for e in zero_errors:
        e[1:] = 0  # position 0's remainder is no node: a constant of the pass
    empty = _targets(replacement, graph, *replacement.run(zero_acts, zero_errors, range(n_pos)))
    scale = full.abs().max()
    torch.testing.assert_close(rows.sum(1) + empty, full, rtol=0, atol=1e-5 * scale)
    # columns: removing one source changes every target by its edges (a feature, an error node, a token)
    # (sources at layer 0, before the last position: their effects reach later layers and positions)
    first = int(((graph.active_features[:, 0] == 0) & (graph.active_features[:, 1] < n_pos - 1)).nonzero()[-1])
    layer, pos, feature = graph.active_features[first].tolist()
    removed = [a.clone() for a in replacement.acts]
    removed[layer][pos, feature] = 0
    columns = {first: replacement.run(acts=removed)}
    errors = [e.clone() for e in replacement.errors]
    errors[0][n_pos - 2] = 0
    columns[n_feat + n_pos - 2] = replacement.run(errors=errors)
    for p in (0, n_pos - 1):
        columns[n_feat + n_layers * n_pos + p] = replacement.run(zero_tokens=[p])
    for column, run in columns.items():
        change = full - _targets(replacement, graph, *run)
        torch.testing.assert_close(rows[:, column], change, rtol=0, atol=1e-5 * scale)
        assert change.abs().max() > 1e-6 * scale  # an effect to check
    return graph


REFUSALS = {"doge": "Doge: .*identity", "mamba": "mlp_input at layer 0, which Mamba does not have",
            "gemma4_dense": "Gemma-4.*identity", "xglm": "XGLM: its attention patterns cannot be read to be frozen",
            "jetmoe": "JetMoE: .*not linear in the stream"}  # its experts' gates weigh the attention's slots


@pytest.mark.parametrize("case", REFUSALS)
def test_families_without_an_exact_replacement_are_refused(case, tmp_path):
    from nnterp.families import BY_MODEL_TYPE

    model_type = {"gemma4_dense": "gemma4_text"}.get(case, case)
    hf = build_tiny(BY_MODEL_TYPE[model_type].tiny_config())
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    folder = write_random_transcoders(tmp_path / "tc", model.num_layers, model.hidden_size, D_TC)
    with pytest.raises((GraphUnavailable, TranscoderError), match=REFUSALS[case]):
        attribution_graph(model, PROMPT, load_transcoders(folder))


def test_transcoders_whose_sites_do_not_fit_are_refused(tmp_path):
    model, _, _, _ = _build("olmo2", tmp_path, "mlp.hook_in")
    folder = write_random_transcoders(tmp_path / "norm", model.num_layers, model.hidden_size, D_TC,
                                      feature_input_hook="blocks.0.ln2.hook_normalized")
    with pytest.raises(TranscoderError, match="mlp_norm_output at layer 0"):
        attribution_graph(model, PROMPT, load_transcoders(folder))
    folder = write_random_transcoders(tmp_path / "attn", model.num_layers, model.hidden_size, D_TC,
                                      feature_input_hook="hook_resid_pre")
    with pytest.raises(TranscoderError, match="feature_input_hook 'hook_resid_pre' means layer_input"):
        load_transcoders(folder)


def _influence(adjacency, weights):
    """Influence by the closed form: ``w @ (I - M)^-1 - w`` with M the row-normalized absolute adjacency."""
    absolute = adjacency.double().abs()
    matrix = absolute / absolute.sum(1, keepdim=True).clamp(min=1e-10)
    return weights.double() @ torch.linalg.inv(torch.eye(len(matrix), dtype=torch.float64) - matrix) - weights.double()


def test_pruning_keeps_the_logits_and_the_most_influential_nodes_and_the_json_is_circuit_tracers(tmp_path):
    model, _, _, folder = _build("llama", tmp_path, "ln2.hook_normalized")
    graph = attribution_graph(model, PROMPT, load_transcoders(folder), batch_size=64)
    n_feat, n_logits, n_pos = len(graph.selected_features), len(graph.logit_tokens), graph.n_pos
    weights = torch.zeros(len(graph.adjacency_matrix))
    weights[-n_logits:] = graph.logit_probabilities
    influence = _influence(graph.adjacency_matrix, weights)
    node_mask, edge_mask, cumulative = prune_graph(graph, node_threshold=0.5, edge_threshold=0.9)
    assert node_mask[-n_logits - n_pos:].all()  # tokens and logits kept
    kept = node_mask[:n_feat]
    assert 0 < kept.sum() < n_feat
    order = torch.argsort(influence, descending=True)
    covered = torch.cumsum(influence[order], 0) / influence.sum()
    top = order[: int((covered < 0.5).sum()) + 1]  # the fewest nodes covering half of all the nodes' influence
    # every kept feature is among them (the edge pass only removes), the most influential feature is kept
    assert set(torch.nonzero(kept).flatten().tolist()) <= set(top.tolist())
    assert kept[torch.argmax(influence[:n_feat])]
    kept_edges = edge_mask & node_mask[:, None] & node_mask[None]
    assert kept_edges[:n_feat][kept].any(1).all()  # every kept feature has an incoming edge
    torch.testing.assert_close(cumulative.max(), torch.tensor(1.0))
    # the JSON
    file = graph.to_json(tmp_path / "graphs", slug="cat", tokenizer=model.tokenizer)
    document = json.loads(file.read_text())
    assert set(document) == {"metadata", "qParams", "nodes", "links"}
    assert document["metadata"]["slug"] == "cat" and document["metadata"]["prompt"] == "<eos> " + PROMPT
    ids = {node["node_id"]: node for node in document["nodes"]}
    n_layers = model.num_layers
    for k, token in enumerate(graph.logit_tokens.tolist()):
        node = ids[f"{n_layers + 1}_{token}_{n_pos - 1}"]
        assert node["feature_type"] == "logit" and node["is_target_logit"] == (k == 0)
    for pos, token in enumerate(graph.input_tokens.tolist()):
        assert ids[f"E_{token}_{pos}"]["feature_type"] == "embedding"
    features = [n for n in document["nodes"] if n["feature_type"] == "cross layer transcoder"]
    def cantor(x, y):
        return (x + y) * (x + y + 1) // 2 + y
    assert features and all(n["node_id"] == f"{n['layer']}_{n['node_id'].split('_')[1]}_{n['ctx_idx']}" and
                            n["feature"] == cantor(int(n["layer"]), int(n["node_id"].split("_")[1])) for n in features)
    # each node's place in the matrix, from its fields alone
    selected = {tuple(graph.active_features[a].tolist()): k for k, a in enumerate(graph.selected_features.tolist())}

    def place(node):
        layer, pos = node["layer"], node["ctx_idx"]
        if node["feature_type"] == "cross layer transcoder":
            return selected[(int(layer), pos, int(node["node_id"].split("_")[1]))]
        if node["feature_type"] == "mlp reconstruction error":
            return n_feat + int(layer) * n_pos + pos
        if node["feature_type"] == "embedding":
            return n_feat + n_layers * n_pos + pos
        return n_feat + n_layers * n_pos + n_pos + graph.logit_tokens.tolist().index(node["feature"])

    # the ids are distinct, where circuit-tracer 0.5.0's error ids "0_{layer}_{pos}" are those of layer 0's
    # features numbered below n_layers: this graph has such a feature among its nodes, and the frontend keys nodes
    # and links by id alone
    assert any(layer == 0 and feature < n_layers
               for layer, _, feature in graph.active_features[graph.selected_features].tolist())
    ordered = graph.node_ids()
    assert len(set(ordered)) == len(ordered)
    places = {node["node_id"]: place(node) for node in document["nodes"]}
    assert len(places) == len(document["nodes"])
    assert all(ordered[k] == node_id for node_id, k in places.items())
    assert all(node["node_id"] == f"err_{node['layer']}_{node['ctx_idx']}" for node in document["nodes"]
               if node["feature_type"] == "mlp reconstruction error")
    json_edges = prune_graph(graph).edge_mask  # to_json prunes at circuit-tracer's defaults, 0.8 and 0.98
    assert document["links"]
    for link in document["links"]:
        target, source = places[link["target"]], places[link["source"]]
        assert json_edges[target, source], link
        assert link["weight"] == pytest.approx(float(graph.adjacency_matrix[target, source]))
    metadata = json.loads((tmp_path / "graphs" / "graph-metadata.json").read_text())
    assert [g["slug"] for g in metadata["graphs"]] == ["cat"]


def test_per_layer_transcoders_of_different_widths(tmp_path):
    graph = _check("llama", tmp_path, widen=[1], jumprelu=True)
    assert graph.cfg["d_transcoder"] == [D_TC, 24, D_TC]
    assert (graph.active_features[graph.active_features[:, 0] == 1, 2] >= D_TC).any()  # the wider layer's features


def test_a_layers_tensors_of_different_widths_are_refused(tmp_path):
    model, _, _, folder = _build("llama", tmp_path, "mlp.hook_in")
    transcoders = load_transcoders(folder)
    transcoders.b_enc[1] = transcoders.b_enc[1][:-1]
    with pytest.raises(TranscoderError, match=f"Layer 1's transcoder has {D_TC} features in W_enc and {D_TC - 1} in "
                                              "b_enc"):
        attribution_graph(model, PROMPT, transcoders)


def test_the_graph_under_no_grad_is_the_same_graph(tmp_path):
    model, _, _, folder = _build("llama", tmp_path, "mlp.hook_in")
    transcoders = load_transcoders(folder)
    graph = attribution_graph(model, PROMPT, transcoders, batch_size=16)
    with torch.no_grad():
        quiet = attribution_graph(model, PROMPT, transcoders, batch_size=16)
        assert not torch.is_grad_enabled()
    assert torch.equal(quiet.adjacency_matrix, graph.adjacency_matrix)
    assert graph.adjacency_matrix[-len(graph.logit_tokens):].abs().sum() > 0  # the logits' rows are there


def test_the_pass_keeps_no_logits_of_positions_before_the_last(tmp_path):
    from nnterp.graphs import replacement_pass

    model, hf, _, folder = _build("gemma2", tmp_path, "ln2.hook_normalized")
    ids = torch.tensor([2, 3, 5, 7, 8, 3])
    run = replacement_pass(model, ids, load_transcoders(folder), batch=4)
    vocab, size = hf.config.vocab_size, torch.finfo(torch.float64).bits // 8
    # the readout is the last position's [batch, vocab], the logits one copy's [1, vocab]: neither a view of the
    # [batch, seq, vocab] logits, whose memory would stay held as long as the pass
    assert run.readout.shape == (4, vocab) and run.readout.untyped_storage().nbytes() == 4 * vocab * size
    assert run.logits.shape == (1, vocab) and run.logits.untyped_storage().nbytes() == vocab * size
    with torch.no_grad():
        plain = hf(input_ids=ids[None]).logits[0, -1]
    assert torch.equal(run.logits[0], plain)  # Gemma-2's soft-capped logits, as the model gives them


def _visit_order(adjacency, weights, n_feat, n_logits, keep, batch, refresh=4):
    """circuit-tracer's order of visit, from the full graph: the logits' rows first, then, every ``refresh`` batches,
    the unvisited features ranked by their influence through the rows visited so far (the closed form on the square
    matrix whose other rows are zero)."""
    visited = list(range(len(adjacency) - n_logits, len(adjacency)))
    while len(visited) - n_logits < keep:
        partial = torch.zeros_like(adjacency)
        partial[visited] = adjacency[visited]
        ranking = torch.argsort(_influence(partial, weights)[:n_feat], descending=True).tolist()
        pending = [k for k in ranking if k not in visited][:min(refresh * batch, keep + n_logits - len(visited))]
        visited += pending
    return torch.tensor(sorted(visited[n_logits:]))


def test_max_feature_nodes_visits_the_features_in_order_of_influence_and_computes_their_rows_alone(tmp_path,
                                                                                                   monkeypatch):
    from nnterp.graphs import rows

    model, _, _, folder = _build("gpt2", tmp_path, "ln2.hook_normalized")
    transcoders = load_transcoders(folder)
    full = attribution_graph(model, PROMPT, transcoders, batch_size=64)
    n_feat, n_logits = len(full.selected_features), len(full.logit_tokens)
    weights = torch.zeros(len(full.adjacency_matrix))
    weights[-n_logits:] = full.logit_probabilities
    # batches of 2: a first ranking by the logits' rows picks 8 features, a second by those rows too picks 4 more
    expected = _visit_order(full.adjacency_matrix, weights, n_feat, n_logits, 12, batch=2)
    computed = []
    features = rows.Rows.features
    monkeypatch.setattr(rows.Rows, "features", lambda self, indices: computed.append(indices) or features(self, indices))
    graph = attribution_graph(model, PROMPT, transcoders, batch_size=2, max_feature_nodes=12)
    assert torch.equal(graph.active_features, full.active_features)
    assert torch.equal(graph.selected_features, expected)
    # the features kept are not the 12 of most influence on the whole graph: the visit order is its own
    top = torch.sort(torch.topk(_influence(full.adjacency_matrix, weights)[:n_feat], 12).indices).values
    assert not torch.equal(top, expected)
    assert sorted(torch.cat(computed).tolist()) == expected.tolist()  # only the kept features' rows are computed
    keep = torch.cat([expected, torch.arange(n_feat, len(full.adjacency_matrix))])
    torch.testing.assert_close(graph.adjacency_matrix, full.adjacency_matrix[keep][:, keep])
    # every feature kept: the graph of every row, whatever the batch
    every = attribution_graph(model, PROMPT, transcoders, batch_size=7, max_feature_nodes=n_feat)
    torch.testing.assert_close(every.adjacency_matrix, full.adjacency_matrix)
    assert torch.equal(every.selected_features, torch.arange(n_feat))


def test_the_model_is_left_as_it_was(tmp_path):
    hf = build_tiny(CASES["llama"][0]())  # its own attention implementation (sdpa), not eager
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    folder = write_random_transcoders(tmp_path / "tc", model.num_layers, model.hidden_size, D_TC,
                                      feature_input_hook="ln2.hook_normalized", feature_output_hook="hook_mlp_out",
                                      skip=True)
    hf.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    flags = [p.requires_grad for p in hf.parameters()]
    implementation = hf.config._attn_implementation
    assert implementation != "eager"
    with torch.no_grad():
        before = hf(input_ids=torch.tensor([[2, 3, 4, 5]])).logits
    attribution_graph(model, PROMPT, load_transcoders(folder), batch_size=8)
    assert [p.requires_grad for p in hf.parameters()] == flags
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in hf.modules())
    assert hf.config._attn_implementation == implementation
    assert not getattr(model, "_nnterp_attention_on", False)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=torch.tensor([[2, 3, 4, 5]])).logits, before)


def test_transcoder_folders_that_cannot_be_read_say_why(tmp_path):
    with pytest.raises(TranscoderError, match="no config.yaml"):
        load_transcoders(tmp_path)
    folder = write_random_transcoders(tmp_path / "two", 2, 64, D_TC)
    (folder / "layer_1.safetensors").rename(folder / "layer_5.safetensors")
    with pytest.raises(TranscoderError, match=r"not layer_0 \.\.\. layer_\(L-1\)"):
        load_transcoders(folder)
    model, _, _, _ = _build("llama", tmp_path, "mlp.hook_in")
    folder = write_random_transcoders(tmp_path / "short", model.num_layers - 1, model.hidden_size, D_TC)
    with pytest.raises(TranscoderError, match=f"cover {model.num_layers - 1} layers; the model has {model.num_layers}"):
        attribution_graph(model, PROMPT, load_transcoders(folder))
    folder = write_random_transcoders(tmp_path / "narrow", model.num_layers, model.hidden_size // 2, D_TC)
    with pytest.raises(TranscoderError, match="Layer 0's transcoder reads vectors of 32"):
        attribution_graph(model, PROMPT, load_transcoders(folder))


def test_a_nonlinearity_left_in_the_replacement_is_refused(tmp_path):
    """A norm nnterp does not recognize as one (its class named otherwise) keeps its scale's gradient: the pass is
    not linear in the stream, and the graph is refused rather than wrong."""
    model, hf, _, folder = _build("llama", tmp_path, "mlp.hook_in")
    final = hf.model.norm
    final.__class__ = type("Scaler", (type(final),), {})
    with pytest.raises(GraphUnavailable, match="not linear in the stream"):
        attribution_graph(model, PROMPT, load_transcoders(folder), batch_size=8)
