"""A collection folder holds one writer's rows, and its rows are indexed as a NumPy array's.

Two tiny GPT-2s of one config and other seeds (A and B), two dtypes, two mask functions: a resume or a
worker whose writer differs is refused, never merged. Ground truth is a plain forward with PyTorch
hooks on the unwrapped model, one prompt at a time (``batch_size=1``: no padding), or the shards
read with plain safetensors; row reads are compared with NumPy's indexing of the whole stored tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nnterp import Collection, StandardizedTransformer, collect
from nnterp.collection import CollectionError
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer

PROMPTS = ["the cat sat on the mat", "Paris is in", "a dog", "the Eiffel Tower is in the city of Paris",
           "Rome", "the mat is on the cat", "city of Rome", "a cat sat"]


def gpt2(seed=0, **config):
    tiny = BY_MODEL_TYPE["gpt2"].tiny_config()
    for key, value in config.items():
        setattr(tiny, key, value)
    return StandardizedTransformer(build_tiny(tiny, seed=seed), tokenizer=tiny_tokenizer())


@pytest.fixture(scope="module")
def model_a():
    return gpt2(seed=0)


@pytest.fixture(scope="module")
def model_b():
    return gpt2(seed=1)


def hooked(model, prompt):
    """[tokens, layers, hidden]: every block's output for one prompt alone, by plain forward hooks."""
    outputs = []
    blocks = model._module.transformer.h
    handles = [block.register_forward_hook(lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple) else o))
               for block in blocks]
    try:
        with torch.no_grad():
            model._module(input_ids=model.tokenizer(prompt, return_tensors="pt").input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(outputs, dim=2)[0]  # [1, tokens, layers, hidden] -> [tokens, layers, hidden]


def close(got, expected):
    return got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)


def last_tokens(model, prompts):
    return torch.stack([hooked(model, prompt)[-1] for prompt in prompts])


def stored(folder, name="layer_output"):
    """Every shard's rows of ``name``, read with plain safetensors in the manifests' order."""
    shards = {}
    for manifest in folder.glob("manifest*.json"):
        shards.update(json.loads(manifest.read_text())["shards"])
    return torch.cat([load_file(folder / shards[start]["file"])[name] for start in sorted(shards, key=int)])


def forget_writers(folder):
    """The folder as an earlier nnterp wrote it: manifests without a writer."""
    for path in folder.glob("manifest*.json"):
        manifest = json.loads(path.read_text())
        manifest.pop("writer", None)
        path.write_text(json.dumps(manifest))


# -- the writer: model, dtype, mask function -------------------------------------------------------

def test_a_worker_of_model_a_then_a_collect_of_model_b_is_refused(model_a, model_b, tmp_path):
    folder = tmp_path / "c"
    collect(model_a, PROMPTS, folder, batch_size=1, progress=False, shard=(0, 2))  # batches 0, 2, 4, 6
    for shard in [(0, 1), (1, 2)]:  # a plain collect resumes, a second worker joins: neither with another model
        with pytest.raises(CollectionError, match=r"another writer: the model's weights\. .* new folder .* delete"):
            collect(model_b, PROMPTS, folder, batch_size=1, progress=False, shard=shard)
    partial = Collection(folder)
    assert partial.missing == [1, 3, 5, 7] and close(partial["layer_output"], last_tokens(model_a, PROMPTS[::2]))
    done = collect(model_a, PROMPTS, folder, batch_size=1, progress=False, shard=(1, 2))  # A's own worker is welcome
    assert done.complete and close(done["layer_output"], last_tokens(model_a, PROMPTS))


def test_a_full_rerun_with_model_b_never_returns_model_a_activations(model_a, model_b, tmp_path):
    collect(model_a, PROMPTS, tmp_path / "c", batch_size=1, progress=False)
    with pytest.raises(CollectionError, match="the model's weights"):
        collect(model_b, PROMPTS, tmp_path / "c", batch_size=1, progress=False)
    truth_b = last_tokens(model_b, PROMPTS)
    assert not torch.allclose(truth_b, last_tokens(model_a, PROMPTS), atol=1e-3)  # A and B do differ
    fresh = collect(model_b, PROMPTS, tmp_path / "b", batch_size=1, progress=False)
    assert close(fresh["layer_output"], truth_b)


