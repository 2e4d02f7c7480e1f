"""Remote execution on the real NDIF server (PyPI ``ndif``), from the suite's own Python.

``tests/remote/ndif/harness.py`` starts NDIF's pieces on loopback from the venv ``tests/remote/ndif/setup.sh`` makes (Python 3.12,
as NDIF requires; this client runs the suite's Python): Redis, an S3-compatible store, Ray with a logical GPU, NDIF's
controller, API and model actors (NDIF's own, minus their CUDA calls). Tiny checkpoints are deployed under made-up repo
ids; the client reaches them with ``remote=True`` as it reaches NDIF. The server has torch, transformers and nnsight,
not nnterp: only what a request ships runs there. Every result is compared bit for bit with the same code run locally
(one torch thread on both sides: the suite sets it here, the server's actors run with one).

The in-house simulation (test_remote.py) covers every family without a server; this covers what only the real server
shows: another Python than the client's, NDIF's queue and actor, its two ways back for a result (inline under its cap,
through the object store above it) and its non-blocking mode.
"""

from __future__ import annotations

import math
import time

import nnsight
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteBackend

from nnterp import (
    Prompt,
    StandardizedTransformer,
    run_prompts,
    run_with_cache,
)
from nnterp import test_prompt as answer_ranks  # under its own name, pytest would collect it
from nnterp.families import BY_MODEL_TYPE

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import CASES, IDS
from ..remote.ndif.harness import deployed, unavailable
from ..remote.test_remote import (
    assert_heads_run_remotely,
    assert_same,
    assert_tools_run_remotely,
    edit_everything,
    every_run,
    read_everything,
)

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no real NDIF server here: {REASON}")

# made-up repo id -> the tiny model's config: two standard families, a hybrid and a looped model
MODELS = {"nnterp-ci/gpt2": CASES["gpt2"][0], "nnterp-ci/llama": CASES["llama"][0],
          "nnterp-ci/jamba": BY_MODEL_TYPE["jamba"].tiny_config, "nnterp-ci/dory": BY_MODEL_TYPE["dory"].tiny_config}


@pytest.fixture(scope="module")
def ndif():
    """One server for the module: started, the models deployed; the client pointed at it; stopped at the end."""
    with deployed({repo: build_tiny(config()) for repo, config in MODELS.items()}, tiny_tokenizer()) as server:
        yield server


@pytest.fixture
def arrivals(ndif, monkeypatch):
    """How each result came back: ``"inline"`` (on the websocket) or ``"store"`` (a presigned object-store URL)."""
    seen = []
    download = RemoteBackend.download_result

    def spy(self, data):
        seen.append("inline" if isinstance(data, (bytes, bytearray)) else "store")
        return download(self, data)

    monkeypatch.setattr(RemoteBackend, "download_result", spy)
    return seen


def load(repo: str, **kwargs) -> StandardizedTransformer:
    return StandardizedTransformer(repo, attention_values=True, **kwargs)


@pytest.mark.parametrize("repo", ["nnterp-ci/gpt2", "nnterp-ci/llama"])
def test_every_value_and_edit_runs_on_ndif_bit_exactly(repo, arrivals):
    model = load(repo)
    local, remote = read_everything(model, False), read_everything(model, True)
    assert any(key.endswith("attention_probabilities") for key in local)  # the attention's values too
    assert_same(local, remote)
    assert_same(edit_everything(model, False), edit_everything(model, True))
    assert arrivals == ["inline", "inline"]


def test_a_model_loaded_without_weights_runs_on_ndif_and_stays_without_them(arrivals):
    lazy = load("nnterp-ci/llama", dispatch=False)
    remote = read_everything(lazy, True)
    prompts = [Prompt.from_strings("the cat sat on the", {"mat": "mat", "dog": "dog"}, lazy.tokenizer)]
    remote_targets = run_prompts(lazy, prompts, progress=False, remote=True)
    assert not lazy.dispatched and all(p.device.type == "meta" for p in lazy._module.parameters())
    local = load("nnterp-ci/llama")
    assert_same(read_everything(local, False), remote)
    assert_same(run_prompts(local, prompts, progress=False), remote_targets)
    assert len(arrivals) == 2


