"""StandardizedVLLM serving many prompts: safe stream edits, the prefix cache, negative layers, a list of prompts,
and the types it refuses before any engine starts; against transformers with plain hooks (tests/vllm/check_engine.py
runs in the vLLM venv and prints the measurements, asserted here)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .test_vllm import MARKER, PYTHON, ROOT, VENV, needs_vllm, run_family

ENGINE = Path(__file__).with_name("check_engine.py")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def engine(request):
    if not MARKER.exists():
        pytest.skip(f"no vLLM venv at {VENV} (bash tests/vllm/setup.sh makes it)")
    return run_family(request.param, ENGINE)


def test_a_stream_edited_after_the_next_block_input_was_read_reaches_the_model(engine):
    """layers[0].layer_output edited in place after layers[1].layer_input was read: on transformers they are one
    tensor and block 1 has not run, so the edit is the hooked edit of block 0's output."""
    edit = engine["late_output_edit"]
    assert edit["moved"] > 1e-2 and edit["diff"] < 1e-4, edit


def test_a_stream_edit_vllm_can_no_longer_take_is_refused(engine):
    """Edited after vLLM's fused add copied it (block 1's norm has run; the MLP's norm has run): refused, not
    dropped. The plain families take the stream as one tensor: there the edits are not refused."""
    refused = engine["late_refused"]
    if engine["key"] == "gpt2":
        return
    for label, error in refused.items():
        assert error is not None and "BadAssignment" in error and "would not reach the model" in error, (label, error)


def test_steered_requests_and_untraced_ones_share_no_prefix_cache(engine):
    """Prefix caching on: a prompt steered first leaves no steered KV for the untraced request after it; a prompt
    generated untraced first leaves no unsteered KV for the steered one; untraced requests keep sharing."""
    for label, run in engine["prefix_cache"].items():
        assert run["expected"] != run["expected_steered"], f"{label}: the steering changes nothing"
        assert run["untraced"][0] == run["expected"], (label, run)
        assert run["steered"] == run["expected_steered"], (label, run)
        tokens, cached = run["untraced_again"]
        assert tokens == run["expected"] and cached >= 32, (label, run)  # a full block served from the cache


def test_negative_layers_count_from_the_end(engine):
    negative = engine["negative_layers"]
    assert negative["got"] == negative["expected"], negative


def test_a_list_of_prompts_is_steered_token_for_token_as_on_transformers(engine):
    batch = engine["batch"]
    assert batch["rows"] == batch["expected_rows"], batch
    assert batch["tool_rows"] == batch["expected_rows"], batch  # nnterp.steered_generate on the engine
    assert [row[-6:] for row in batch["rows"]] != batch["unsteered"], "the steering changes nothing"


def test_the_logit_lens_of_a_list_of_prompts_is_transformers_readout_of_the_hooked_streams(engine):
    lens = engine["lens"]
    assert isinstance(lens, dict), lens
    assert lens["shape"] == [2, 3, 128] and lens["diff"] < 1e-5 and lens["layers_differ"] > 1e-3, lens


def test_every_tool_runs_or_is_refused_at_its_entry_saying_why(engine):
    """Each of nnterp's tools that takes a model is in the engine's table (the refused ones with their reason,
    raised before anything runs); the ones the table says run are tested above or here."""
    tools = engine["tools"]
    table = tools["table"]
    assert set(table) == set(tools["refused"]) | set(tools["running"]), set(table) ^ (set(tools["refused"]) |
                                                                                      set(tools["running"]))
    for name in tools["refused"]:
        assert table[name].startswith(f"NotImplementedError: {name} does not run on StandardizedVLLM:"), table[name]
    assert tools["str_tokens"] == ["w5", "w6"], tools["str_tokens"]
    assert tools["top_tokens"] == [[["w5", 1.0]]] or tools["top_tokens"] == [[("w5", 1.0)]], tools["top_tokens"]


BACKEND = """
import tempfile, transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from nnterp.vllm import StandardizedVLLM
from nnterp.vllm.places import served_family
for model_type in ("mellum", "helium", "arcee", "llama", "ministral3", "llama-by-transformers", "gpt_neox", "olmo2",
                   "doge"):
    kind = model_type.partition("-")[0]
    config = transformers.AutoConfig.for_model(kind)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]]
    try:
        if model_type == "mellum":  # the constructor itself, on a folder: refused before vLLM is asked to start
            folder = tempfile.mkdtemp()
            config.save_pretrained(folder)
            StandardizedVLLM(folder)
        print(model_type, "| served as", served_family(config, "transformers" if "-" in model_type else "auto").name)
    except NotImplementedError as error:
        print(model_type, "|", error)
folder = tempfile.mkdtemp()  # a backend family under tensor parallelism: refused before an engine starts
config = transformers.AutoConfig.for_model("gpt_neox")
config.architectures = ["GPTNeoXForCausalLM"]
config.save_pretrained(folder)
try:
    StandardizedVLLM(folder, tensor_parallel_size=2)
except NotImplementedError as error:
    print("gpt_neox-tp2 |", error)
"""


@needs_vllm
def test_a_type_is_served_by_the_code_vllm_runs_for_it_or_refused_before_any_engine():
    """The code vLLM 0.32's registry runs for a type decides its placement. Llama, and Ministral-3 (vLLM runs
    Mistral's class, a Llama), on vLLM's own Llama code; Helium and Arcee, which nnterp files under Llama and vLLM
    runs through its Transformers backend, and GPT-NeoX and OLMo-2, which it runs there only, on the backend
    (nnterp/vllm/backend.py). Refused from the registry, before an engine starts (the constructor on a folder with
    no weights refuses rather than starting one): Mellum (under Mixtral, whose placement is vLLM's own code) on the
    backend, Llama forced onto it, Doge, which the backend runs otherwise than transformers, and a backend family
    under tensor parallelism."""
    done = subprocess.run([str(PYTHON), "-c", BACKEND], capture_output=True, text=True, cwd=ROOT, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(line.split(" | ", 1) for line in done.stdout.splitlines() if " | " in line)
    assert len(said) == 10, done.stdout
    assert "tensor_parallel_size=1" in said["gpt_neox-tp2"], said["gpt_neox-tp2"]
    for model_type in ("llama", "ministral3", "helium", "arcee"):
        assert said.pop(model_type) == "served as Llama", done.stdout
    assert said.pop("gpt_neox") == "served as GPT-NeoX" and said.pop("olmo2") == "served as OLMo-2", done.stdout
    assert "dynamic mask" in said["doge"] and "another model" in said["doge"], said["doge"]
    for model_type, reason in said.items():
        assert "Transformers backend" in reason and "StandardizedTransformer" in reason, (model_type, reason)