def test_another_config_of_the_same_class_and_shapes_is_refused(model_a, tmp_path):
    other = gpt2(seed=0, layer_norm_epsilon=1e-2)  # the same weights, another model
    assert torch.equal(other._module.transformer.h[0].mlp.c_fc.weight, model_a._module.transformer.h[0].mlp.c_fc.weight)
    collect(model_a, PROMPTS, tmp_path, batch_size=4, progress=False, shard=(0, 2))
    with pytest.raises(CollectionError, match="the model's config"):
        collect(other, PROMPTS, tmp_path, batch_size=4, progress=False, shard=(1, 2))


def test_bfloat16_and_float32_writers_never_merge(model_a, tmp_path):
    narrow, wide = tmp_path / "bf16", tmp_path / "f32"
    collect(model_a, PROMPTS, narrow, batch_size=2, dtype=torch.bfloat16, progress=False, shard=(0, 2))
    with pytest.raises(CollectionError, match=r"the dtype of the values \(torch.float32 in this run, torch.bfloat16"):
        collect(model_a, PROMPTS, narrow, batch_size=2, progress=False, shard=(1, 2))
    # workers that started at once (none saw the other's manifest), or folders copied into one: refused on reading
    collect(model_a, PROMPTS, wide, batch_size=2, progress=False, shard=(1, 2))
    for path in wide.iterdir():
        (narrow / path.name).write_bytes(path.read_bytes())
    with pytest.raises(CollectionError, match="different writers .*the dtype of the values"):
        Collection(narrow)
    # an earlier nnterp's folder records no writer: its mixed shards are refused when read, never cast
    forget_writers(narrow)
    mixed = Collection(narrow)
    assert mixed.complete and mixed.writer is None
    first = load_file(narrow / "batch-000000000.safetensors")["layer_output"]
    assert torch.equal(mixed["layer_output", 0:2], first)  # one writer's rows still read
    with pytest.raises(CollectionError, match="as torch.float32, .* as torch.bfloat16: .* never cast"):
        mixed["layer_output"]


def test_two_mask_functions_are_told_apart_and_the_same_one_resumes(model_a, tmp_path):
    def tokens(word_id):
        return lambda ids, mask: ids == word_id  # the same code: only the captured value tells them apart

    cat, mat = model_a.tokenizer.convert_tokens_to_ids(["cat", "mat"])
    collect(model_a, PROMPTS, tmp_path, positions=tokens(cat), batch_size=1, progress=False, shard=(0, 2))
    with pytest.raises(CollectionError, match="the positions mask function"):
        collect(model_a, PROMPTS, tmp_path, positions=tokens(mat), batch_size=1, progress=False, shard=(1, 2))
    with pytest.raises(CollectionError, match="the positions mask function"):
        collect(model_a, PROMPTS, tmp_path, positions=lambda ids, mask: ids != cat, batch_size=1, progress=False)
    done = collect(model_a, PROMPTS, tmp_path, positions=tokens(cat), batch_size=1, progress=False, shard=(1, 2))
    ids = [model_a.tokenizer(prompt, return_tensors="pt").input_ids[0] for prompt in PROMPTS]
    truth = torch.cat([hooked(model_a, prompt)[row == cat] for prompt, row in zip(PROMPTS, ids)])
    assert done.complete and len(truth) and close(done["layer_output"], truth)


MASK_SCRIPT = """
import sys

import torch

torch.set_num_threads(1)
WORD = 4


def all_but_the_word(ids, mask):
    return torch.ne(ids, WORD)


if __name__ == "__main__":
    from nnterp import StandardizedTransformer, collect

    prompts = sys.argv[3].split("|")
    collect(StandardizedTransformer(sys.argv[1]), prompts, sys.argv[2], positions=all_but_the_word, batch_size=1,
            progress=False, shard=(0, 2))
"""


