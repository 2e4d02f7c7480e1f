"""No silent wrong result, no lost row: the tools and collection under adversarial use.

Each case is what a skeptical user tries: layers out of order or repeated, positions past a
prompt's end, right padding, a string instead of a list, files deleted, truncated or killed
mid-write. Ground truth is a plain forward with hooks, or a collection made in one go.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from nnterp import Collection, StandardizedTransformer, activation_patching, collect, logit_lens, steered_generate
from nnterp.collection import CollectionError
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer

PROMPTS = ["the cat sat on the mat", "Paris is in", "a dog", "the Eiffel Tower is in the city of Paris",
           "Rome", "the mat is on the cat", "city of Rome", "a cat sat", "the dog sat on a mat", "Tower"]


@pytest.fixture(scope="module")
def llama():
    return StandardizedTransformer(build_tiny(BY_MODEL_TYPE["llama"].tiny_config()), tokenizer=tiny_tokenizer())


def hooked_streams(model, text):
    """Every block's output for one prompt alone, with plain hooks (no padding)."""
    outputs = []
    handles = [block.register_forward_hook(lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple) else o))
               for block in model.layers._module]
    ids = model.tokenizer(text, return_tensors="pt").input_ids
    try:
        with torch.no_grad():
            model._module(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


# -- layers and positions ---------------------------------------------------------------------------

def test_layers_come_back_in_the_order_asked_with_repeats(llama, tmp_path):
    lens = logit_lens(llama, PROMPTS[:2], layers=[2, 0, 2])
    forward = logit_lens(llama, PROMPTS[:2], layers=[0, 1, 2])
    assert torch.equal(lens, forward[:, [2, 0, 2]])
    metric = lambda logits: logits[:, -1, 5] - logits[:, -1, 6]  # noqa: E731
    backwards = activation_patching(llama, "the cat sat", "the dog sat", metric, layers=[1, 0])
    assert torch.equal(backwards, activation_patching(llama, "the cat sat", "the dog sat", metric, layers=[0, 1])[[1, 0]])
    collected = collect(llama, PROMPTS[:3], tmp_path, layers=[2, 0, 2], progress=False)
    single = collect(llama, PROMPTS[:3], tmp_path / "forward", layers=[0, 1, 2], progress=False)
    assert torch.equal(collected["layer_output"], single["layer_output"][:, [2, 0, 2]])


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_position_is_each_prompts_own_token_whichever_side_pads(llama, tmp_path, side):
    llama.tokenizer.padding_side = side
    try:
        lens = logit_lens(llama, PROMPTS[:3], position=1)
        first = collect(llama, PROMPTS[:3], tmp_path / "first", positions=0, progress=False)["layer_output"]
        last = collect(llama, PROMPTS[:3], tmp_path / "last", positions="last", progress=False)["layer_output"]
    finally:
        llama.tokenizer.padding_side = "left"
    for row, text in enumerate(PROMPTS[:3]):
        streams = hooked_streams(llama, text)
        expected = llama.project_on_vocab(streams[-1][:, [1]]).float().softmax(-1)[0, 0]
        assert torch.allclose(lens[row, -1], expected, atol=1e-6)
        assert torch.allclose(first[row, 2], streams[2][0, 0], atol=1e-5)
        assert torch.allclose(last[row, 2], streams[2][0, -1], atol=1e-5)


def test_a_position_past_a_prompt_is_an_error(llama, tmp_path):
    with pytest.raises(IndexError, match="beyond prompt 1"):
        collect(llama, ["the cat sat on the mat", "Rome"], tmp_path, positions=5, progress=False)
    with pytest.raises(IndexError, match="beyond prompt 0"):
        logit_lens(llama, ["Rome"], position=3)


def test_a_steering_scope_the_generation_never_reaches_is_an_error(llama):
    with pytest.raises(ValueError, match=r"steps \[5, 6, 7, 8\]"):
        steered_generate(llama, "the cat", 1, torch.ones(64), scope=range(5, 9), max_new_tokens=3)


def test_skip_layers_backwards_is_an_error(llama):
    from nnterp import skip_layers

    with pytest.raises(ValueError, match="before start"):
        with llama.trace("the cat"):
            skip_layers(llama, 1, 0)


# -- collection ------------------------------------------------------------------------------------

def test_a_string_or_nothing_is_refused(llama, tmp_path):
    with pytest.raises(TypeError, match="not one string"):
        collect(llama, "w3 w4", tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="at least one prompt"):
        collect(llama, [], tmp_path / "b", progress=False)


def test_deleted_shard_is_reported_and_collected_again(llama, tmp_path):
    reference = collect(llama, PROMPTS, tmp_path / "ref", batch_size=3, progress=False)["layer_output"]
    collect(llama, PROMPTS, tmp_path / "c", batch_size=3, progress=False)
    (tmp_path / "c" / "batch-000000003.safetensors").unlink()
    with pytest.raises(CollectionError, match="batch 3: batch-000000003.safetensors is missing"):
        Collection(tmp_path / "c")
    again = collect(llama, PROMPTS, tmp_path / "c", batch_size=3, progress=False)
    assert again.complete and torch.equal(again["layer_output"], reference)


def test_truncated_shard_and_manifest_are_reported(llama, tmp_path):
    collect(llama, PROMPTS, tmp_path, batch_size=4, progress=False)
    shard = tmp_path / "batch-000000004.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CollectionError, match="batch 4: .* is damaged"):
        Collection(tmp_path)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(CollectionError, match="manifest.json is damaged"):
        Collection(tmp_path)
    with pytest.raises(CollectionError, match="manifest.json is damaged"):
        collect(llama, PROMPTS, tmp_path, batch_size=4, progress=False)


def test_shards_without_a_manifest_are_never_mixed_in(llama, tmp_path):
    collect(llama, PROMPTS, tmp_path, batch_size=3, progress=False)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(CollectionError, match="no manifest.json"):
        collect(llama, PROMPTS, tmp_path, batch_size=4, progress=False)


def test_an_incomplete_collection_says_what_is_missing(llama, tmp_path, monkeypatch):
    import nnterp.collection.runner as module

    calls = []
    real = module._collect_batch

    def dies_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_collect_batch", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        collect(llama, PROMPTS, tmp_path, batch_size=2, progress=False)
    partial = Collection(tmp_path)
    assert not partial.complete and partial.missing == [4, 6, 8] and partial.rows == 4
    assert "incomplete: batches [4, 6, 8] missing" in repr(partial)


KILLER = """
import sys, torch
from nnterp import StandardizedTransformer, collect
torch.set_num_threads(1)  # as the suite's own process: bit-identical results
model = StandardizedTransformer(sys.argv[1])
prompts = [line for line in open(sys.argv[2]).read().split("\\n") if line]
collect(model, prompts, sys.argv[3], values=["layer_output", "mlp_output"], positions="all", batch_size=1,
        progress=False)
"""


def test_killed_at_random_points_loses_and_duplicates_nothing(llama, tmp_path):
    """SIGKILL a collecting process at random moments, resume each time: the result is the one-go result."""
    folder = tmp_path / "model"
    llama._module.save_pretrained(folder)
    llama.tokenizer.save_pretrained(folder)
    prompts = [f"{a} {b} sat on the mat" for a in ("the", "a", "Rome", "Paris") for b in ("cat", "dog", "city")]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts))
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    out = tmp_path / "collection"
    rng = random.Random(0)
    kills = 0
    for _ in range(12):
        process = subprocess.Popen([sys.executable, str(script), str(folder), str(tmp_path / "prompts.txt"), str(out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        manifest = out / "manifest.json"
        target = rng.randint(1, len(prompts) - 1)
        start = time.monotonic()
        while process.poll() is None and time.monotonic() - start < 60:
            shards = len(json.loads(manifest.read_text())["shards"]) if manifest.is_file() else 0
            if shards >= target:
                time.sleep(rng.random() * 0.05)  # anywhere in the next batch: mid-trace, mid-write, mid-rename
                process.send_signal(signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.005)
        process.wait()
        if process.returncode == 0:
            break
    assert kills >= 3
    result = collect(llama, prompts, out, values=["layer_output", "mlp_output"], positions="all", batch_size=1,
                     progress=False)
    reference = collect(llama, prompts, tmp_path / "reference", values=["layer_output", "mlp_output"],
                        positions="all", batch_size=1, progress=False)
    assert result.complete and result.rows == reference.rows
    for name in ("layer_output", "mlp_output"):
        assert torch.equal(result[name], reference[name])
    assert torch.equal(result.offsets, reference.offsets)


# -- loading ---------------------------------------------------------------------------------------

def test_loading_leaves_the_global_random_state_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("NNTERP_CACHE", str(tmp_path))  # a cold cache: the miniature is built and run
    hf = build_tiny(BY_MODEL_TYPE["gpt2"].tiny_config())
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    assert torch.equal(torch.rand(3), expected)


def test_loading_options_are_part_of_what_is_validated(tmp_path):
    falcon = build_tiny(BY_MODEL_TYPE["falcon"].tiny_config())  # parallel_attn=True in the folder
    falcon.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model = StandardizedTransformer(tmp_path, parallel_attn=False)
    assert not model._module.config.parallel_attn
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad(), model.trace(ids):
        x = model.layers[0].layer_input.save()
        a = model.layers[0].self_attn.attention_output.save()
        mid = model.layers[0].layer_mid.save()  # a sequential block now: the stream after the attention add
    assert torch.equal(mid, x + a)


def test_a_damaged_or_unwritable_validation_cache_warns_and_validates_again(tmp_path, monkeypatch):
    import nnterp.proof as proof

    monkeypatch.setenv("NNTERP_CACHE", str(tmp_path))
    hf = build_tiny(BY_MODEL_TYPE["llama"].tiny_config())
    key = proof.validation_key(hf.config, type(hf))
    proof._VALIDATED.pop(key, None)
    StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    marker = tmp_path / "validated" / f"{key}.json"
    truth = json.loads(marker.read_text())["events"]
    saved = json.loads(marker.read_text())
    saved["events"] = saved["events"][::-1]  # reversed events: order() would be wrong if trusted
    marker.write_text(json.dumps(saved))
    proof._VALIDATED.pop(key)
    with pytest.warns(UserWarning, match="digest does not match"):
        model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    assert [list(e) for e in sorted(model._forward_events, key=model._forward_events.get)] == truth
    marker.write_text("{truncated")
    proof._VALIDATED.pop(key)
    with pytest.warns(UserWarning, match="validates again"):
        StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    monkeypatch.setenv("NNTERP_CACHE", "/proc/nnterp-cannot-write-here")
    proof._VALIDATED.pop(key)
    with pytest.warns(UserWarning, match="could not write its validation cache"):
        StandardizedTransformer(hf, tokenizer=tiny_tokenizer())


def test_errors_say_what_is_wrong(tmp_path):
    import transformers as T

    from nnterp import ValueUnavailable

    config = BY_MODEL_TYPE["llama"].tiny_config()
    for cls in (T.LlamaForSequenceClassification, T.LlamaModel):
        with pytest.raises(TypeError, match="not a causal language model"):
            StandardizedTransformer(cls(config), tokenizer=tiny_tokenizer())
    deepseek = StandardizedTransformer(build_tiny(BY_MODEL_TYPE["deepseek_v4"].tiny_config()), tokenizer=tiny_tokenizer())
    with pytest.raises(ValueUnavailable, match="groups of heads"):
        with deepseek.trace(torch.tensor([[3, 4, 5]])):
            deepseek.head_outputs(1)
    build_tiny(config).save_pretrained(tmp_path / "no-tokenizer")
    with pytest.raises(OSError, match="holds no tokenizer files"):
        StandardizedTransformer(tmp_path / "no-tokenizer")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(OSError, match="is a folder, but its config.json could not be read"):
        StandardizedTransformer(tmp_path / "bad")
    model = StandardizedTransformer(build_tiny(config), tokenizer=tiny_tokenizer())
    with pytest.raises(Exception, match="is on cpu; the assigned tensor is on meta"):
        with model.trace(torch.tensor([[3, 4, 5]])):
            model.layers[0].layer_output = torch.empty(1, 3, 64, device="meta")
