"""``python -m nnterp demo``: the residual stream and a logit lens on the embedded model, offline."""

from __future__ import annotations

import argparse
import os
import time


def demo(model_path: str | None, prompt: str, target: str, layer: int) -> None:
    import torch

    from . import StandardizedTransformer
    from .embedded import NAME, load_embedded
    from .lens import logit_lens, top_tokens

    start = time.perf_counter()
    model = StandardizedTransformer(model_path) if model_path else load_embedded()
    print(f"Loaded {model_path or NAME} ({model.family.name}, {model.num_layers} layers, "
          f"hidden {model.hidden_size}) in {time.perf_counter() - start:.1f} s\n")

    print(f"The residual stream of block {layer}, for {prompt!r}:")
    with torch.no_grad(), model.trace(prompt):
        x = model.layers[layer].layer_input.save()
        attn = model.layers[layer].self_attn.attention_output.save()
        mlp = model.layers[layer].mlp.mlp_output.save()
        out = model.layers[layer].layer_output.save()
    print("  shapes:", x.shape, attn.shape, mlp.shape, out.shape)
    print("  layer_input + attention_output + mlp_output == layer_output:", torch.equal(x + attn + mlp, out))
    print(f"  order({layer}):", model.order(layer), "\n")

    target_id = model.tokenizer.encode(target, add_special_tokens=False)[0]
    probs = logit_lens(model, prompt)[0]
    tops = top_tokens(model, probs.unsqueeze(0), k=3)[0]
    print(f"Logit lens for {prompt!r}: each block's layer_output through the final norm and head")
    print(f"  {'layer':>5}  {'P(' + repr(target) + ')':>12}  {'rank':>6}  top-3")
    for i, (p, top) in enumerate(zip(probs, tops)):
        rank = int((p > p[target_id]).sum()) + 1
        shown = ", ".join(f"{tok!r} {q:.2f}" for tok, q in top)
        print(f"  {i:>5}  {float(p[target_id]):>12.4f}  {rank:>6}  {shown}")
    print(f"\nDone in {time.perf_counter() - start:.1f} s.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nnterp")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("demo", help="the residual stream and a logit lens, offline, on the embedded model")
    run.add_argument("--model", help="a local model folder (default: the embedded SmolLM2-135M-Instruct)")
    run.add_argument("--prompt", default="The Eiffel Tower is in the city of")
    run.add_argument("--target", default=" Paris")
    run.add_argument("--layer", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    demo(args.model, args.prompt, args.target, args.layer)


if __name__ == "__main__":
    main()
