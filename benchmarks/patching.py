"""Benchmark: batched activation patching and attribution patching, as ratios measured in one run.

- activation patching of every (layer, position), and of every (layer, head): one patched run per pass
  (``batch_size=1``, the sequential version) against one pass per layer (``batch_size=None``, the default) and
  passes of up to 64 rows across layers (``batch_size=64``), with the largest difference between their numbers;
- attribution patching (one clean forward, one corrupted forward with gradients and its backward) against one
  forward pass (a no-grad trace reading the logits).

On a 12 x 256 Llama built from its config (GQA: 8 heads, 4 kv heads) with a 9-token prompt, CPU, one thread;
``--embedded``: the embedded SmolLM2-135M (30 layers) and the guide's prompts instead.
Usage: ``python benchmarks/patching.py [--rounds 3] [--embedded]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers as T  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import tiny_tokenizer  # noqa: E402
from timing import timed  # noqa: E402

from nnterp import StandardizedTransformer  # noqa: E402
from nnterp.tools.metrics import logit_difference  # noqa: E402
from nnterp.tools.patching import activation_patching, attribution_patching  # noqa: E402

torch.set_num_threads(1)


def llama_12x256():
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=8,
                           num_key_value_heads=4, vocab_size=128, bos_token_id=2, eos_token_id=2, pad_token_id=1)
    return StandardizedTransformer(T.LlamaForCausalLM(config).eval(), tokenizer=tiny_tokenizer())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--embedded", action="store_true")
    args = parser.parse_args()
    if args.embedded:
        from nnterp.tools.embedded import load_embedded

        model, name = load_embedded(), "embedded SmolLM2-135M"
        clean, corrupted = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"
        correct, incorrect = (model.tokenizer.encode(w, add_special_tokens=False)[0] for w in (" Paris", " Rome"))
    else:
        model, name = llama_12x256(), "Llama 12 x 256"
        clean, corrupted = "the cat sat on the mat in the city", "the dog sat on the mat in the city"
        correct, incorrect = (model.tokenizer.convert_tokens_to_ids(w) for w in ("cat", "dog"))
    metric = logit_difference(correct, incorrect)
    seq = model.tokenizer(clean, return_tensors="pt").input_ids.shape[1]
    print(f"{name}: {model.num_layers} layers, {seq} tokens, {args.rounds} rounds, CPU, one thread")

    for per, pieces in (("position", seq), ("head", model.num_heads)):
        results = {}
        for batch_size in (1, None, 64):
            seconds, results[batch_size] = timed(lambda b=batch_size, per=per: activation_patching(
                model, clean, corrupted, metric, per=per, batch_size=b, progress=False), args.rounds)
            passes = model.num_layers * pieces if batch_size == 1 else (
                model.num_layers if batch_size is None else -(-model.num_layers * pieces // batch_size))
            results[batch_size] = (seconds, results[batch_size], passes)
        sequential, _, passes = results[1]
        print(f"activation patching per {per} ({model.num_layers} x {pieces}): sequential {sequential:.2f} s "
              f"({passes} passes)")
        for batch_size in (None, 64):
            seconds, effects, passes = results[batch_size]
            difference = (effects - results[1][1]).abs().max().item()
            print(f"  batch_size={batch_size}: {seconds:.2f} s ({passes} passes), sequential / batched "
                  f"{sequential / seconds:.1f}x, largest difference from sequential {difference:.2e}")
        print(f"  batch_size=64 and None bit-identical: {torch.equal(results[64][1], results[None][1])}")

    ids = model.tokenizer(corrupted, return_tensors="pt").input_ids

    def one_forward():
        with torch.no_grad(), model.trace(ids):
            logits = model.logits.save()
        return logits

    forward, _ = timed(one_forward, max(args.rounds, 5))
    for per in ("position", "head", "neuron"):
        seconds, _ = timed(lambda p=per: attribution_patching(model, clean, corrupted, metric, per=p), args.rounds)
        print(f"attribution patching per {per}: {seconds * 1000:.1f} ms, {seconds / forward:.2f}x one forward "
              f"({forward * 1000:.1f} ms)")


if __name__ == "__main__":
    main()
