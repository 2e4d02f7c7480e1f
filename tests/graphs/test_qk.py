"""QK attributions against the model's own scores and the frozen replacement built in plain PyTorch.

Ground truth (``test_attribution_graph.Replacement``): the unwrapped transformers model in eager attention, every
softmax's input recorded (the model's own pre-softmax scores), and the frozen replacement (patterns and norm scales
at their clean values, MLPs as transcoder features plus error) run with sources removed. The terms must sum to the
model's score; the bias x bias term is the score with every source removed; a source's row of terms summed is the
change of the score when its contribution is taken out of the head's query alone (a hook on the attention's input
at the query's position, with the keys' position untouched), and its column the same for the key.

The model's own norms compute their scale in float32 even in a float64 model (Llama's RMSNorm casts), and the
replacement built here recomputes it in float64: the terms' linear pieces (the bias, a source's row) agree with it
to float32 rounding of that scale (``LINEAR``); their sum is the model's own score to float64 rounding.
"""

from __future__ import annotations

import json

import pytest
import torch

from nnterp.graphs import GraphUnavailable, attribution_graph, load_transcoders
from nnterp.graphs.qk import BIAS, QKSummary, qk_attribution, read_qk

from .test_attribution_graph import FAMILY_CASES, FLOAT32, INPUT_VALUE, PROMPT, Replacement, _build

# the scores are a bias by distance (ALiBi) plus query . key: not bilinear in the stream
ALIBI = {"bloom", "mpt"}
SERVED = [case for case in FAMILY_CASES if case not in ALIBI]
LINEAR = 1e-5  # the float32 rounding of the model's own norm scales, against the float64 ones recomputed here
# their attention casts the query and key to float32 before the product, even in a float64 model
FLOAT32_SCORES = {"gptj", "gpt_neo", "codegen"}
ATTENTION = {"llama": "self_attn", "qwen3": "self_attn", "gemma2": "self_attn", "gpt2": "attn"}


def _setup(case, tmp_path, softcap=True, **transcoder_options):
    input_hook = FAMILY_CASES[case]
    dtype = torch.float32 if case in FLOAT32 else torch.float64
    model, hf, truth, folder = _build(case, tmp_path, input_hook, dtype, **transcoder_options)
    if not softcap:  # Gemma-2's scores without their soft-cap: the score is bilinear with nothing frozen in it
        hf.config.attn_logit_softcapping = None
        for module in hf.modules():
            if hasattr(module, "attn_logit_softcapping"):
                module.attn_logit_softcapping = None
    transcoders = load_transcoders(folder)
    ids = attribution_graph(model, PROMPT, transcoders, batch_size=64).input_tokens
    replacement = Replacement(hf, model.layers._module, truth, folder, ids[None], INPUT_VALUE[input_hook])
    return model, hf, transcoders, ids, replacement, dtype


def _empty(replacement, n_pos):
    """The frozen replacement's scores with every source removed: the bias alone."""
    errors = [e.clone() for e in replacement.errors]
    for e in errors:
        e[1:] = 0  # position 0's remainder is no node: a constant of the pass
    return replacement._pass(acts=[torch.zeros_like(a) for a in replacement.acts], errors=errors,
                             zero_tokens=range(n_pos))["scores"]


def _scores(case, model, layer, recorded):
    """Block ``layer``'s scores ``[heads, query, key]`` from the softmaxes' inputs of a pass."""
    scores = recorded[layer][0]
    if case == "gpt_oss":  # its softmax reads [scores, sink] less the row's max: the scores are those plus the shift
        sinks = model.layers._module[layer].self_attn.sinks.detach().to(scores.dtype)
        scores = scores[..., :-1] + (sinks[:, None, None] - scores[..., -1:])
    return scores


@pytest.mark.parametrize("case", SERVED)
def test_the_terms_sum_to_the_models_score(case, tmp_path):
    _check_sum(case, tmp_path)


@pytest.mark.parametrize("options", [dict(cross_layer=True, jumprelu=True), dict(skip=True)], ids=["clt", "skip"])
def test_cross_layer_and_skip_transcoders(options, tmp_path):
    _check_sum("llama", tmp_path, **options)


