"""StandardizedVLLM serving many prompts safely, against transformers with plain hooks: ``python check_engine.py
<family>`` in the vLLM venv prints one JSON line of measurements, which tests/vllm/test_vllm.py asserts on.

One engine with vLLM's prefix caching on (block size 32, the CPU attention's least; a prompt longer than two blocks), on the tiny model of
check_vllm.py: stream edits made after a later read, the prefix cache between steered and untraced requests,
negative layers, and steered generation of a list of prompts.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from check_vllm import blocks_of, build, greedy, readout  # noqa: E402

LONG = [(5 * i + 3) % 120 + 3 for i in range(72)]  # more than two blocks of 32: the prefix cache keeps two
PROMPTS = [[5, 17, 33, 9, 60, 41, 12], [7, 8, 99, 3], LONG[:20]]
STEPS = 6


def hooked_logits(hf, ids, hooks):
    """Transformers' logits at the last position with ``hooks`` = [(module, kind, fn)] registered for the call."""
    handles = []
    for module, kind, fn in hooks:
        register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
        handles.append(register(fn))
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[:, -1:]
    finally:
        for handle in handles:
            handle.remove()


def steered_greedy(hf, ids, layers, vector, steps=STEPS):
    """A greedy loop over transformers with ``vector`` added to the output of ``layers`` by forward hooks."""
    add = lambda _m, _a, out: (out[0] + vector, *out[1:]) if isinstance(out, tuple) else out + vector  # noqa: E731
    handles = [blocks_of(hf)[i].register_forward_hook(add) for i in layers]
    try:
        return greedy(hf, ids, steps)
    finally:
        for handle in handles:
            handle.remove()


def attempt(fn, *args):
    """``fn(*args)``, or the error it raised as text (for the test to report)."""
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return f"{type(error).__name__}: {str(error)[:3000]}"


