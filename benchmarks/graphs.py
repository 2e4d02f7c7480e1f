"""Benchmark: nnterp's ``attribution_graph`` as a ratio to circuit-tracer 0.5.0's ``attribute``, and how its cost grows.

The model is the tiny Llama of ``tests/graphs/circuit_tracer/reference.py`` (3 layers, 64 wide, vocab 128, random
weights moved off 0 and 1, its word-level tokenizer), built and saved by circuit-tracer's venv as the reference
does; the transcoders are ``write_random_transcoders``'s (JumpReLU, reading ``hook_resid_mid``, writing
``mlp.hook_out``: circuit-tracer's Llama hooks), read by each library's own loader. Each measurement runs in a
subprocess of its own (circuit-tracer's in ``.circuit-tracer-venv``): the median wall time of ``--rounds`` graphs
after one uncounted one, and the peak resident memory the graphs added (``resource.getrusage``'s maxrss after them,
less the resident memory before the first). CPU, one thread, ``batch_size`` 256 on both sides.
First the graph with every feature kept (9 and 16 tokens), then the graphs of real prompts' size: 16 tokens,
``d_transcoder`` 512 to 4096 (about 10,000 to 80,000 active features), ``max_feature_nodes=2048`` on both sides
(their features visited in circuit-tracer's order), and nnterp's graph with every feature kept where its square
adjacency fits (up to about 30,000 features: 3.7 GB). Then nnterp's alone: the prompt's length (8 to 64 tokens, 64 features a layer) and the transcoders' width
(``d_transcoder`` 64 to 1024, 16 tokens). Without circuit-tracer's venv (``tests/graphs/circuit_tracer/setup.sh``)
the comparison is left out.
Usage: ``python benchmarks/graphs.py [--rounds 2]`` (the large graphs are measured over one round).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "tests" / "graphs" / "circuit_tracer"
CIRCUIT_TRACER = Path(os.environ.get("CIRCUIT_TRACER_VENV", ROOT / ".circuit-tracer-venv")) / "bin" / "python"
HOOKS = {"feature_input_hook": "hook_resid_mid", "feature_output_hook": "mlp.hook_out"}
BATCH = 256
CAP = 2048  # max_feature_nodes of the large graphs


def prompt_of(n_tokens: int) -> str:
    """``n_tokens - 1`` words of the reference's tokenizer (one token each); the BOS makes ``n_tokens``."""
    sys.path.insert(0, str(REFERENCE))
    from reference import WORDS

    return " ".join((WORDS * (n_tokens // len(WORDS) + 1))[:n_tokens - 1])


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _measure(graph, rounds: int) -> dict:
    """The median time of ``rounds`` calls after one uncounted call, the peak memory they added, the last graph's
    number of active features (each graph let go before the next is built: one at a time in memory)."""
    import statistics

    before = _rss_mb()
    features = len(graph().active_features)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        features = len(graph().active_features)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux
    return {"seconds": statistics.median(times), "peak_mb": max(0.0, peak - before), "features": features}


def build_model(folder: Path) -> None:
    """The reference's tiny Llama and tokenizer, saved to ``folder / "model"`` (its seed and perturbation)."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REFERENCE))
    from reference import CONFIGS, tokenizer

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    hf.save_pretrained(folder / "model")
    tokenizer().save_pretrained(folder / "model")


def child_circuit_tracer(folder: Path, transcoders: Path, n_tokens: int, rounds: int, cap: int | None) -> dict:
    import torch
    import yaml
    from circuit_tracer import ReplacementModel, attribute
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    torch.set_num_threads(1)
    if not (folder / "model").is_dir():
        build_model(folder)
    settings = yaml.safe_load((transcoders / "config.yaml").read_text())
    paths = {i: str(transcoders / f"layer_{i}.safetensors") for i in range(len(list(transcoders.glob("layer_*"))))}
    tc = load_transcoder_set(paths, scan=settings["scan"], feature_input_hook=settings["feature_input_hook"],
                             feature_output_hook=settings["feature_output_hook"], device=torch.device("cpu"),
                             lazy_encoder=False, lazy_decoder=False)
    model = ReplacementModel.from_pretrained_and_transcoders(str(folder / "model"), tc, backend="nnsight",
                                                             device=torch.device("cpu"))
    prompt = prompt_of(n_tokens)
    run = _measure(lambda: attribute(prompt, model, max_n_logits=10, desired_logit_prob=0.95, batch_size=BATCH,
                                     max_feature_nodes=cap), rounds)
    return run


def child_nnterp(folder: Path, transcoders: Path, n_tokens: int, rounds: int, cap: int | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnterp import StandardizedTransformer
    from nnterp.graphs import attribution_graph, load_transcoders

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(folder / "model")
    model = StandardizedTransformer(hf, tokenizer=AutoTokenizer.from_pretrained(folder / "model"))
    tc = load_transcoders(transcoders)
    prompt = prompt_of(n_tokens)
    run = _measure(lambda: attribution_graph(model, prompt, tc, batch_size=BATCH, max_feature_nodes=cap), rounds)
    return run


def measure(side: str, folder: Path, transcoders: Path, n_tokens: int, rounds: int, cap: int | None = None) -> dict:
    python = str(CIRCUIT_TRACER) if side == "circuit-tracer" else sys.executable
    done = subprocess.run([python, __file__, "--child", side, str(folder), str(transcoders), str(n_tokens),
                           str(rounds), str(cap)], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{side}'s measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def transcoders_of(folder: Path, d_transcoder: int) -> Path:
    from nnterp.graphs import write_random_transcoders

    path = folder / f"tc{d_transcoder}"
    if not path.is_dir():
        write_random_transcoders(path, 3, 64, d_transcoder, jumprelu=True, **HOOKS)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=6, metavar=("SIDE", "FOLDER", "TRANSCODERS", "TOKENS", "ROUNDS", "CAP"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, folder, transcoders, n_tokens, rounds, cap = args.child
        child = child_circuit_tracer if side == "circuit-tracer" else child_nnterp
        cap = None if cap == "None" else int(cap)
        print(json.dumps(child(Path(folder), Path(transcoders), int(n_tokens), int(rounds), cap)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        print(f"tiny Llama (3 layers, 64 wide), JumpReLU transcoders, batch_size {BATCH}, CPU, one thread, median of "
              f"{args.rounds} graphs; memory: the peak resident memory the graphs added")
        if CIRCUIT_TRACER.is_file():
            print("\nnnterp / circuit-tracer 0.5.0, the same graph")
            for d_transcoder, n_tokens in ((16, 9), (256, 16)):
                transcoders = transcoders_of(folder, d_transcoder)
                theirs = measure("circuit-tracer", folder, transcoders, n_tokens, args.rounds)
                ours = measure("nnterp", folder, transcoders, n_tokens, args.rounds)
                assert ours["features"] == theirs["features"], (ours, theirs)
                print(f"  d_transcoder {d_transcoder:4}, {n_tokens:2} tokens, {ours['features']:5} features: "
                      f"time {ours['seconds'] / theirs['seconds']:.2f}x ({ours['seconds']:.3f} s vs "
                      f"{theirs['seconds']:.3f} s), peak memory {ours['peak_mb'] / max(theirs['peak_mb'], 1e-9):.2f}x "
                      f"({ours['peak_mb']:.0f} MB vs {theirs['peak_mb']:.0f} MB)")
            print(f"\nthe graphs of real prompts' size: 16 tokens, max_feature_nodes={CAP} (nnterp / circuit-tracer), "
                  "and nnterp's with every feature kept (its time and memory / circuit-tracer's capped graph's)")
            for d_transcoder in (512, 1024, 1536, 2048, 4096):
                transcoders = transcoders_of(folder, d_transcoder)
                theirs = measure("circuit-tracer", folder, transcoders, 16, 1, CAP)
                ours = measure("nnterp", folder, transcoders, 16, 1, CAP)
                assert ours["features"] == theirs["features"], (ours, theirs)
                line = (f"  {ours['features']:6} features (d_transcoder {d_transcoder:4}): capped: time "
                        f"{ours['seconds'] / theirs['seconds']:.2f}x ({ours['seconds']:.2f} s vs {theirs['seconds']:.2f} s), "
                        f"peak memory {ours['peak_mb'] / theirs['peak_mb']:.2f}x ({ours['peak_mb']:.0f} MB vs "
                        f"{theirs['peak_mb']:.0f} MB)")
                if ours["features"] <= 31_000:  # the square adjacency, 4 bytes an entry
                    every = measure("nnterp", folder, transcoders, 16, 1)
                    line += (f"; every feature: time {every['seconds'] / theirs['seconds']:.2f}x "
                             f"({every['seconds']:.2f} s), peak memory {every['peak_mb'] / theirs['peak_mb']:.2f}x "
                             f"({every['peak_mb']:.0f} MB)")
                print(line, flush=True)
        else:
            print(f"\n(no circuit-tracer venv at {CIRCUIT_TRACER.parent.parent}: run tests/graphs/circuit_tracer/"
                  "setup.sh for the comparison)")
            build_model(folder)

        def sweep(title, points):
            print(f"\nnnterp, {title} (ratios to the first)")
            first = None
            for label, d_transcoder, n_tokens in points:
                run = measure("nnterp", folder, transcoders_of(folder, d_transcoder), n_tokens, args.rounds)
                first = first or run
                print(f"  {label:>5}: {run['features']:6} features, time {run['seconds'] / first['seconds']:6.2f}x "
                      f"({run['seconds']:.3f} s), peak memory {run['peak_mb'] / max(first['peak_mb'], 1e-9):6.2f}x "
                      f"({run['peak_mb']:.0f} MB)")

        sweep("the prompt's length in tokens, d_transcoder 64", [(n, 64, n) for n in (8, 16, 32, 64)])
        sweep("d_transcoder, 16 tokens", [(d, d, 16) for d in (64, 128, 256, 512, 1024)])


if __name__ == "__main__":
    main()
