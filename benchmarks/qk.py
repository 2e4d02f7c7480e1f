"""Benchmark: one head's QK attribution (``qk_attribution``) against the attribution graph it explains.

On the embedded SmolLM2-135M (30 layers, 9 heads of 64), the graphs page's prompt and random JumpReLU transcoders
(``hook_resid_mid`` to ``hook_mlp_out``) of ``--widths`` features a layer: the wall time of the graph (every feature
kept, ``batch_size`` 64) and of the QK attribution of head 3 of block 20 at the last position attending to position
3, each the median of ``--rounds`` after one uncounted call, on one CPU thread, measured in turn in one process.
Usage: ``python benchmarks/qk.py [--rounds 1] [--widths 2 8]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPT = "The Eiffel Tower is in the city of"


def _median(call, rounds: int) -> float:
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    import torch

    from nnterp.graphs import attribution_graph, load_transcoders, qk_attribution, write_random_transcoders
    from nnterp.tools.embedded import load_embedded

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_embedded()
    print("| features a layer | active features | graph | one head's QK | ratio |")
    print("|---|---|---|---|---|")
    for width in args.widths:
        folder = write_random_transcoders(tempfile.mkdtemp(), model.num_layers, model.hidden_size, width,
                                          jumprelu=True, feature_input_hook="hook_resid_mid",
                                          feature_output_hook="hook_mlp_out")
        transcoders = load_transcoders(folder)
        graph = attribution_graph(model, PROMPT, transcoders, batch_size=64)
        graph_time = _median(lambda t=transcoders: attribution_graph(model, PROMPT, t, batch_size=64), args.rounds)
        qk_time = _median(lambda g=graph, t=transcoders: qk_attribution(model, g, t, 20, 3, g.n_pos - 1, 3),
                          args.rounds)
        print(f"| {width} | {len(graph.active_features)} | {graph_time:.1f} s | {qk_time:.1f} s | "
              f"{qk_time / graph_time:.2f} |", flush=True)


if __name__ == "__main__":
    main()
