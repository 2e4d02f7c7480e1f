"""``python -m nnterp demo``: the residual stream and a logit lens on the embedded model, offline."""

from __future__ import annotations

import argparse
import os
import sys
import time


def demo(model_path: str | None, prompt: str, target: str, layer: int, plot: str | None) -> None:
    import torch

    from . import StandardizedTransformer
    from .tools.embedded import NAME, load_embedded
    from .tools.lens import _lens_table, logit_lens

    start = time.perf_counter()
    if not model_path:
        _announce_conversion()
    model = StandardizedTransformer(model_path) if model_path else load_embedded()
    print(f"Loaded {model_path or NAME} ({model.family.name}, {model.num_layers} layers, "
          f"hidden {model.hidden_size}) in {time.perf_counter() - start:.1f} s\n")
    model.block_spec(layer)  # a clear error for a layer the model does not have, before any trace

    print(f"The residual stream of block {layer}, for {prompt!r}:")
    with torch.no_grad(), model.trace(prompt):
        x = model.layers[layer].layer_input.save()
        attn = model.layers[layer].self_attn.attention_output.save()
        mlp = model.layers[layer].mlp.mlp_output.save()
        out = model.layers[layer].layer_output.save()
    print("  shapes:", x.shape, attn.shape, mlp.shape, out.shape)
    print("  layer_input + attention_output + mlp_output == layer_output:", torch.equal(x + attn + mlp, out))
    print(f"  order({layer}):", model.order(layer), "\n")

    probs = logit_lens(model, prompt)[0]
    print(f"Logit lens for {prompt!r}: each block's layer_output through the final norm and head")
    print(_lens_table(model, probs, target))
    if plot:
        _write_plot(model, prompt, plot, target)
    print(f"\nDone in {time.perf_counter() - start:.1f} s.")


def _announce_conversion() -> None:
    """Say so before the embedded model's first use converts it (the folder embedded_model_path() looks for)."""
    from .proof.cache import cache_root
    from .tools.embedded import NAME

    folder = cache_root() / NAME
    if not ((folder / "config.json").is_file() and (folder / "model.safetensors").is_file()):
        print(f"First run: converting {NAME} once into {folder}, which takes a minute or two on a 2-core "
              "machine; later runs load it in about a second.")


def _write_plot(model, prompt: str, path: str, target: str | None = None) -> None:
    import importlib.util
    from pathlib import Path

    from .tools.plots import plot_logit_lens

    try:
        written = Path(plot_logit_lens(model, prompt, path, target=target)).resolve()
    except ModuleNotFoundError as error:
        print(f"(no picture: {error})")
        return
    # the full path: the default is a file name, written into the folder the command runs in
    page = f", and its interactive page to {written.with_suffix('.html')}" if importlib.util.find_spec("plotly") else ""
    print(f"Wrote the logit-lens heatmap to {written}{page} (--plot PATH writes it elsewhere, --plot '' not at all)")


def lens(model_name: str, prompt: str, target: str | None, plot: str | None) -> None:
    """Print a prompt's logit-lens table and write its heatmap."""
    from .core.standardized import StandardizedTransformer
    from .tools.embedded import embedded_model_path
    from .tools.lens import _lens_table, logit_lens

    if model_name == "embedded":
        _announce_conversion()
    with _quiet_if(model_name == "embedded"):
        model = StandardizedTransformer(str(embedded_model_path()) if model_name == "embedded" else model_name)
    print(_lens_table(model, logit_lens(model, prompt)[0], target))
    if plot:
        _write_plot(model, prompt, plot, target)


def _quiet_if(embedded: bool):
    """The embedded model loads in a second: no progress bar. A model of the user's keeps transformers' bar."""
    import contextlib

    from .proof.miniature import quiet_transformers

    return quiet_transformers() if embedded else contextlib.nullcontext()


