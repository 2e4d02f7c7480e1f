"""Collection at dataset scale: memory-mapped row reads, workers splitting one prompt list, the early
stop and the background writer, export to ``datasets``.

Ground truth is what was written (shards read with plain safetensors, or files written by hand),
a plain forward with PyTorch hooks on the same padded batch, or a collection made by one worker.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from nnterp import Collection, StandardizedTransformer, collect
from nnterp.collection import CollectionError
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer

PROMPTS = ["the cat sat on the mat", "Paris is in", "a dog", "the Eiffel Tower is in the city of Paris",
           "Rome", "the mat is on the cat", "city of Rome", "a cat sat", "the dog sat on a mat", "Tower",
           "on the mat", "the city"]


@pytest.fixture(scope="module")
def llama():
    return StandardizedTransformer(build_tiny(BY_MODEL_TYPE["llama"].tiny_config()), tokenizer=tiny_tokenizer())


def stored(folder, name):
    """Every shard's rows of ``name``, read with plain safetensors in the manifest's order."""
    shards = {}
    for manifest in folder.glob("manifest*.json"):
        shards.update(json.loads(manifest.read_text())["shards"])
    return torch.cat([load_file(folder / shards[start]["file"])[name] for start in sorted(shards, key=int)])


def hooked_batch_outputs(model, batch, layers):
    """Block outputs at the real tokens of one padded batch, by a plain forward with hooks: [tokens, layers, hidden].

    Each left-padded row counts its positions from its own first token, as a trace runs it.
    """
    inputs = model.tokenizer(batch, return_tensors="pt", padding=True)
    assert model.tokenizer.padding_side == "left"
    positions = (inputs.attention_mask.cumsum(-1) - 1).clamp(min=0)
    outputs = {}
    blocks = model.layers._module
    handles = [blocks[i].register_forward_hook(
        lambda m, a, o, i=i: outputs.__setitem__(i, o[0] if isinstance(o, tuple) else o)) for i in layers]
    try:
        with torch.no_grad():
            model._module(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, position_ids=positions)
    finally:
        for handle in handles:
            handle.remove()
    mask = inputs.attention_mask.bool()
    return torch.stack([outputs[i][mask] for i in layers], dim=1)


# -- memory-mapped reads ---------------------------------------------------------------------------

def test_row_reads_equal_the_stored_rows_in_bfloat16(llama, tmp_path):
    wide = collect(llama, PROMPTS, tmp_path / "f32", positions="all", batch_size=5, progress=False)
    narrow = collect(llama, PROMPTS, tmp_path / "bf16", positions="all", batch_size=5, dtype=torch.bfloat16,
                     progress=False)
    truth = stored(tmp_path / "bf16", "layer_output")
    assert truth.dtype == torch.bfloat16 and torch.equal(truth, stored(tmp_path / "f32", "layer_output").bfloat16())
    rows = len(truth)
    assert narrow.rows == rows and wide.rows == rows
    assert torch.equal(narrow["layer_output"], truth)
    shards = json.loads((tmp_path / "bf16" / "manifest.json").read_text())["shards"]
    edges = torch.tensor([0] + [shards[start]["rows"] for start in sorted(shards, key=int)]).cumsum(0).tolist()
    # reads that start, end and cross at shard edges, with steps, backwards, empty
    for key in [slice(3, 40), slice(edges[1] - 1, edges[2] + 1), slice(edges[1], edges[2]), slice(-7, None),
                slice(1, None, 4), slice(None, None, -3), slice(rows - 1, 0, -5), slice(10, 10)]:
        rows_by_python = torch.arange(*key.indices(rows))  # Python's own slice rules
        assert torch.equal(narrow["layer_output", key], truth[rows_by_python]), key
    assert torch.equal(narrow["layer_output", -1], truth[-1])
    assert torch.equal(narrow["layer_output", torch.tensor(edges[1])], truth[edges[1]])
    assert torch.equal(narrow["layer_output", [edges[2], 0, edges[2], rows - 1]], truth[[edges[2], 0, edges[2], rows - 1]])
    with pytest.raises(IndexError, match=f"beyond this collection's {rows} rows"):
        narrow["layer_output", rows]
    with pytest.raises(TypeError, match="collection\\[value, rows\\]"):
        narrow["layer_output", 0, 1]


def test_opening_without_checksums_still_finds_a_truncated_shard(llama, tmp_path):
    collect(llama, PROMPTS, tmp_path, batch_size=5, progress=False)
    shard = tmp_path / "batch-000000005.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))  # one bit flipped, same size
    with pytest.raises(CollectionError, match="batch 5: .* checksum differs"):
        Collection(tmp_path)
    assert Collection(tmp_path, verify=False).complete  # only the size is checked: a flipped bit passes
    shard.write_bytes(whole[:-1])
    with pytest.raises(CollectionError, match="batch 5: .* size differs"):
        Collection(tmp_path, verify=False)

CAPPED_READ = """
import resource, sys, torch
from nnterp.collection import Collection

