"""StandardizedVLLM on a CUDA machine (vLLM's CUDA build, ``pip install nnterp[vllm]``), against transformers:
``python benchmarks/device_vllm.py [--dtype bfloat16] [--steps 16]``.

A Llama of Llama-3.2-1B's shape (16 blocks of 2048, random weights) is built from a config on the GPU, saved to a
folder and loaded by transformers (the ground truth, read with plain forward hooks) and by StandardizedVLLM. It
compares every block's standard values and the last position's logits, a greedy generation and a steered greedy
generation (a vector added to two blocks' ``layer_output`` at every step, against the same addition by forward
hooks in a greedy loop over transformers), and prints the timings. Exits non-zero when a comparison fails.

In bfloat16 the two implementations round differently (vLLM's fused add-and-norm normalizes the unrounded sum), so
values are compared relative to their size with a bfloat16 tolerance, and generations report how many leading
tokens agree; ``--dtype float32`` makes them agree to float32 rounding and token for token.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the engine in this one
os.environ.setdefault("NNSIGHT_VLLM_CLONE_READS", "1")  # vLLM's CUDA fused add-and-norm writes into its inputs

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

# the transformers modules of a Llama block each value is read at: (path, side)
HOOKS = {"attention_output": ("self_attn", "output"), "layer_mid": ("post_attention_layernorm", "input"),
         "mlp_output": ("mlp", "output"), "layer_output": ("", "output")}
OWNER = {"attention_output": "self_attn", "mlp_output": "mlp"}
PROMPT = list(range(100, 164))  # 64 prompt tokens


def config():
    import transformers

    return transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=2048, rope_theta=500000.0,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=2, pad_token_id=1)


def build(folder: str, dtype: torch.dtype):
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "vllm"))
    from check_vllm import tokenizer  # the tests' offline word-level tokenizer: prompts are token ids here

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config(), dtype=dtype).eval()
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return model


def hooked(model, ids, steer=None):
    """Transformers' last-position logits and the values of every block by plain hooks; ``steer`` = (layers,
    vector) adds the vector to those blocks' outputs."""
    seen, handles = {}, []
    for i, block in enumerate(model.model.layers):
        for name, (path, side) in HOOKS.items():
            module = block.get_submodule(path) if path else block

            def record(_m, args, out=None, i=i, name=name, side=side):
                tensor = args[0] if side == "input" else (out[0] if isinstance(out, tuple) else out)
                seen[(i, name)] = tensor.detach().clone()
            handles.append(module.register_forward_pre_hook(lambda m, a, f=record: f(m, a)) if side == "input" else
                           module.register_forward_hook(lambda m, a, o, f=record: f(m, a, o)))
    if steer is not None:
        layers, vector = steer
        for i in layers:
            handles.append(model.model.layers[i].register_forward_hook(
                lambda _m, _a, out: (out[0] + vector, *out[1:]) if isinstance(out, tuple) else out + vector))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device="cuda")).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits[:, -1:], seen


def greedy(model, ids, steps, steer=None):
    handles = []
    if steer is not None:
        layers, vector = steer
        handles = [model.model.layers[i].register_forward_hook(
            lambda _m, _a, out: (out[0] + vector, *out[1:]) if isinstance(out, tuple) else out + vector)
            for i in layers]
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
    return out[0, len(ids):].tolist()


