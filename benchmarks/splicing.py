"""Benchmark: one dictionary spliced with ``nnterp.splice``, as a ratio to the same splice done by hand.

A random SAELens dictionary (standard ReLU, ``apply_b_dec_to_input``, 8 x the stream's width) written as
SAELens saves one in a temporary folder and read with ``load_dictionary``, at the ``layer_output`` of the
middle block (``blocks.15.hook_resid_post``). ``nnterp.splice`` in a trace reading the logits, against a
plain PyTorch forward hook on the unwrapped model's block that encodes the output and writes back
``decode(features) + error``; and, for scale, the plain forward and the trace without the splice. On a
Llama of SmolLM2-135M's shape built from its config (30 x 576, 9 heads, 3 kv heads, 49152 tokens; random
weights, token ids), without gradients, CPU, one thread.
Usage: ``python benchmarks/splicing.py [--rounds 3] [--batch 4] [--seq 128]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers as T  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import tiny_tokenizer  # noqa: E402
from timing import timed  # noqa: E402

import nnterp  # noqa: E402
from nnterp import StandardizedTransformer  # noqa: E402

torch.set_num_threads(1)
LAYER = 15


def smollm2_135m_shape():
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                           rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=2,
                           pad_token_id=1)
    return StandardizedTransformer(T.LlamaForCausalLM(config).eval(), tokenizer=tiny_tokenizer())


def saelens_folder(root: Path, d_in: int, d_sae: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """A standard SAELens 6 dictionary as ``save_model`` writes it: cfg.json and sae_weights.safetensors."""
    generator = torch.Generator().manual_seed(0)
    weights = {"W_enc": torch.randn(d_in, d_sae, generator=generator) / d_in ** 0.5,
               "W_dec": torch.randn(d_sae, d_in, generator=generator) / d_sae ** 0.5,
               "b_enc": torch.randn(d_sae, generator=generator) * 0.1,
               "b_dec": torch.randn(d_in, generator=generator) * 0.1}
    cfg = {"d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
           "normalize_activations": "none", "reshape_activations": "none", "architecture": "standard",
           "metadata": {"sae_lens_version": "6.5.1", "model_name": "smollm2-135m-shape", "hook_name":
                        f"blocks.{LAYER}.hook_resid_post", "hook_head_index": None, "context_size": 128}}
    save_file(weights, str(root / "sae_weights.safetensors"))
    (root / "cfg.json").write_text(json.dumps(cfg))
    return root, weights


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    model = smollm2_135m_shape()
    hf = model._module
    ids = torch.randint(3, len(model.tokenizer), (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as folder:
        _, w = saelens_folder(Path(folder), model.hidden_size, 8 * model.hidden_size)
        sae = nnterp.load_dictionary(folder)
    print(f"SmolLM2-135M shape: {model.num_layers} layers, hidden {model.hidden_size}; {sae!r}; batch {args.batch} "
          f"x {args.seq}, {args.rounds} rounds, CPU, one thread, no gradients")

    def by_hand(module, args, output):
        x = output[0] if isinstance(output, tuple) else output
        features = torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
        reconstruction = features @ w["W_dec"] + w["b_dec"]
        new = reconstruction + (x - reconstruction)  # decode(features) + error
        return (new, *output[1:]) if isinstance(output, tuple) else new

    def plain():
        with torch.no_grad():
            return hf(ids).logits

    def hooked():
        handle = hf.model.layers[LAYER].register_forward_hook(by_hand)
        try:
            return plain()
        finally:
            handle.remove()

    def traced(spliced: bool):
        with torch.no_grad(), model.trace(ids):
            if spliced:
                with nnterp.splice(model, sae):
                    pass
            logits = model.logits.save()
        return logits

    forward, truth = timed(plain, args.rounds)
    hand, by_hook = timed(hooked, args.rounds)
    trace, _ = timed(lambda: traced(False), args.rounds)
    spliced, logits = timed(lambda: traced(True), args.rounds)
    print(f"plain forward {forward:.2f} s; trace without a splice {trace:.2f} s ({trace / forward:.2f}x)")
    print(f"encode + decode by hand in a forward hook: {hand:.2f} s ({hand / forward:.2f}x the plain forward)")
    print(f"nnterp.splice: {spliced:.2f} s, {spliced / hand:.2f}x the hook by hand")
    # an unedited splice changes nothing: both are the plain forward's logits (the work timed is the real one)
    print(f"  splice's logits equal the plain forward's: {torch.equal(logits, truth)}; the hook's differ by "
          f"{(by_hook - truth).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