def test_a_mask_function_resumes_in_another_process_and_a_changed_global_is_refused(model_a, tmp_path):
    """The worker in another process loads the model from its folder: the same writer, recognised across processes."""
    import importlib.util

    checkpoint = tmp_path / "model"
    model_a._module.save_pretrained(checkpoint)
    model_a.tokenizer.save_pretrained(checkpoint)
    script = tmp_path / "masks.py"
    script.write_text(MASK_SCRIPT)
    folder = tmp_path / "c"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    out = subprocess.run([sys.executable, str(script), str(checkpoint), str(folder), "|".join(PROMPTS)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("masks", script)
    masks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(masks)
    masks.WORD = 5  # the function reads another value: another mask
    with pytest.raises(CollectionError, match="the positions mask function"):
        collect(model_a, PROMPTS, folder, positions=masks.all_but_the_word, batch_size=1, progress=False,
                shard=(1, 2))
    masks.WORD = 4
    done = collect(model_a, PROMPTS, folder, positions=masks.all_but_the_word, batch_size=1, progress=False,
                   shard=(1, 2))
    ids = [model_a.tokenizer(prompt, return_tensors="pt").input_ids[0] for prompt in PROMPTS]
    truth = torch.cat([hooked(model_a, prompt)[row != 4] for prompt, row in zip(PROMPTS, ids)])
    assert done.complete and len(truth) < sum(map(len, ids)) and close(done["layer_output"], truth)


def test_an_earlier_folder_without_a_writer_is_read_but_not_resumed(model_a, tmp_path):
    collect(model_a, PROMPTS, tmp_path, batch_size=1, progress=False, shard=(0, 2))
    forget_writers(tmp_path)
    old = Collection(tmp_path)
    assert old.writer is None and close(old["layer_output"], last_tokens(model_a, PROMPTS[::2]))
    with pytest.raises(CollectionError, match="does not record who wrote its values .* new folder"):
        collect(model_a, PROMPTS, tmp_path, batch_size=1, progress=False, shard=(1, 2))


# -- rows, by NumPy's rules ------------------------------------------------------------------------

def test_row_reads_follow_numpy_indexing_of_the_whole_tensor(model_a, tmp_path):
    collection = collect(model_a, PROMPTS, tmp_path, positions="all", batch_size=3, progress=False)
    truth = stored(tmp_path)  # written by the shards, read without nnterp
    rows = len(truth)
    assert collection.rows == rows > 30 and torch.equal(collection["layer_output"], truth)
    whole = truth.numpy()
    mask = np.arange(rows) % 3 == 1
    keys = [slice(5, 2), slice(5, 2, -1), slice(None, None, -1), slice(-3, None), slice(-100, 100), slice(100, 200),
            slice(rows - 1, 0, -4), slice(-1, -8, -2), slice(2, 30, 7), slice(None), Ellipsis,
            0, 7, -1, -rows, np.int64(3), torch.tensor(3), torch.tensor([20]), [20], np.array([20]), [],
            [-1, 0, -1, 5], range(2, 9, 3), np.array([2, -2]), torch.tensor([[0, 1], [rows - 1, 2]]), mask,
            mask.tolist(), torch.from_numpy(mask), torch.tensor([3, 1], dtype=torch.int32)]
    for key in keys:
        as_numpy = key.numpy() if isinstance(key, torch.Tensor) else key
        expected = torch.from_numpy(np.array(whole[as_numpy]))  # a copy: NumPy views may step backwards
        got = collection["layer_output", key]
        assert got.shape == expected.shape and torch.equal(got, expected), key
    for key in [rows, -rows - 1, [0, rows], torch.tensor([rows]), [1.0], np.array([0.5]), mask[:-1]]:
        as_numpy = key.numpy() if isinstance(key, torch.Tensor) else key
        with pytest.raises(IndexError):
            whole[as_numpy]
        with pytest.raises(IndexError, match="beyond this collection's|row indices are integers|one entry per row"):
            collection["layer_output", key]
    for key in [True, torch.tensor(False), "3", 2.0, (4, 1)]:  # NumPy: an axis added, a refusal, two axes
        with pytest.raises(TypeError, match="row"):
            collection["layer_output", key]