def _check_sum(case, tmp_path, **options):
    """The terms sum to the model's score, and the bias x bias term is the score with every source removed."""
    model, hf, transcoders, ids, replacement, dtype = _setup(case, tmp_path, **options)
    n_pos, layer = len(ids), model.num_layers - 1
    truth = _scores(case, model, layer, replacement.scores)  # [heads, query, key]: the model's own scores
    head, query = truth.shape[0] - 1, n_pos - 1
    unmasked = [k for k in range(query - 1, -1, -1) if truth[head, query, k] > torch.finfo(dtype).min / 2]
    key = unmasked[min(1, len(unmasked) - 1)] if unmasked else query  # inside a sliding window or chunk
    result = qk_attribution(model, PROMPT, transcoders, layer, head, query, key)
    terms = result.terms()
    assert result.sources[-1] == BIAS and terms.shape == (len(result.sources),) * 2
    tolerance = 2e-5 if dtype == torch.float32 else 2e-7 if case in FLOAT32_SCORES else 1e-9
    scale = float(truth[head, query, [key, *unmasked]].abs().max())  # the row's scores, not its mask's
    assert abs(float(terms.sum()) - float(truth[head, query, key])) <= tolerance * scale, case
    assert result.score == pytest.approx(float(truth[head, query, key]), rel=tolerance, abs=tolerance * scale)
    # the bias x bias term is the score with every source removed (Gemma-2's is the soft-cap's: compared uncapped)
    empty = _scores(case, model, layer, _empty(replacement, n_pos))[head, query, key]
    cap = getattr(hf.config.get_text_config(), "attn_logit_softcapping", None)
    if cap:
        uncapped = cap * torch.atanh(truth[head, query, key] / cap)
        factor = result.factor * float(uncapped / truth[head, query, key])  # the scaling alone
        bias = factor * result.query_vectors[-1] @ result.key_vectors[-1]
        assert float(bias) == pytest.approx(float(cap * torch.atanh(empty / cap)), rel=LINEAR, abs=LINEAR * scale)
    else:
        assert float(terms[-1, -1]) == pytest.approx(float(empty), rel=LINEAR, abs=LINEAR * scale), case
    # the sources carry the score: more than the bias alone
    assert terms[:-1].abs().sum() > 1e-3 * abs(float(terms.sum()))


def _edited_scores(replacement, hf_attention, position, removed_input):
    """The clean frozen replacement's scores with the attention's input at ``position`` set to ``removed_input``."""
    def edit(module, args, kwargs):
        if args:
            x = args[0].clone()
            x[0, position] = removed_input
            return (x, *args[1:]), kwargs
        x = kwargs["hidden_states"].clone()
        x[0, position] = removed_input
        return args, {**kwargs, "hidden_states": x}

    handle = hf_attention.register_forward_pre_hook(edit, with_kwargs=True)
    try:
        return replacement._pass(acts=replacement.acts, errors=replacement.errors)["scores"]
    finally:
        handle.remove()


def _attention_input(replacement, hf_attention, **sources):
    """The attention's input ``[seq, hidden]`` in the frozen replacement with ``sources`` (``acts``,
    ``zero_tokens``) changed."""
    got = {}

    def read(module, args, kwargs):
        got["x"] = (args[0] if args else kwargs["hidden_states"])[0].detach().clone()
    handle = hf_attention.register_forward_pre_hook(read, with_kwargs=True)
    try:
        replacement._pass(acts=sources.get("acts", replacement.acts), errors=replacement.errors,
                          zero_tokens=sources.get("zero_tokens", ()))
    finally:
        handle.remove()
    return got["x"]


@pytest.mark.parametrize("case", list(ATTENTION))
def test_a_sources_terms_are_its_contribution_to_the_query_or_the_key_edited_by_a_hook(case, tmp_path):
    model, hf, transcoders, ids, replacement, dtype = _setup(case, tmp_path, softcap=False)
    n_pos, layer = len(ids), model.num_layers - 1
    attention = getattr(model.layers._module[layer], ATTENTION[case])
    head, query, key = 1, n_pos - 1, n_pos - 3
    result = qk_attribution(model, PROMPT, transcoders, layer, head, query, key)
    terms = result.terms()
    clean = _attention_input(replacement, attention)
    base = replacement.scores[layer][0, head, query, key]
    # the feature with the largest effect through the query, at the query's position or before it
    effects = terms.sum(1)
    features = [i for i, s in enumerate(result.sources) if s.count("_") == 2 and not s.startswith(("E_", "err_"))]
    feature = max(features, key=lambda i: abs(float(effects[i])))
    source_layer, number, pos = map(int, result.sources[feature].split("_"))
    acts = [a.clone() for a in replacement.acts]
    acts[source_layer][pos, number] = 0
    removed = _attention_input(replacement, attention, acts=acts)
    assert not torch.equal(removed[query], clean[query])
    # its contribution taken out of the query alone: the score moves by its row of terms
    change = base - _edited_scores(replacement, attention, query, removed[query])[layer][0, head, query, key]
    assert float(change) == pytest.approx(float(effects[feature]), rel=LINEAR)
    assert abs(float(effects[feature])) > 1e-6 * abs(float(base))
    # a token's contribution taken out of the key alone: the score moves by its column
    token = result.sources.index(f"E_{int(ids[key])}_{key}")
    removed = _attention_input(replacement, attention, zero_tokens=[key])
    change = base - _edited_scores(replacement, attention, key, removed[key])[layer][0, head, query, key]
    assert float(change) == pytest.approx(float(terms[:, token].sum()), rel=LINEAR)
    assert abs(float(change)) > 1e-6 * abs(float(base))
    # and the same token through the query: a source's query and key parts are not the same vector
    assert not torch.allclose(terms[token].sum(), terms[:, token].sum())


