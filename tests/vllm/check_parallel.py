"""StandardizedVLLM on two tensor-parallel workers against transformers (``python check_parallel.py <family>`` in
the vLLM venv, tests/vllm/setup.sh): prints one JSON line of measurements, which tests/vllm/test_parallel.py asserts.

vLLM's CPU build runs one worker process per rank, each bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``:
its automatic binding wants a NUMA node per worker). Every value at a module boundary is read in one trace and
compared with transformers' plain hooks (the stream is all-reduced on every rank; the pieces at the parallel linear
layers' boundaries, the heads' output and the MLP's neurons, gathered by nnsight); the attention kernel's inputs, one
rank's heads, are refused; steered greedy generation against transformers' hooked loop.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank

import nnsight  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from check_vllm import HOOKS, LLAMA_HOOKS, OWNER, PROMPT, blocks_of, build, greedy, hooked, where, with_points  # noqa: E402


def main(family: str) -> dict:
    from nnterp.vllm import StandardizedVLLM

    folder = tempfile.mkdtemp(prefix=f"nnterp-vllm-parallel-{family}-")
    hf = build(family, folder)
    hooks = with_points(HOOKS.get(family, LLAMA_HOOKS), family)
    model = StandardizedVLLM(folder, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp",
                             max_model_len=128, enable_prefix_caching=False)
    result: dict = {"family": model.vllm_family.name}
    available = [name for name in hooks if model.availability(0)[f"{OWNER[name]}.{name}" if name in OWNER else
                                                                  name].available]
    result["available"] = available
    layers = range(model.num_layers)
    with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
        values = nnsight.save({f"{i}.{name}": getattr(where(model, i, name), name).clone() for i in layers
                               for name in available})
        logits = model.logits.save()
    ref_logits, ref = hooked(hf, PROMPT, hooks)
    result["value_diffs"] = {key: [list(value.shape), float((value - ref[(int(key.split(".")[0]), key.split(
        ".", 1)[1])].reshape(value.shape)).abs().max())] for key, value in values.items()}
    result["widths"] = {key: [list(value.shape), list(ref[(int(key.split(".")[0]), key.split(".", 1)[1])].shape)]
                        for key, value in values.items()}
    result["logits"] = float((logits - ref_logits).abs().max())
    result["reasons"] = {key: entry.reason for key, entry in model.availability(0).items() if not entry.available}
    try:
        with torch.no_grad(), model.trace(PROMPT, temperature=0.0, max_tokens=1):
            model.layers[0].self_attn.queries.save()
        result["queries"] = None
    except Exception as error:  # noqa: BLE001 - reported to the test, which checks the type and the reason
        result["queries"] = f"{type(error).__name__}: {error}"

    steps = 6
    rms = float(ref[(0, "layer_output")].pow(2).mean().sqrt())
    toward = hf.get_output_embeddings().weight[40].detach()
    vector = rms * model.hidden_size ** 0.5 * toward / toward.norm()
    ids = model.steered_generate([PROMPT, PROMPT[:4]], [0, 1], vector, max_new_tokens=steps)
    handles = [blocks_of(hf)[i].register_forward_hook(
        lambda _m, _a, out: (out[0] + vector, *out[1:]) if isinstance(out, tuple) else out + vector) for i in (0, 1)]
    try:
        result["expected_steered"] = [greedy(hf, PROMPT, steps), greedy(hf, PROMPT[:4], steps)]
    finally:
        for handle in handles:
            handle.remove()
    result["steered"] = [ids[0, -steps:].tolist(), ids[1, -steps:].tolist()]
    result["unsteered"] = [greedy(hf, PROMPT, steps), greedy(hf, PROMPT[:4], steps)]
    return result


if __name__ == "__main__":
    print("NNTERP-RESULT " + json.dumps(main(sys.argv[1])), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the engine's worker processes are stopped with the process group
