"""StandardizedVLLM's standard names against raw nnsight on vLLM, per value read, as time ratios:
``.vllm-venv/bin/python benchmarks/vllm_values.py`` (the venv tests/vllm/setup.sh makes; vLLM's CPU build here).

A random-weight Llama shape is saved to a folder; each engine runs in a process of its own, one after the other
(one engine at a time): raw nnsight's ``VLLM`` (with only the CPU worker and meta build that vLLM's CPU build
needs) reading by native module path, and ``StandardizedVLLM`` reading the standard names. The same reads in both:
every block's ``layer_output`` (natively the fused block's two outputs added) and ``mlp_output`` (the MLP's
output), over the prompt's pass (``max_tokens=1``) and over a generation (every step, under ``tracer.iter``).
The medians of the rounds (the variants in turn) are printed, and the ratios nnterp / raw, in total and per read beyond an empty trace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LAYERS, HIDDEN, VOCAB, PROMPT = 6, 256, 128, list(range(5, 37))  # 32 prompt tokens


def build(folder: str) -> None:
    import torch
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "vllm"))
    from check_vllm import tokenizer  # the tests' offline word-level tokenizer (128 words)

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HIDDEN // 32, num_key_value_heads=HIDDEN // 64,
                                      vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=2, eos_token_id=2,
                                      pad_token_id=1)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    tokenizer().save_pretrained(folder)


def timed(variants: dict, rounds: int) -> dict[str, float]:
    """The median seconds of each variant, the variants taken in turn each round (so a slow spell of a shared
    machine falls on all of them), after one warm-up round."""
    times: dict[str, list[float]] = {label: [] for label in variants}
    for round_ in range(rounds + 1):
        for label, fn in variants.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[label].append(time.perf_counter() - start)
    return {label: statistics.median(seconds) for label, seconds in times.items()}


def measure(engine: str, folder: str, rounds: int, steps: int) -> dict[str, float]:
    """In this process: one engine (``raw`` or ``nnterp``), the median seconds of each variant."""
    import nnsight
    import torch
    from nnsight.modeling.vllm import VLLM

    from nnterp.vllm import StandardizedVLLM
    from nnterp.vllm.standardized import CPU_WORKER, _cpu_meta_build

    class RawVLLM(VLLM):  # nnsight's engine, plus only what vLLM's CPU build needs to run it
        _WORKER_CLS = VLLM._WORKER_CLS if torch.cuda.is_available() else CPU_WORKER

        def _load_meta(self, *args, **kwargs):
            with _cpu_meta_build():
                return VLLM._load_meta(self, *args, **kwargs)

    kwargs = dict(dtype="float32", distributed_executor_backend="uni", max_model_len=512, enable_prefix_caching=False)
    if engine == "raw":
        model = RawVLLM(folder, dispatch=True, **kwargs)
        def layer_output(i):
            out = model.model.layers[i].output  # (mlp_out, residual): the stream is their sum
            return out[0] + out[1]

        def mlp_output(i):
            return model.model.layers[i].mlp.output
    else:
        model = StandardizedVLLM(folder, **kwargs)

        def layer_output(i):
            return model.layers[i].layer_output

        def mlp_output(i):
            return model.layers[i].mlp.mlp_output

    def reads(names):  # in forward order within a block: the MLP's output, then the block's
        for i in range(LAYERS):
            for name in names:
                (layer_output if name == "layer_output" else mlp_output)(i).save()

    def prompt_pass(names):
        def run():
            with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
                reads(names)
        return run

    def generation(names):
        def run():
            with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
                for _step in tracer.iter[0:steps]:
                    reads(names)
                nnsight.save(tracer.result)
        return run

    def untraced():  # the engine's own generate, no trace: what each engine costs without nnsight
        from vllm import SamplingParams

        model.vllm_entrypoint.generate([{"prompt_token_ids": PROMPT}],
                                       SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True),
                                       use_tqdm=False)

    variants = {"generate.untraced": untraced}
    for label, names in (("empty", ()), ("layer_output", ("layer_output",)), ("mlp_output", ("mlp_output",)),
                         ("both", ("mlp_output", "layer_output"))):
        variants[f"prompt.{label}"] = prompt_pass(names)
        variants[f"generate.{label}"] = generation(names)
    return timed(variants, rounds)


def run_engine(engine: str, folder: str, rounds: int, steps: int) -> dict[str, float]:
    """``measure`` in a fresh process (one engine at a time), stopped with its process group."""
    command = [sys.executable, __file__, "--engine", engine, "--folder", folder, "--rounds", str(rounds),
               "--steps", str(steps)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env={**os.environ, "PYTHONPATH": os.path.join(
                                   os.path.dirname(os.path.abspath(__file__)), "..")})
    try:
        output, _ = process.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        if process.poll() is None:
            process.wait(timeout=30)
    lines = [line for line in output.splitlines() if line.startswith("VALUES-RESULT ")]
    if not lines:
        raise SystemExit(f"the {engine} engine failed:\n{output[-4000:]}")
    return json.loads(lines[-1].removeprefix("VALUES-RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nnterp-first", action="store_true", help="start StandardizedVLLM's engine first")
    parser.add_argument("--engine", choices=("raw", "nnterp"))
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.engine:  # one engine's measurements, in its own process
        print("VALUES-RESULT " + json.dumps(measure(args.engine, args.folder, args.rounds, args.steps)), flush=True)
        os._exit(0)  # the in-process engine's threads would hold the exit
    folder = tempfile.mkdtemp(prefix="nnterp-vllm-values-")
    build(folder)
    first, second = ("nnterp", "raw") if args.nnterp_first else ("raw", "nnterp")
    measured = {engine: run_engine(engine, folder, args.rounds, args.steps) for engine in (first, second)}
    raw, ours = measured["raw"], measured["nnterp"]
    import nnsight
    import torch

    print(f"StandardizedVLLM vs raw nnsight VLLM, {platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, nnsight {nnsight.__version__}; Llama shape {LAYERS} x {HIDDEN} (random weights), "
          f"prompt {len(PROMPT)} tokens, median of {args.rounds}, engines in turn: {first}, then {second}")
    for scope, what in (("prompt", "the prompt's pass (max_tokens=1)"),
                        ("generate", f"a generation of {args.steps} tokens, reads at every step")):
        reads_per_trace = {"layer_output": LAYERS, "mlp_output": LAYERS, "both": 2 * LAYERS}
        steps = 1 if scope == "prompt" else args.steps
        print(f"  {what}:")
        print(f"    {'reads':<14} {'raw s':>8} {'nnterp s':>9} {'x total':>8} {'raw ms/read':>12} "
              f"{'nnterp ms/read':>15} {'x per read':>11}")
        for label in ("untraced", "empty", "layer_output", "mlp_output", "both")[scope == "prompt":]:
            key = f"{scope}.{label}"
            line = f"    {label:<14} {raw[key]:8.3f} {ours[key]:9.3f} {ours[key] / raw[key]:8.2f}"
            if label not in ("untraced", "empty"):
                count = reads_per_trace[label] * steps
                raw_read = (raw[key] - raw[f"{scope}.empty"]) / count * 1e3
                our_read = (ours[key] - ours[f"{scope}.empty"]) / count * 1e3
                line += f" {raw_read:12.2f} {our_read:15.2f} {our_read / raw_read if raw_read > 0 else float('nan'):11.2f}"
            if scope == "generate" and label != "untraced":  # each engine against its own untraced generate
                own = (ours[key] / ours["generate.untraced"]) / (raw[key] / raw["generate.untraced"])
                line += f"   (x {own:.2f} against each engine's own untraced generate)"
            print(line)


if __name__ == "__main__":
    main()
