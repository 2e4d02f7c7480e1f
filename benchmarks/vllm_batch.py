"""Steered generation of many prompts on vLLM, as tokens/s ratios: ``.vllm-venv/bin/python benchmarks/vllm_batch.py
--prompts 1,8,32`` (the venv tests/vllm/setup.sh makes; vLLM's CPU build here, one in-process engine).

A random-weight Llama shape is saved to a folder and started once. For each number of prompts (32 tokens each, 32
greedy tokens generated), the medians of a few rounds of: (a) the engine's own ``generate`` (no trace), (b) raw
nnsight on the same engine, one invoke per prompt, the vector added in place to the native output of two blocks
every step, (c) ``model.steered_generate(prompts, ...)`` (nnterp: the standard ``layer_output``, the fused stream
read as a sum and handed on), (d) ``nnterp.steered_generate`` on transformers over the same weights, one
left-padded batch, (e) the same steering written in a trace on the standard value (``layer_output[:] += v``: the
fused stream read as a sum and handed on, a copy of the step's slab per request and block). Prints tokens/s and the
ratios tracked: (c)/(b) and (c)/(a) in time. The rounds are interleaved (one of each variant per round), so a change in
the machine's load shifts every variant alike.

Then capture: ``nnterp.collect`` of ``layer_output`` at 4 blocks (every token) of the same prompts on vLLM against
the same on transformers (batches of 32), prompts/s and the ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import nnsight  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from vllm_generation import build  # noqa: E402


def baselines(model, ids: list[list[int]], steps: int, vector: torch.Tensor, layers: list[int]):
    """The engine's own greedy generate of ``ids``, and raw nnsight steering on the same engine (one invoke per
    prompt, the vector added in place to the native output of ``layers`` every step): what nnterp is measured
    against."""
    from vllm import SamplingParams

    def engine():
        model.vllm_entrypoint.generate([{"prompt_token_ids": row} for row in ids],
                                       SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True),
                                       use_tqdm=False)

    def raw_nnsight():
        with torch.no_grad(), model.trace(temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
            for row in ids:
                with tracer.invoke(row):
                    for _step in tracer.iter[0:steps]:
                        for layer in layers:  # vLLM's Llama block returns (mlp_out, residual): their sum
                            model.layers[layer].output[0][:] += vector

    return engine, raw_nnsight


def interleaved(variants: dict, rounds: int) -> dict[str, float]:
    """The median seconds of each variant, one call of each per round after a warm-up of each."""
    import statistics
    import time

    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(rounds):
        for label, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompts", default="1,8,32,128", help="numbers of prompts, comma-separated")
    parser.add_argument("--capture", type=int, default=128, help="prompts collected in the capture comparison (0: none)")
    args = parser.parse_args()

    import nnterp
    from nnterp.vllm import StandardizedVLLM

    folder = tempfile.mkdtemp(prefix="nnterp-vllm-batch-")
    layers, hidden, vocab, n = 6, 256, 128, args.tokens
    build(folder, layers, hidden, vocab)
    model = StandardizedVLLM(folder, dtype="float32", distributed_executor_backend="uni", max_model_len=512,
                             enable_prefix_caching=False)
    on_transformers = nnterp.StandardizedTransformer(folder)
    on_transformers.tokenizer.padding_side = "left"
    vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
    steered = [1, 3]
    generator = torch.Generator().manual_seed(1)
    print(f"vLLM batch benchmark, {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, nnsight {nnsight.__version__}")
    print(f"Llama shape {layers} x {hidden} (random weights): prompts of 32 tokens, {n} greedy tokens each, "
          f"a vector added at {len(steered)} blocks every step, median of {args.rounds}")
    for count in [int(c) for c in args.prompts.split(",")]:
        ids = [torch.randint(3, vocab, (32,), generator=generator).tolist() for _ in range(count)]
        texts = [" ".join(f"w{i}" for i in row) for row in ids]

        engine, raw_nnsight = baselines(model, ids, n, vector, steered)

        def standardized(ids=ids):
            model.steered_generate(ids, steered, vector, max_new_tokens=n)

        def standard_read(ids=ids):  # the generic path: the fused stream read as a sum, edited, handed on
            with torch.no_grad(), model.trace(temperature=0.0, max_tokens=n, ignore_eos=True) as tracer:
                for row in ids:
                    with tracer.invoke(row):
                        for _step in tracer.iter[0:n]:
                            for layer in steered:
                                model.layers[layer].layer_output[:] += vector

        def on_hf(texts=texts):
            nnterp.steered_generate(on_transformers, texts, steered, vector, max_new_tokens=n)

        variants = {"(a) engine": engine, "(b) raw nnsight": raw_nnsight, "(c) nnterp on vLLM": standardized,
                    "(d) nnterp on transformers": on_hf, "(e) layer_output[:] += v in a trace": standard_read}
        seconds = interleaved(variants, args.rounds)
        print(f"{count} prompts:")
        for label, time in seconds.items():
            print(f"  {label:<28} {count * n / time:9.1f} tokens/s")
        a, b, c, d, e = seconds.values()
        print(f"  nnterp on vLLM: x {c / b:.2f} raw nnsight's time, x {c / a:.2f} the engine's, x {c / d:.2f} "
              f"transformers'; the standard read and hand-back (e): x {e / b:.2f} raw nnsight's time")
        sys.stdout.flush()
    if args.capture:
        ids = [torch.randint(3, vocab, (32,), generator=generator).tolist() for _ in range(args.capture)]
        texts = [" ".join(f"w{i}" for i in row) for row in ids]
        blocks = [0, 2, 4, 5]

        def capture(model):
            return lambda: nnterp.collect(model, texts, tempfile.mkdtemp(), values=["layer_output"], layers=blocks,
                                          positions="all", batch_size=32, progress=False)

        seconds = interleaved({"vLLM": capture(model), "transformers": capture(on_transformers)}, args.rounds)
        print(f"capture: collect of layer_output at {len(blocks)} blocks, every token of {args.capture} prompts")
        for label, time in seconds.items():
            print(f"  {label:<28} {args.capture / time:9.1f} prompts/s")
        print(f"  vLLM: x {seconds['vLLM'] / seconds['transformers']:.2f} transformers' time")
    os._exit(0)  # the in-process engine's threads would hold the exit


if __name__ == "__main__":
    main()
