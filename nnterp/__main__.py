"""``python -m nnterp demo``: the residual stream and a logit lens on the embedded model, offline."""

from __future__ import annotations

import argparse
import os
import sys
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


def check(model_name: str) -> int:
    """Print where every value of a model is read and whether the spec holds; 0 when it does."""
    import time

    import torch

    from . import StandardizedTransformer
    from .embedded import embedded_model_path
    from .validation import ValidationError, check_identity, validate

    path = str(embedded_model_path()) if model_name == "embedded" else model_name
    model = StandardizedTransformer(path, validate=False)
    hf = model._module
    print(f"{model_name}: {type(hf).__name__}, family {model.family.name}, {model.num_layers} layers, "
          f"hidden {model.hidden_size}, {model.num_heads} heads")
    failed = False
    start = time.perf_counter()
    try:
        validate(hf.config, type(hf), model.tokenizer, use_cache=False)
        print(f"validation on a miniature of the config: passed ({time.perf_counter() - start:.2f} s)")
    except ValidationError as error:
        failed = True
        print(f"validation on a miniature of the config: FAILED\n{error}")

    groups: dict[tuple, list[int]] = {}
    for i in range(model.num_layers):
        block = model.block_spec(i)
        signature = (tuple((k, str(a)) for k, a in model.availability(i).items()), block.formula)
        groups.setdefault(signature, []).append(i)
    for (values, formula), layers in groups.items():
        print(f"\nlayers {_ranges(layers)}:")
        for key, where in values:
            print(f"  {key:28} {where}")
        print(f"  identity: {formula}")

    ids = torch.arange(1, 9).remainder(model.vocab_size).unsqueeze(0)
    results = check_identity(model, ids)
    exact = sum(r.exact for r in results)
    print(f"\nidentity on the model's own weights (8 tokens): {exact}/{len(results)} blocks exact")
    for result in results:
        if not result.exact:
            failed = True
            print(f"  {result}")
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for i in layers:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nnterp")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("demo", help="the residual stream and a logit lens, offline, on the embedded model")
    run.add_argument("--model", help="a local model folder (default: the embedded SmolLM2-135M-Instruct)")
    run.add_argument("--prompt", default="The Eiffel Tower is in the city of")
    run.add_argument("--target", default=" Paris")
    run.add_argument("--layer", type=int, default=5)
    checker = commands.add_parser("check", help="where every value of a model is read, and whether the spec holds")
    checker.add_argument("model", help="a local model folder, a hub name, or 'embedded'")
    args = parser.parse_args(argv)
    if args.command == "check":
        sys.exit(check(args.model))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    demo(args.model, args.prompt, args.target, args.layer)


if __name__ == "__main__":
    main()