def test_a_hybrid_runs_on_ndif(arrivals):
    """Jamba's values and edits on the server, within float32 rounding. Seen on an AVX2-only AMD EPYC: the server's
    Mamba mixer output differs from the client's by up to 4e-9 (an ulp; the server's torch is PyPI's CUDA build, the
    client's the CPU build), though plain forwards of the two builds agree there; on other machines it is bit for bit.
    The in-house simulation (test_remote.py), on the client's build, checks every hybrid family bit for bit."""
    model = load("nnterp-ci/jamba")
    assert "mixer_output" in model.order(0) and "self_attn.attention_output" not in model.order(0)
    assert_same(read_everything(model, False), read_everything(model, True), rounding=True)
    assert_same(edit_everything(model, False), edit_everything(model, True), rounding=True)
    assert len(arrivals) == 2


def test_the_runs_of_a_looped_block_run_on_ndif_bit_exactly(arrivals):
    model = load("nnterp-ci/dory")
    looped = next(i for i in range(model.num_layers) if model.runs_of(i) > 1)
    local, remote = every_run(model, False), every_run(model, True)
    assert any(key.startswith(f"{looped}.1.") for key in local) and not torch.equal(local["edited"], local["logits"])
    assert_same(local, remote)
    assert len(arrivals) == 2


def test_every_research_tool_runs_on_ndif_bit_exactly(arrivals, tmp_path):
    model = load("nnterp-ci/gpt2")
    prompts = assert_tools_run_remotely(model, tmp_path)
    logits, cache = run_with_cache(model, prompts)
    logits_remote, cache_remote = run_with_cache(model, prompts, remote=True)
    assert torch.equal(logits, logits_remote) and cache.keys() == cache_remote.keys()
    assert ("attention_probabilities", 1) in cache
    for key in cache:
        assert torch.equal(cache[key], cache_remote[key]), key
    assert answer_ranks(model, "the cat sat on the", "mat", print_results=False) == \
           answer_ranks(model, "the cat sat on the", "mat", print_results=False, remote=True)
    assert_heads_run_remotely(model)
    assert arrivals and set(arrivals) == {"inline"}


def test_a_non_blocking_request_is_polled_until_its_result_is_in_the_object_store(arrivals):
    model = load("nnterp-ci/llama")
    with torch.no_grad(), model.trace(IDS):
        local = nnsight.save({"mid": model.layers[1].layer_mid, "logits": model.logits})
    with torch.no_grad(), model.trace(IDS, remote=True, blocking=False) as tracer:
        saved = nnsight.save({"mid": model.layers[1].layer_mid, "logits": model.logits})
    backend = tracer.backend
    assert backend.job_id  # submitted; the trace returned without waiting
    deadline = time.monotonic() + 120
    while (result := backend()) is None:
        assert time.monotonic() < deadline, f"the job was not done within 120 s (last status: {backend.status})"
        time.sleep(0.2)
    saved = result["saved"]  # the poll returns the saves by name (nothing is written into this frame)
    assert_same(local, saved)
    assert arrivals == ["store"]  # a non-blocking job has no socket to come back on


def test_a_result_over_the_inline_cap_comes_back_through_the_object_store(ndif, arrivals):
    model = load("nnterp-ci/llama")
    cap = ndif.max_inline_bytes()
    rows = math.ceil(1.5 * cap / (64 * model.vocab_size * 4))  # logits [rows, 64, vocab] in float32
    ids = torch.randint(3, model.vocab_size, (rows, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), model.trace(ids):
        local = nnsight.save(model.logits)
    with torch.no_grad(), model.trace(ids, remote=True):
        remote = nnsight.save(model.logits)
    assert local.numel() * 4 > cap and torch.equal(local, remote)
    with torch.no_grad(), model.trace(IDS, remote=True):
        nnsight.save(model.logits)
    assert arrivals == ["store", "inline"]  # and a small one inline, as the rest of this module's