@pytest.mark.parametrize("case", sorted(ALIBI))
def test_scores_with_a_bias_by_distance_are_refused(case, tmp_path):
    model, _, _, folder = _build(case, tmp_path, FAMILY_CASES[case])
    with pytest.raises(GraphUnavailable, match="not one scaling times query . key.*ALiBi"):
        qk_attribution(model, PROMPT, load_transcoders(folder), model.num_layers - 1, 0, 5, 2)


def test_positions_heads_and_masked_keys_say_why(tmp_path):
    model, _, _, folder = _build("llama", tmp_path, FAMILY_CASES["llama"])
    transcoders = load_transcoders(folder)
    with pytest.raises(ValueError, match=r"key position \(5\) is at most the query position \(3\)"):
        qk_attribution(model, PROMPT, transcoders, 0, 0, 3, 5)
    with pytest.raises(ValueError, match="head 9 is not a head of block 0"):
        qk_attribution(model, PROMPT, transcoders, 0, 9, 3, 1)
    with pytest.raises(ValueError, match="layer 7 is not a block"):
        qk_attribution(model, PROMPT, transcoders, 7, 0, 3, 1)
    model, _, _, folder = _build("gemma2", tmp_path / "gemma2", FAMILY_CASES["gemma2"])
    assert model._module.config.layer_types[2] == "sliding_attention" and model._module.config.sliding_window < 6
    with pytest.raises(ValueError, match="block 2 masks key 2 at query 8"):  # outside its sliding window
        qk_attribution(model, PROMPT, load_transcoders(folder), 2, 0, 8, 2)


def test_the_summary_is_the_terms_top_and_round_trips_through_the_graph_file(tmp_path):
    model, _, _, folder = _build("gemma2", tmp_path, FAMILY_CASES["gemma2"])
    transcoders = load_transcoders(folder)
    graph = attribution_graph(model, PROMPT, transcoders, batch_size=64)
    results = [qk_attribution(model, graph, transcoders, 1, head, 6, 2) for head in (0, 3)]
    terms = results[0].terms()
    summaries = [r.summary(top=5) for r in results]
    summary = summaries[0]
    # the top pairs are the largest terms, the top sources the largest row and column sums
    largest = torch.topk(terms.abs().flatten(), 5).indices
    assert [(p["query_source"], p["key_source"]) for p in summary.top_pairs] == [
        (results[0].sources[i // len(terms)], results[0].sources[i % len(terms)]) for i in largest.tolist()]
    assert [p["term"] for p in summary.top_pairs] == pytest.approx(terms.flatten()[largest].tolist())
    rows = terms.sum(1)
    assert [s["source"] for s in summary.top_query] == [results[0].sources[i] for i in
                                                        torch.topk(rows.abs(), 5).indices.tolist()]
    assert [s["effect"] for s in summary.top_key] == pytest.approx(
        terms.sum(0)[torch.topk(terms.sum(0).abs(), 5).indices].tolist())
    feature = summary.top_query[0]["source"]
    loading = results[0].loading(feature)
    i = results[0].sources.index(feature)
    assert loading["query_effect"] == pytest.approx(float(rows[i]))
    assert loading["query_norm"] == pytest.approx(float(results[0].query_vectors[i].norm()))
    assert any("soft-cap" in note for note in summary.frozen)  # Gemma-2's cap ratio is frozen, and said so
    # the graph file with the section, read back
    file = graph.to_json(tmp_path / "graphs", slug="cat", tokenizer=model.tokenizer, qk=summaries)
    assert read_qk(file) == summaries
    document = json.loads(file.read_text())
    assert {"metadata", "qParams", "nodes", "links", "qk"} == set(document)
    plain = graph.to_json(tmp_path / "graphs", slug="plain", tokenizer=model.tokenizer)
    assert read_qk(plain) == [] and "qk" not in json.loads(plain.read_text())
    with pytest.raises(ValueError, match="lacks"):
        QKSummary.from_dict({"layer": 1})


def test_the_model_is_left_as_it_was(tmp_path):
    from nnterp import StandardizedTransformer
    from nnterp.graphs import write_random_transcoders

    from ..conftest import build_tiny, tiny_tokenizer
    from ..families.test_families import CASES

    hf = build_tiny(CASES["llama"][0]())  # its own attention implementation (sdpa), not eager
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    folder = write_random_transcoders(tmp_path / "tc", model.num_layers, model.hidden_size, 16,
                                      feature_input_hook="mlp.hook_in", feature_output_hook="hook_mlp_out")
    flags, implementation = [p.requires_grad for p in hf.parameters()], hf.config._attn_implementation
    assert implementation != "eager"
    with torch.no_grad():
        before = hf(input_ids=torch.tensor([[2, 3, 4, 5]])).logits
        result = qk_attribution(model, PROMPT, load_transcoders(folder), 1, 0, 5, 2)
        assert not torch.is_grad_enabled()
    assert result.query_vectors.abs().sum() > 0 and result.terms().sum() == pytest.approx(result.score, rel=1e-5)
    assert [p.requires_grad for p in hf.parameters()] == flags
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in hf.modules())
    assert hf.config._attn_implementation == implementation
    with torch.no_grad():
        assert torch.equal(hf(input_ids=torch.tensor([[2, 3, 4, 5]])).logits, before)
