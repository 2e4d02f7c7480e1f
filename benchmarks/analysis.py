"""Benchmark: the full decomposition and direct logit attribution of a cache, as a ratio to the pass that fills it.

The analysis: ``decompose_resid`` of the stream the final norm reads, its ``logit_attrs`` for a few tokens,
and every layer's heads (``stack_head_results``) with their ``logit_attrs``; against the ``run_with_cache``
(every value) that feeds it. On a GPT-2-small shape built from its config (12 x 768, 12 heads, the 50257-token
vocabulary; random weights, token ids), a batch of 8 x 128, CPU, one thread.
Usage: ``python benchmarks/analysis.py [--rounds 3] [--batch 8] [--seq 128]``.
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

torch.set_num_threads(1)
TOKENS = [5, 17, 42, 99]  # the tokens attributed (ids of the tiny tokenizer's vocabulary)


def gpt2_small():
    torch.manual_seed(0)
    config = T.GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)
    return StandardizedTransformer(T.GPT2LMHeadModel(config).eval(), tokenizer=tiny_tokenizer())


def analysis(cache):
    """The decomposition and the heads, each attributed to each token of ``TOKENS``."""
    stack = cache.decompose_resid()
    by_component = torch.stack([cache.logit_attrs(stack, token) for token in TOKENS])
    heads = cache.stack_head_results()
    by_head = torch.stack([cache.logit_attrs(heads, token, incl_bias=False) for token in TOKENS])
    return stack, by_component, heads, by_head


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    model = gpt2_small()
    ids = torch.randint(3, len(model.tokenizer), (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"GPT-2-small shape: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_heads} heads, "
          f"vocabulary {model.vocab_size}; batch {args.batch} x {args.seq}, {args.rounds} rounds, CPU, one thread")

    cached, (logits, cache) = timed(lambda: model.run_with_cache(ids), args.rounds)
    print(f"run_with_cache (every value): {cached:.2f} s")
    seconds, (stack, by_component, heads, by_head) = timed(lambda: analysis(cache), args.rounds)
    print(f"decompose_resid {list(stack.shape)} + logit_attrs of {len(TOKENS)} tokens, stack_head_results "
          f"{list(heads.shape)} + logit_attrs: {seconds:.2f} s, {seconds / cached:.2f}x run_with_cache")
    parts = {"decompose_resid": lambda: cache.decompose_resid(),
             f"logit_attrs of it, {len(TOKENS)} tokens": lambda: [cache.logit_attrs(stack, t) for t in TOKENS],
             "stack_head_results": lambda: cache.stack_head_results(),
             f"logit_attrs of the heads, {len(TOKENS)} tokens": lambda: [cache.logit_attrs(heads, t, incl_bias=False)
                                                                        for t in TOKENS]}
    print("  of which " + ", ".join(f"{name} {timed(part, 1)[0]:.2f} s" for name, part in parts.items()))
    # the attributions add up to the model's logits (a check that the work timed is the real one)
    truth = logits[..., TOKENS].float().movedim(-1, 0)
    difference = (by_component.sum(1) - truth).abs().max().item()
    print(f"  largest difference of the summed attributions from the logits: {difference:.2e}")


if __name__ == "__main__":
    main()
