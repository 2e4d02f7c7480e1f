"""StandardizedVLLM's cost during generation, as tokens/s ratios: ``.vllm-venv/bin/python benchmarks/vllm_generation.py``
(the venv tests/vllm/setup.sh makes; vLLM's CPU build here, one in-process engine).

A random-weight Llama shape is saved to a folder and started once; each variant generates the same greedy tokens
from the same prompt, and the medians of a few rounds are compared with the engine's own ``generate`` (no trace):
a trace that reads nothing, one that saves every block's ``layer_output`` at every step, ``steered_generate``
(an in-place add at two blocks every step), and transformers' own greedy ``generate`` of the same folder.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import nnsight  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "vllm"))
from check_vllm import tokenizer  # noqa: E402  (the tests' offline word-level tokenizer)


def build(folder: str, layers: int, hidden: int, vocab: int):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64,
                                      vocab_size=vocab, max_position_embeddings=512, bos_token_id=2, eos_token_id=2,
                                      pad_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)  # 128 words
    return model


def timed(fn, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    from vllm import SamplingParams

    from nnterp.vllm import StandardizedVLLM

    folder = tempfile.mkdtemp(prefix="nnterp-vllm-bench-")
    layers, hidden, vocab, n = 6, 256, 128, args.tokens
    hf = build(folder, layers, hidden, vocab)
    prompt = list(range(5, 37))  # 32 prompt tokens
    model = StandardizedVLLM(folder, dtype="float32", distributed_executor_backend="uni", max_model_len=512,
                             enable_prefix_caching=False)
    vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0))

    def engine():
        model.vllm_entrypoint.generate([{"prompt_token_ids": prompt}],
                                       SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                       use_tqdm=False)

    def empty_trace():
        with torch.no_grad(), model.trace(prompt, temperature=0.0, max_tokens=n, ignore_eos=True):
            pass

    def every_layer_output():
        with torch.no_grad(), model.trace(prompt, temperature=0.0, max_tokens=n, ignore_eos=True) as tracer:
            kept = nnsight.save([])
            for _step in tracer.iter[0:n]:
                for block in model.layers:
                    kept.append(block.layer_output.clone())

    def steered():
        model.steered_generate(prompt, [1, 3], vector, max_new_tokens=n)

    def transformers_generate():
        with torch.no_grad():
            hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    from nnterp import StandardizedTransformer, steered_generate

    on_transformers = StandardizedTransformer(folder)  # the same weights, transformers' engine
    text = on_transformers.tokenizer.decode(prompt)

    def transformers_steered():
        steered_generate(on_transformers, text, [1, 3], vector, max_new_tokens=n)

    variants = [("(a) vLLM engine, no trace", engine), ("(b) empty trace", empty_trace),
                ("(c) every layer_output, every step", every_layer_output), ("(d) steered_generate, 2 blocks", steered),
                ("(e) transformers generate", transformers_generate),
                ("(f) steered_generate on transformers", transformers_steered)]
    results = {label: timed(fn, args.rounds) for label, fn in variants}
    base = results[variants[0][0]]
    print(f"StandardizedVLLM benchmark, {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, nnsight {nnsight.__version__}")
    print(f"Llama shape {layers} x {hidden} (random weights): prompt 32, {n} greedy tokens, median of {args.rounds}")
    for label, seconds in results.items():
        print(f"  {label:<38} {n / seconds:8.1f} tokens/s   x {seconds / base:5.2f} the time of (a)")
    print(f"  steered generation, vLLM (d) / transformers (f): x {results[variants[3][0]] / results[variants[5][0]]:.2f}"
          " the time")
    sys.stdout.flush()
    os._exit(0)  # the in-process engine's threads would hold the exit


if __name__ == "__main__":
    main()