def main(family: str) -> dict:
    import nnterp
    from nnterp.vllm import StandardizedVLLM

    folder = tempfile.mkdtemp(prefix=f"nnterp-vllm-engine-{family}-")
    hf = build(family, folder)
    model = StandardizedVLLM(folder, dtype="float32", distributed_executor_backend="uni", max_model_len=128,
                             enable_prefix_caching=True, block_size=32)
    result: dict = {"key": family}
    blocks = blocks_of(hf)
    direction = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(1))
    vector = 0.2 * direction  # steers every prompt without collapsing the tiny model onto one token
    plain = hooked_logits(hf, PROMPTS[0], [])

    # (1) an in-place edit of a block's output made after the trace read the next block's input (the same tensor
    # on transformers, whose block has not run yet): it reaches the model as the same edit by a plain hook does
    def shifted(_m, _a, out):
        return (out[0] + vector, *out[1:]) if isinstance(out, tuple) else out + vector
    with torch.no_grad(), model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
        stream = model.layers[0].layer_output
        model.layers[1].layer_input.save()
        stream[:] += vector
        got = model.logits.save()
    want = hooked_logits(hf, PROMPTS[0], [(blocks[0], "post", shifted)])
    result["late_output_edit"] = {"diff": float((got - want).abs().max()), "moved": float((want - plain).abs().max())}

    # (1b) edits vLLM can no longer take once its fused add has copied the stream: refused, saying why
    late = {}
    for label, (layer, name, later, then) in {
            "output_after_next_norm": (0, "layer_output", "attention_norm_output", True),
            "mid_after_mlp_norm": (1, "layer_mid", "mlp_norm_output", True),
            "output_edit_ends_the_trace": (0, "layer_output", "attention_norm_output", False),  # nothing read after
            "view_of_mid_edited_late": (1, "layer_mid", "mlp_input", False)}.items():
        try:
            with torch.no_grad(), model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
                stream = getattr(model.layers[layer], name)
                last = stream[:, -1]  # a view: it writes into the stream
                getattr(model.layers[layer + (name == "layer_output")], later).save()
                if "view" in label:
                    last.add_(vector)
                else:
                    stream[:] += vector
                if then:
                    model.logits.save()
            late[label] = None
        except Exception as error:  # noqa: BLE001 - reported to the test
            late[label] = f"{type(error).__name__}: {error}"
    result["late_refused"] = late

    # (2) the prefix cache: untraced generation shares it; a steered request neither leaves its KV for an untraced
    # one (a prompt steered first) nor reads the KV an untraced one left (a prompt generated untraced first)
    def untraced(ids):
        out = model.generate([{"prompt_token_ids": ids}], max_tokens=STEPS, temperature=0.0, ignore_eos=True)[0]
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    def steer(ids):
        return model.steered_generate(ids, [0, 1], vector, max_new_tokens=STEPS)[0, len(ids):].tolist()

    cache = {}
    for label, ids in (("steered_first", LONG), ("untraced_first", LONG[::-1])):
        cache[label] = attempt(lambda ids=ids: {"expected": greedy(hf, ids, STEPS),
                                                "expected_steered": steered_greedy(hf, ids, [0, 1], vector)})
        if label == "steered_first":
            cache[label].update(steered=attempt(steer, ids), untraced=attempt(untraced, ids))
        else:
            cache[label].update(untraced=attempt(untraced, ids), steered=attempt(steer, ids))
        cache[label]["untraced_again"] = attempt(untraced, ids)  # [tokens, tokens served from the cache]
    result["prefix_cache"] = cache

    # negative layers, counted from the end as on transformers
    result["negative_layers"] = {
        "got": attempt(lambda: model.steered_generate(PROMPTS[0], [0, -1], vector, max_new_tokens=STEPS)[0, 7:].tolist()),
        "expected": steered_greedy(hf, PROMPTS[0], [0, model.num_layers - 1], vector)}

    # a list of prompts: each its own request in one trace, padded on the left as transformers pads a batch
    width = max(len(p) for p in PROMPTS)
    pad = model.tokenizer.pad_token_id
    result["batch"] = {
        "rows": attempt(lambda: model.steered_generate(PROMPTS, [0, 1], vector, max_new_tokens=STEPS).tolist()),
        "tool_rows": attempt(lambda: nnterp.steered_generate(model, PROMPTS, [0, 1], vector,
                                                             max_new_tokens=STEPS).tolist()),
        "expected_rows": [[pad] * (width - len(p)) + p + steered_greedy(hf, p, [0, 1], vector) for p in PROMPTS],
        "unsteered": [greedy(hf, p, STEPS) for p in PROMPTS]}

    # the logit lens over a list of prompts: each layer's stream through transformers' own final norm and head
    lens_prompts = ["w5 w17 w33 w9", "w7 w8"]
    def lens_truth(text):
        ids = model.tokenizer(text)["input_ids"]
        streams = {}
        handles = [block.register_forward_hook(lambda _m, _a, out, i=i: streams.__setitem__(i, out[0] if isinstance(
            out, tuple) else out)) for i, block in enumerate(blocks)]
        try:
            with torch.no_grad():
                hf(torch.tensor([ids]))
                return torch.stack([readout(hf, streams[i])[0, -1].softmax(-1) for i in (0, model.num_layers - 1, 1)])
        finally:
            for handle in handles:
                handle.remove()
    got = attempt(lambda: nnterp.logit_lens(model, lens_prompts, layers=[0, -1, 1]))
    want = torch.stack([lens_truth(text) for text in lens_prompts])
    result["lens"] = got if isinstance(got, str) else {
        "shape": list(got.shape), "diff": float((got - want).abs().max()), "layers_differ": float((want[:, 0] -
                                                                                                     want[:, 1]).abs().max())}

    # every nnterp tool that takes a model: in the engine's table, and refused at its entry where it says so
    import inspect

    tools = {name: getattr(nnterp, name) for name in nnterp.__all__ if inspect.isfunction(getattr(nnterp, name))
             and next(iter(inspect.signature(getattr(nnterp, name)).parameters), None) == "model"}
    table = {}
    for name, tool in tools.items():
        if name in model.RUNNING_TOOLS:
            table[name] = "runs"
            continue
        required = [p for p in list(inspect.signature(tool).parameters.values())[1:]
                    if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        table[name] = attempt(tool, model, *[None] * len(required))
    result["tools"] = {"table": table, "refused": sorted(model.REFUSED_TOOLS), "running": list(model.RUNNING_TOOLS),
                       "str_tokens": attempt(nnterp.to_str_tokens, model, "w5 w6"),
                       "top_tokens": attempt(lambda: nnterp.top_tokens(model, torch.eye(model.vocab_size)[5:6], k=1))}
    return result


if __name__ == "__main__":
    print("NNTERP-RESULT " + json.dumps(main(sys.argv[1])), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the in-process engine's threads would hold the exit