def agreeing(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def batch_ratios(model, vector, steps: int, counts=(1, 8, 32, 128)) -> None:
    """Steered generation of many prompts (64 tokens each, ``steps`` greedy tokens, the vector at two blocks every
    step), tokens/s and ratios in time: the engine's own generate, raw nnsight (one invoke per prompt, the native
    output edited in place), and ``model.steered_generate`` (benchmarks/vllm_batch.py's measure, on CUDA)."""
    from vllm_batch import baselines, interleaved

    generator = torch.Generator().manual_seed(2)
    print(f"  many prompts, {steps} greedy tokens each, a vector at 2 blocks every step (median of 3, interleaved):")
    for count in counts:
        ids = [torch.randint(100, 30000, (64,), generator=generator).tolist() for _ in range(count)]
        engine, raw_nnsight = baselines(model, ids, steps, vector, [2, 5])

        def standardized(ids=ids):
            model.steered_generate(ids, [2, 5], vector, max_new_tokens=steps)

        a, b, c = interleaved({"engine": engine, "raw": raw_nnsight, "nnterp": standardized}, 3).values()
        print(f"    {count:>4} prompts: engine {count * steps / a:9.1f} tokens/s, raw nnsight {count * steps / b:9.1f}, "
              f"nnterp {count * steps / c:9.1f}: nnterp x {c / b:.2f} raw nnsight's time, x {c / a:.2f} the engine's")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/device_vllm.py needs a CUDA GPU and vLLM's CUDA build (pip install nnterp[vllm]).")
    import nnsight

    from nnterp.vllm import StandardizedVLLM

    dtype = getattr(torch, args.dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2  # relative to each value's size
    timings, failures = {}, []
    folder = tempfile.mkdtemp(prefix="nnterp-vllm-device-")
    start = time.perf_counter()
    hf = build(folder, dtype)
    timings["build and save (transformers)"] = time.perf_counter() - start
    start = time.perf_counter()
    model = StandardizedVLLM(folder, dtype=args.dtype, max_model_len=1024, enforce_eager=True,
                             gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False)
    timings["StandardizedVLLM start"] = time.perf_counter() - start
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, nnsight {nnsight.__version__}, {args.dtype}, "
          f"{model.num_layers} blocks x {model.hidden_size}")

    # every block's values and the logits
    start = time.perf_counter()
    with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
        values = nnsight.save({})
        for i in range(model.num_layers):
            for name in HOOKS:
                owner = model.layers[i] if name not in OWNER else getattr(model.layers[i], OWNER[name])
                values[(i, name)] = getattr(owner, name).clone()
        logits = model.logits.save()
        readout = model.project_on_vocab(model.layers[model.num_layers - 1].layer_output).save()
    timings["trace: every value of every block"] = time.perf_counter() - start
    start = time.perf_counter()
    ref_logits, ref = hooked(hf, PROMPT)
    timings["transformers forward with hooks"] = time.perf_counter() - start
    worst = {}
    for key, value in values.items():
        expected = ref[key].reshape(value.shape).float()
        diff = float((value.float() - expected).abs().max()) / max(1.0, float(expected.abs().max()))
        worst[key[1]] = max(worst.get(key[1], 0.0), diff)
    for name, diff in worst.items():
        print(f"  {name:<18} worst relative difference over the blocks {diff:.2e}")
        if diff > tolerance:
            failures.append(f"{name}: {diff:.2e} > {tolerance}")
    scale = max(1.0, float(ref_logits.abs().max()))
    logits_diff = float((logits.float() - ref_logits.float()).abs().max()) / scale
    readout_diff = float((readout[:, -1:].float() - ref_logits.float()).abs().max()) / scale
    print(f"  logits (last position) relative difference {logits_diff:.2e}; project_on_vocab {readout_diff:.2e}")
    if max(logits_diff, readout_diff) > tolerance:
        failures.append(f"logits: {logits_diff:.2e}, project_on_vocab: {readout_diff:.2e} > {tolerance}")

    # greedy generation, then steered: two blocks' layer_output plus a vector, at every step
    steps = args.steps
    start = time.perf_counter()
    with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        out = tracer.result.save()
    timings[f"vLLM greedy generation, {steps} tokens (traced)"] = time.perf_counter() - start
    generated = list(out.outputs[0].token_ids)
    start = time.perf_counter()
    expected = greedy(hf, PROMPT, steps)
    timings[f"transformers greedy generate, {steps} tokens"] = time.perf_counter() - start
    rms = float(ref[(0, "layer_output")].float().pow(2).mean().sqrt())
    vector = (torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(1)) * 4 * rms).to("cuda", dtype)
    start = time.perf_counter()
    ids = model.steered_generate(PROMPT, [2, 5], vector, max_new_tokens=steps)
    timings[f"StandardizedVLLM.steered_generate, {steps} tokens"] = time.perf_counter() - start
    steered = ids[0, len(PROMPT):].tolist()
    expected_steered = greedy(hf, PROMPT, steps, steer=([2, 5], vector))
    print(f"  greedy: {agreeing(generated, expected)}/{steps} leading tokens agree; steered: "
          f"{agreeing(steered, expected_steered)}/{steps}; the steering changed {sum(a != b for a, b in zip(steered, generated))} tokens")
    if dtype == torch.float32 and (generated != expected or steered != expected_steered):
        failures.append("float32 generations differ from transformers'")
    if steered == generated:
        failures.append("the steering changed no token, so the steered comparison proves nothing")
    for label, seconds in timings.items():
        print(f"  {label:<52} {seconds:8.2f} s")
    batch_ratios(model, vector, steps)
    print("FAILED: " + "; ".join(failures) if failures else "OK")
    sys.stdout.flush()
    os._exit(1 if failures else 0)  # the in-process engine's threads would hold the exit


if __name__ == "__main__":
    main()
