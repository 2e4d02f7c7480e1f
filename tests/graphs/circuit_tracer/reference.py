"""circuit-tracer 0.5.0's attribution graph of a tiny model, for tests/graphs/test_circuit_tracer.py.

Runs in circuit-tracer's own venv (tests/graphs/circuit_tracer/setup.sh): ``python reference.py FOLDER FAMILY``.
Builds the tiny model (random weights moved off 0 and 1) and its word-level tokenizer, saves them to
``FOLDER/model`` (transformers 4.57's files, which transformers 5 reads to identical logits), reads the transcoders
the test wrote to ``FOLDER/tc`` with circuit-tracer's own loader, and saves its graph's tensors to ``FOLDER/graph.pt``,
its pruning's masks to ``FOLDER/pruned.pt``, its graph files to ``FOLDER/json``, and the graph of 40 features visited
in batches of 8 (``max_feature_nodes``) to ``FOLDER/capped.pt``.
"""

import sys
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, PreTrainedTokenizerFast

PROMPT = "the cat sat on the mat in Paris"
WORDS = "the a cat dog sat on mat Eiffel Tower is in city of Paris Rome".split()
CONFIGS = {
    "llama": lambda: LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, bos_token_id=2, eos_token_id=2,
                                 pad_token_id=1),
    "gemma2": lambda: Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=2,
                                   eos_token_id=2, pad_token_id=1, sliding_window=4),
}


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    while len(vocab) < 128:
        vocab[f"tok{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<eos>")


def main(folder: Path, family: str) -> None:
    from circuit_tracer import ReplacementModel, attribute
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    torch.manual_seed(0)
    config = CONFIGS[family]()
    hf = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    hf.save_pretrained(folder / "model")
    tokenizer().save_pretrained(folder / "model")
    settings = yaml.safe_load((folder / "tc" / "config.yaml").read_text())
    paths = {i: str(folder / "tc" / f"layer_{i}.safetensors") for i in range(config.num_hidden_layers)}
    transcoders = load_transcoder_set(paths, scan=settings["scan"], feature_input_hook=settings["feature_input_hook"],
                                      feature_output_hook=settings["feature_output_hook"], device=torch.device("cpu"),
                                      lazy_encoder=False, lazy_decoder=False)
    model = ReplacementModel.from_pretrained_and_transcoders(str(folder / "model"), transcoders, backend="nnsight",
                                                             device=torch.device("cpu"))
    graph = attribute(PROMPT, model, max_n_logits=5, desired_logit_prob=0.95, batch_size=64)
    # its order of visit: batches of 8, re-ranked every 4 batches, until 40 features are visited
    capped = attribute(PROMPT, model, max_n_logits=5, desired_logit_prob=0.95, batch_size=8, max_feature_nodes=40)
    torch.save({"selected_features": capped.selected_features, "adjacency_matrix": capped.adjacency_matrix},
               folder / "capped.pt")
    from circuit_tracer.graph import prune_graph
    from circuit_tracer.utils.create_graph_files import create_graph_files

    pruned = prune_graph(graph, node_threshold=0.8, edge_threshold=0.98)
    create_graph_files(graph, slug="reference", output_path=str(folder / "json"), node_threshold=0.8,
                       edge_threshold=0.98)
    torch.save({"node_mask": pruned.node_mask, "edge_mask": pruned.edge_mask,
                "cumulative_scores": pruned.cumulative_scores}, folder / "pruned.pt")
    torch.save({"input_tokens": graph.input_tokens, "active_features": graph.active_features,
                "activation_values": graph.activation_values, "selected_features": graph.selected_features,
                "adjacency_matrix": graph.adjacency_matrix, "logit_tokens": graph.logit_token_ids,
                "logit_probabilities": graph.logit_probabilities}, folder / "graph.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