collection = Collection(sys.argv[1])  # opening checks every shard's checksum, reading in small chunks
data_kib = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmData")))
cap = data_kib * 1024 + int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.RLIM_INFINITY))
print("cap", cap)
for start, stop in [(0, 3), (1020, 1030), (40000, 40100), (65530, 65536)]:
    rows = collection["layer_output", start:stop]
    expected = torch.arange(start, stop)[:, None, None] * 4 + torch.arange(2)[None, :, None] + torch.zeros(1024)
    print("rows", start, stop, torch.equal(rows, expected))
try:
    collection["layer_output"]
    print("whole: loaded")
except (MemoryError, RuntimeError) as error:
    print("whole: refused", type(error).__name__)
"""


def test_a_collection_larger_than_the_memory_cap_is_read_by_rows(tmp_path):
    """512 MiB of shards read under a data limit of 64 MiB above the open collection's own: rows come, the whole does not."""
    rows_per_shard, shards, hidden = 1024, 64, 1024
    manifest = {}
    for shard in range(shards):  # written by hand in the documented format: row r, layer l holds 4 r + l
        first = shard * rows_per_shard
        values = (torch.arange(first, first + rows_per_shard)[:, None, None] * 4 + torch.arange(2)[None, :, None]
                  + torch.zeros(hidden)).contiguous()
        name = f"batch-{first:09d}.safetensors"
        save_file({"layer_output": values, "_tokens_per_prompt": torch.ones(rows_per_shard, dtype=torch.int64)},
                  tmp_path / name)
        manifest[str(first)] = {"file": name, "rows": rows_per_shard,
                                "sha256": hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}
    settings = {"prompts": rows_per_shard * shards, "values": ["layer_output"], "layers": [0, 1], "positions": "last",
                "batch_size": rows_per_shard, "fingerprint": "by hand"}
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 2, "settings": settings, "shards": manifest}))
    size = sum(path.stat().st_size for path in tmp_path.glob("*.safetensors"))
    headroom = 64 << 20
    out = subprocess.run([sys.executable, "-c", CAPPED_READ, str(tmp_path), str(headroom)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    cap = int(lines[0].split()[1])
    assert size > 512 << 20 and cap < size  # the whole collection is larger than all the memory the reader may hold
    assert lines[1:5] == [f"rows {a} {b} True" for a, b in [(0, 3), (1020, 1030), (40000, 40100), (65530, 65536)]]
    assert lines[5].startswith("whole: refused")  # the cap bites: loading everything fails under it


# -- workers ---------------------------------------------------------------------------------------

def test_two_workers_make_the_one_worker_collection_bit_for_bit(llama, tmp_path):
    values = ["layer_output", "mlp_output"]
    one = collect(llama, PROMPTS, tmp_path / "one", values, positions="all", batch_size=3, progress=False)
    half = collect(llama, PROMPTS, tmp_path / "two", values, positions="all", batch_size=3, progress=False,
                   shard=(1, 2))
    assert half.missing == [0, 6]  # worker 1 took batches 1 and 3 of 4, nothing else
    both = collect(llama, PROMPTS, tmp_path / "two", values, positions="all", batch_size=3, progress=False,
                   shard=(0, 2))
    files = [set(json.loads((tmp_path / "two" / f"manifest-{rank}-of-2.json").read_text())["shards"])
             for rank in (0, 1)]
    assert files == [{"0", "6"}, {"3", "9"}]  # no batch written twice
    assert both.complete and both.rows == one.rows
    for name in values:
        assert torch.equal(both[name], one[name])
    assert torch.equal(both.offsets, one.offsets)
    # and the rows are in the prompt order: each prompt's rows are its own batch's hooked outputs
    for start in range(0, len(PROMPTS), 3):
        rows = slice(int(both.offsets[start]), int(both.offsets[start + 3]))
        assert torch.equal(both["layer_output", rows], hooked_batch_outputs(llama, PROMPTS[start:start + 3], range(3)))


def test_a_worker_resumes_what_another_left_undone(llama, tmp_path):
    one = collect(llama, PROMPTS, tmp_path / "one", batch_size=4, progress=False)
    collect(llama, PROMPTS, tmp_path / "two", batch_size=4, progress=False, shard=(0, 3))
    finished = collect(llama, PROMPTS, tmp_path / "two", batch_size=4, progress=False)  # one worker does the rest
    assert finished.complete and torch.equal(finished["layer_output"], one["layer_output"])
    assert set(json.loads((tmp_path / "two" / "manifest.json").read_text())["shards"]) == {"4", "8"}


def test_workers_with_other_arguments_are_refused(llama, tmp_path):
    collect(llama, PROMPTS, tmp_path, batch_size=4, progress=False, shard=(0, 2))
    with pytest.raises(CollectionError, match="other settings"):
        collect(llama, PROMPTS[:6], tmp_path, batch_size=4, progress=False, shard=(1, 2))
    for shard, message in [((2, 2), "from 0 to world - 1 = 1"), ((0,), "shard is \\(rank, world\\)"),
                           (("a", 2), "shard is \\(rank, world\\)"), ((-1, 2), "from 0 to world - 1")]:
        with pytest.raises(ValueError, match=message):
            collect(llama, PROMPTS, tmp_path / "bad", shard=shard, progress=False)


# -- throughput: early stop, background writer -----------------------------------------------------

def test_the_forward_stops_after_the_last_layer_read(llama, tmp_path):
    started = {"block 1": 0, "block 2": 0, "lm_head": 0}
    count = lambda part: (lambda *_: started.__setitem__(part, started[part] + 1))
    blocks = llama.layers._module
    handles = [blocks[1].register_forward_pre_hook(count("block 1")),
               blocks[2].register_forward_pre_hook(count("block 2")),
               llama._module.lm_head.register_forward_pre_hook(count("lm_head"))]
    try:
        early = collect(llama, PROMPTS, tmp_path / "early", layers=[1, 0], positions="all", batch_size=4,
                        progress=False)
    finally:
        for handle in handles:
            handle.remove()
    assert started == {"block 1": 3, "block 2": 0, "lm_head": 0}  # three batches, none past block 1
    truth = torch.cat([hooked_batch_outputs(llama, PROMPTS[s:s + 4], [1, 0]) for s in range(0, len(PROMPTS), 4)])
    assert torch.equal(early["layer_output"], truth)  # unchanged, bit for bit


def test_a_failed_write_is_a_collection_error_and_resumes(llama, tmp_path, monkeypatch):
    import nnterp.collection.shards as module

    real_save, calls = module.save_file, []

    def disk_full_on_second(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(tensors, path)

    monkeypatch.setattr(module, "save_file", disk_full_on_second)
    with pytest.raises(CollectionError, match="writing batch 4 .* No space left on device.* run collect again"):
        collect(llama, PROMPTS, tmp_path / "c", batch_size=4, progress=False)
    monkeypatch.setattr(module, "save_file", real_save)
    partial = Collection(tmp_path / "c")
    assert partial.missing == [4, 8]
    resumed = collect(llama, PROMPTS, tmp_path / "c", batch_size=4, progress=False)
    fresh = collect(llama, PROMPTS, tmp_path / "fresh", batch_size=4, progress=False)
    assert resumed.complete and torch.equal(resumed["layer_output"], fresh["layer_output"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_copies_on_cuda_give_the_cpu_rows(llama, tmp_path):
    import copy

    cuda = StandardizedTransformer(copy.deepcopy(llama._module).cuda(), tokenizer=tiny_tokenizer())
    on_cuda = collect(cuda, PROMPTS, tmp_path / "cuda", positions="all", batch_size=4, progress=False)
    truth = torch.cat([hooked_batch_outputs(cuda, PROMPTS[s:s + 4], range(3)).cpu() for s in range(0, len(PROMPTS), 4)])
    assert torch.equal(on_cuda["layer_output"], truth)


# -- datasets --------------------------------------------------------------------------------------

def test_to_dataset_holds_the_stored_values(llama, tmp_path):
    pytest.importorskip("datasets")
    collection = collect(llama, PROMPTS, tmp_path / "c", ["layer_output", "mlp_output"], layers=[2, 0],
                         positions="all", batch_size=5, dtype=torch.bfloat16, progress=False)
    dataset = collection.to_dataset(cache_dir=tmp_path / "cache")
    assert len(dataset) == collection.rows and set(dataset.column_names) == {"prompt", "layer_output", "mlp_output"}
    dataset = dataset.with_format("torch")[:]  # every row, as tensors
    for name in ("layer_output", "mlp_output"):
        assert torch.equal(dataset[name], stored(tmp_path / "c", name).float())  # bfloat16 widens exactly
    offsets = collection.offsets
    counts = offsets[1:] - offsets[:-1]
    assert torch.equal(dataset["prompt"], torch.repeat_interleave(torch.arange(len(PROMPTS)), counts))
    only = collection.to_dataset(["mlp.mlp_output"], cache_dir=tmp_path / "cache")
    assert only.column_names == ["prompt", "mlp_output"]


def test_to_dataset_without_datasets_names_the_install(llama, tmp_path, monkeypatch):
    collection = collect(llama, PROMPTS[:2], tmp_path, progress=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install 'nnterp\\[datasets\\]'"):
        collection.to_dataset()


def test_the_manifest_is_rewritten_at_most_once_a_second_and_on_the_way_out(llama, tmp_path, monkeypatch):
    import time

    import nnterp.collection.shards as module

    writes, real = [], module.write_manifest
    monkeypatch.setattr(module, "write_manifest", lambda *args: writes.append(1) or real(*args))
    began = time.monotonic()
    done = collect(llama, PROMPTS, tmp_path, batch_size=1, progress=False)
    elapsed = time.monotonic() - began
    assert len(writes) <= 2 + elapsed / module.RECORD_EVERY_S  # not once per batch: 12 batches here
    assert done.complete and done.rows == len(PROMPTS)  # every shard recorded on the way out
