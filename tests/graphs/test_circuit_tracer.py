"""nnterp's attribution graphs against circuit-tracer 0.5.0's own, on the same tiny model and transcoders.

circuit-tracer runs in its own venv (``tests/graphs/circuit_tracer/setup.sh``: it needs transformers 4.57 and
nnsight 0.6), on its nnsight backend: ``reference.py`` builds the model there, saves it, reads the transcoders this
test writes with circuit-tracer's loader, and saves its graph, its graph with ``max_feature_nodes`` (the features it
visits), its pruning and its graph files. Without the venv the test skips, saying how to make it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nnterp import StandardizedTransformer, attribution_graph, load_transcoders, prune_graph
from nnterp.graphs import write_random_transcoders

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("CIRCUIT_TRACER_VENV", ROOT / ".circuit-tracer-venv"))
PROMPT = "the cat sat on the mat in Paris"
# family -> circuit-tracer's hooks for it (its Llama transcoders read hook_resid_mid, its Gemma-2 ones
# ln2.hook_normalized and write after post_feedforward_layernorm) and the transcoders' options
CASES = {"llama": ("hook_resid_mid", "mlp.hook_out", {"jumprelu": True}),
         "gemma2": ("ln2.hook_normalized", "hook_mlp_out", {"jumprelu": True, "skip": True})}


@pytest.fixture(scope="module")
def python():
    executable = VENV / "bin" / "python"
    # the marker is written last: a set-up that stopped half-way leaves a python without circuit-tracer
    if not executable.is_file() or not (VENV / ".nnterp-circuit-tracer-setup").is_file():
        pytest.skip(f"no complete circuit-tracer venv at {VENV}: run tests/graphs/circuit_tracer/setup.sh")
    return executable


@pytest.mark.parametrize("family", CASES)
def test_the_graph_pruning_and_files_are_circuit_tracers(family, python, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    input_hook, output_hook, options = CASES[family]
    write_random_transcoders(tmp_path / "tc", 3, 64, 16, feature_input_hook=input_hook,
                             feature_output_hook=output_hook, **options)
    done = subprocess.run([str(python), str(ROOT / "tests/graphs/circuit_tracer/reference.py"), str(tmp_path), family],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = torch.load(tmp_path / "graph.pt")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    model = StandardizedTransformer(hf, tokenizer=AutoTokenizer.from_pretrained(tmp_path / "model"))
    graph = attribution_graph(model, PROMPT, load_transcoders(tmp_path / "tc"), max_n_logits=5, batch_size=64)
    for name in ("input_tokens", "active_features", "selected_features", "logit_tokens"):
        assert torch.equal(getattr(graph, name), torch.as_tensor(reference[name])), name
    for name in ("activation_values", "logit_probabilities", "adjacency_matrix"):
        theirs = torch.as_tensor(reference[name]).float()
        torch.testing.assert_close(getattr(graph, name), theirs, rtol=0, atol=1e-6 * theirs.abs().max(), msg=name)
    # max_feature_nodes: the features circuit-tracer visits (in batches, in order of influence), and their edges
    capped, theirs = attribution_graph(model, PROMPT, load_transcoders(tmp_path / "tc"), max_n_logits=5,
                                       batch_size=8, max_feature_nodes=40), torch.load(tmp_path / "capped.pt")
    assert len(graph.active_features) > 40 * 2  # well more features active than kept
    assert torch.equal(capped.selected_features, theirs["selected_features"])
    torch.testing.assert_close(capped.adjacency_matrix, theirs["adjacency_matrix"], rtol=0,
                               atol=1e-6 * theirs["adjacency_matrix"].abs().max())
    # pruning, and the graph files
    pruned, theirs = prune_graph(graph), torch.load(tmp_path / "pruned.pt")
    assert torch.equal(pruned.node_mask, theirs["node_mask"])
    torch.testing.assert_close(pruned.cumulative_scores, theirs["cumulative_scores"], rtol=1e-5, atol=1e-6)
    assert torch.equal(pruned.edge_mask, theirs["edge_mask"])
    mine = json.loads(graph.to_json(tmp_path / "mine", slug="reference", tokenizer=model.tokenizer).read_text())
    expected = json.loads((tmp_path / "json" / "reference.json").read_text())
    assert mine["metadata"] == expected["metadata"] and mine["qParams"] == expected["qParams"]
    # circuit-tracer's error ids ("0_{layer}_{pos}") are layer 0's features' ids: nnterp's are "err_{layer}_{pos}"
    for node in expected["nodes"]:
        if node["feature_type"] == "mlp reconstruction error":
            assert node["node_id"] == f"0_{node['layer']}_{node['ctx_idx']}"
            node["node_id"] = f"err_{node['layer']}_{node['ctx_idx']}"
    assert [n["node_id"] for n in mine["nodes"]] == [n["node_id"] for n in expected["nodes"]]
    for ours, their in zip(mine["nodes"], expected["nodes"]):
        assert {k: v for k, v in ours.items() if not isinstance(v, float)} == \
               {k: v for k, v in their.items() if not isinstance(v, float)}
        for key in ("influence", "activation", "token_prob"):
            assert (ours[key] is None) == (their[key] is None) and (
                ours[key] is None or ours[key] == pytest.approx(their[key], rel=1e-4, abs=1e-6)), key
    def theirs(node_id):
        return "0_" + node_id.removeprefix("err_") if node_id.startswith("err_") else node_id

    assert [(theirs(link["source"]), theirs(link["target"])) for link in mine["links"]] == \
           [(link["source"], link["target"]) for link in expected["links"]]
    assert json.loads((tmp_path / "mine" / "graph-metadata.json").read_text()) == \
           json.loads((tmp_path / "json" / "graph-metadata.json").read_text())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