def check(model_name: str) -> int:
    """Print where every value of a model is read and whether the spec holds; 0 when it does."""
    import time

    import torch

    from . import StandardizedTransformer
    from .core.validation import ValidationError, check_identity, validate
    from .spec.selection import layer_ranges
    from .tools.embedded import embedded_model_path

    path = str(embedded_model_path()) if model_name == "embedded" else model_name
    with _quiet_if(model_name == "embedded"):
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
    width = max(len(key) for (values, _) in groups for key, _ in values)
    reasons: list[str] = []  # each reason printed once, below the tables, and referred to by number
    for (values, formula), layers in groups.items():
        print(f"\nlayers {layer_ranges(layers)}:")
        for key, where in values:
            if where.startswith("unavailable: "):
                reason = where.removeprefix("unavailable: ")
                if reason not in reasons:
                    reasons.append(reason)
                where = f"unavailable ({reasons.index(reason) + 1})"
            print(f"  {key:{width}}  {where}")
        print(f"  identity: {formula}")
    if reasons:
        print("\nunavailable because:")
        for number, reason in enumerate(reasons, 1):
            print(f"  ({number}) {reason}")

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nnterp")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("demo", help="the residual stream and a logit lens, offline, on the embedded model")
    run.add_argument("--model", help="a local model folder (default: the embedded SmolLM2-135M-Instruct)")
    run.add_argument("--prompt", default="The Eiffel Tower is in the city of", help="the text to read (default: %(default)r)")
    run.add_argument("--target", default=" Paris",
                     help="a one-token answer whose probability the lens follows, leading space included (default: %(default)r)")
    run.add_argument("--layer", type=int, default=5, help="the block whose residual stream is shown (default: %(default)s)")
    run.add_argument("--plot", default="nnterp-logit-lens.png",
                     help="where to write the heatmap (default: %(default)s in the current folder; '' for none)")
    lensing = commands.add_parser("lens", help="a prompt's logit lens: a table, and a heatmap PNG")
    lensing.add_argument("--model", default="embedded", help="a local model folder, a hub name, or 'embedded'")
    lensing.add_argument("--prompt", required=True, help="the text to read")
    lensing.add_argument("--target", help="a one-token answer to follow, leading space included, e.g. ' Paris'")
    lensing.add_argument("--plot", default="logit_lens.png",
                         help="where to write the heatmap (default: %(default)s in the current folder; '' for none)")
    checker = commands.add_parser("check", help="where every value of a model is read, and whether the spec holds")
    checker.add_argument("model", help="a local model folder, a hub name, or 'embedded'")
    docs = commands.add_parser("docs", help="regenerate the family, names, availability and layer pages")
    docs.add_argument("--folder", default=None,
                      help="where to write them (default: the docs/ folder of the checkout nnterp is installed from)")
    docs.add_argument("--pictures", action="store_true",
                      help="also redraw the guides' pictures under images/ by running their code (the embedded model)")
    args = parser.parse_args(argv)
    if args.command == "lens" and not args.prompt.strip():
        parser.error("lens: --prompt is empty: give the text to read, e.g. --prompt 'The Eiffel Tower is in'")
    try:
        _run(args)
    except (OSError, ValueError, IndexError, TypeError) as error:  # what a user's input can cause: one line, exit 2
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        parser.exit(2, f"python -m nnterp {args.command}: error: {first}\n")


def _run(args) -> None:
    if args.command == "docs":
        from pathlib import Path

        from .documentation import draw_pictures, write

        folder = Path(args.folder) if args.folder else Path(__file__).resolve().parent.parent / "docs"
        if not args.folder and not (folder.parent / "mkdocs.yml").is_file():
            raise ValueError("nnterp is not installed from a checkout with a docs/ folder: pass --folder FOLDER.")
        print(f"wrote {len(write(folder))} pages under {folder}/")
        if args.pictures:
            print(f"drew {len(draw_pictures(folder))} pictures under {folder}/images/")
        return
    if args.command == "check":
        sys.exit(check(args.model))
    if args.command == "lens":
        lens(args.model, args.prompt, args.target, args.plot)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    demo(args.model, args.prompt, args.target, args.layer, args.plot)


if __name__ == "__main__":
    main()
