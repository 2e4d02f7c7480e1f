"""Remote execution without a server: every payload runs in another process where nnterp cannot be imported.

``model.trace(..., remote=True)`` goes through nnsight's own remote path (model key, environment,
``RequestModel.serialize`` after registering what ships by value); only the network hop is
replaced: the payload goes to ``remote_server.py``, a separate process that builds a plain
``TransformersModel`` from the request's model key, resolves every module id against *its own*
module tree, runs the block and sends the saved values back. Each result is compared bit for bit
with the same code run locally.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import nnsight
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteBackend
from nnsight.modeling import huggingface

import nnterp.core.remote_env
from nnterp import (
    Prompt,
    StandardizedTransformer,
    activation_patching,
    collect,
    logit_difference,
    logit_lens,
    patchscope_lens,
    run_prompts,
    steered_generate,
)
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.spec.locations import Unavailable

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import CASES, IDS

SERVER = Path(__file__).with_name("remote_server.py")


class RemoteFailure(Exception):
    """The server could not run a payload."""


class Server:
    """One long-lived server process; requests and answers are pickles on its stdin and stdout."""

    def __init__(self, log: Path):
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
        self.log = log
        self.process = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log.open("wb"), env=env, cwd=SERVER.parent)

    def run(self, request: dict, blob: bytes) -> dict:
        pickle.dump({**request, "blob": blob}, self.process.stdin)
        self.process.stdin.flush()
        try:
            answer = pickle.load(self.process.stdout)
        except EOFError:
            raise RemoteFailure(f"the server process died: {self.log.read_text()[-3000:]}") from None
        if "error" in answer:
            raise RemoteFailure(f"{answer['error']}\n{answer['traceback']}")
        import io

        return torch.load(io.BytesIO(answer["saves"]), weights_only=False)

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("server") / "server.log")
    yield server
    server.close()


@pytest.fixture
def requests(server, monkeypatch):
    """``remote=True`` reaches the server process; the requests it sent are recorded."""
    sent = []

    def request(backend, request_model, tracer):
        blob = backend._serialize(tracer)  # nnsight's own: registers what ships by value, then serializes
        request = {"model_key": request_model.model_key, "env": request_model.env, "compress": request_model.compress}
        sent.append({**request, "bytes": len(blob)})
        return server.run(request, blob)

    monkeypatch.setattr(RemoteBackend, "request", request)
    # the server's Python, which a request is checked against before it is sent: this process's, as the server's is
    monkeypatch.setattr(nnterp.core.remote_env, "server_env", lambda host=None: {"python_version": sys.version})
    return sent


def saved_folder(case: str, root: Path) -> str:
    """The case's tiny model as a checkpoint folder; its repo id is the folder (no hub lookup)."""
    folder = root / case
    if not folder.is_dir():
        build_tiny(CASES[case][0]()).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
    huggingface._ID_CACHE[str(folder)] = str(folder)
    return str(folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


def load(case: str, root: Path) -> StandardizedTransformer:
    config = CASES[case][0]()
    internals = not isinstance(BY_MODEL_TYPE[config.model_type].attention_of(config.get_text_config()), Unavailable)
    return StandardizedTransformer(saved_folder(case, root), attention_values=internals)


def without_unswitchable_attention(model: StandardizedTransformer, requests: list) -> StandardizedTransformer:
    """A model whose own attention code runs sdpa until switched (Falcon): the server switches through transformers,
    which refuses the class, so the attention values are refused before any request; the rest runs."""
    switchable = getattr(type(model._module), "_can_set_attn_implementation", lambda: True)()
    if model._nnterp_attention_on and not switchable and model._module.config._attn_implementation != "eager":
        with pytest.raises(ValueError, match="cannot run remotely on .*disable_attention_values"):
            read_everything(model, True)
        assert not requests
        model.disable_attention_values()
    return model


def envoy_of(model, layer: int, key: str):
    owner, _, name = key.rpartition(".")
    block = model.layers[layer]
    return (getattr(block, owner) if owner else block), name


def read_everything(model, remote):
    """Every available value of every block, by its standard name, in forward order, and the logits."""
    with torch.no_grad(), model.trace(IDS, remote=remote):
        saved = nnsight.save({})
        for layer in range(model.num_layers):
            for key in sorted(model.order(layer), key=model.order(layer).get):
                envoy, name = envoy_of(model, layer, key)
                saved[f"{layer}.{key}"] = getattr(envoy, name)
        saved["logits"] = model.logits
    return saved


# views of a split (GPT-2's fused q/k/v projection) cannot be edited in place under autograd, which a
# server may run with: those are assigned instead
SPLIT_VIEWS = ("self_attn.queries", "self_attn.keys", "self_attn.values")


def edit_everything(model, remote):
    """Every available value of block 0 scaled in place, every value of block 1 assigned, then the logits.

    With autograd on, as a trace runs by default (and as a server may run it).
    """
    with model.trace(IDS, remote=remote):
        for layer, assign in ((0, False), (1, True)):
            for key in sorted(model.order(layer), key=model.order(layer).get):
                envoy, name = envoy_of(model, layer, key)
                if assign or key in SPLIT_VIEWS:
                    setattr(envoy, name, getattr(envoy, name) * 0.75)
                else:
                    getattr(envoy, name)[:] *= 1.25
        logits = nnsight.save(model.logits.detach())
    return logits


def assert_same(local, remote, rounding: bool = False):
    """Bit for bit; or, with ``rounding``, within float32 rounding of each tensor's size (1e-5 of its largest
    entry)."""
    assert type(local) is type(remote)
    if not isinstance(local, dict):
        local, remote = {"": local}, {"": remote}
    assert local.keys() == remote.keys()
    for key in local:
        if rounding:
            a, b = local[key].float(), remote[key].float()
            difference = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-30)
            assert a.shape == b.shape and difference <= 1e-5, (key, difference)
        else:
            assert torch.equal(local[key], remote[key]), key


@pytest.mark.parametrize("case", list(CASES))
def test_every_value_and_edit_runs_remotely_bit_exactly(case, checkpoints, requests):
    model = without_unswitchable_attention(load(case, checkpoints), requests)
    assert_same(read_everything(model, False), read_everything(model, True))
    assert_same(edit_everything(model, False), edit_everything(model, True))
    assert requests and all(r["model_key"].startswith("nnsight.modeling.transformers.TransformersModel:")
                            for r in requests)
    if model.family.attention_of(model._nnterp_text_config) is not None and model._nnterp_attention_on:
        assert all(r["env"]["attn_implementation"] == "eager" for r in requests)


TOOL_CASES = ["gpt2", "llama", "opt", "gpt_oss", "falcon_7b_parallel", "gemma2", "deepseek_v4"]


def assert_tools_run_remotely(model, tmp_path) -> list[str]:
    """The logit lens, patching, patchscopes, steering, collection and the identity check, local and remote: equal
    bit for bit. Returns the prompts it used."""
    prompts = ["the cat sat on the mat", "Paris is in"]
    assert_same(logit_lens(model, prompts), logit_lens(model, prompts, remote=True))
    metric = logit_difference(5, 6)
    assert_same(activation_patching(model, "the cat sat", "the dog sat", metric, layers=[0, 2]),
                activation_patching(model, "the cat sat", "the dog sat", metric, layers=[0, 2], remote=True))
    assert_same(patchscope_lens(model, prompts, "the cat is"), patchscope_lens(model, prompts, "the cat is", remote=True))
    vector = torch.linspace(-1, 1, model.hidden_size)
    assert_same(steered_generate(model, "the cat", 1, vector, factor=4.0, max_new_tokens=3),
                steered_generate(model, "the cat", 1, vector, factor=4.0, max_new_tokens=3, remote=True))
    values = ["layer_output", "mlp.mlp_output"]
    here = collect(model, prompts * 3, tmp_path / "local", values, positions="all", batch_size=4, progress=False)
    there = collect(model, prompts * 3, tmp_path / "remote", values, positions="all", batch_size=4, progress=False,
                    remote=True)
    for name in values:
        assert torch.equal(here[name], there[name])
    assert [(r.exact, r.max_abs_diff) for r in check_identity(model)] == \
           [(r.exact, r.max_abs_diff) for r in check_identity(model, remote=True)]
    return prompts


@pytest.mark.parametrize("case", TOOL_CASES)
def test_research_tools_run_remotely_bit_exactly(case, checkpoints, requests, tmp_path):
    model = without_unswitchable_attention(load(case, checkpoints), requests)
    assert_tools_run_remotely(model, tmp_path)
    if model._nnterp_attention_on and case != "deepseek_v4":
        assert_heads_run_remotely(model)


def assert_heads_run_remotely(model) -> None:
    """Block 1's head outputs, and the logits with two of its heads scaled, local and remote: equal bit for bit."""
    def heads_and_scaled(remote):
        with torch.no_grad(), model.trace(IDS, remote=remote):
            heads = nnsight.save(model.head_outputs(1))
            model.scale_heads(1, [0, 2], 0.5)
            logits = nnsight.save(model.logits)
        return heads, logits

    (heads, logits), (heads_remote, logits_remote) = heads_and_scaled(False), heads_and_scaled(True)
    assert torch.equal(heads, heads_remote) and torch.equal(logits, logits_remote)


def test_a_model_loaded_without_weights_runs_remotely_and_stays_without_them(checkpoints, requests):
    """The NDIF workflow: the weights live on the server; the client never loads them."""
    folder = saved_folder("llama", checkpoints)
    lazy = StandardizedTransformer(folder, dispatch=False, attention_values=True)
    remote = read_everything(lazy, True)
    assert not lazy.dispatched and all(p.device.type == "meta" for p in lazy._module.parameters())
    prompts = [Prompt.from_strings("the cat sat on the", {"mat": "mat", "dog": "dog"}, lazy.tokenizer)]
    remote_targets = run_prompts(lazy, prompts, progress=False, remote=True)
    assert not lazy.dispatched
    local = StandardizedTransformer(folder, attention_values=True)
    assert_same(read_everything(local, False), remote)
    local_targets = run_prompts(local, prompts, progress=False)
    assert local_targets.keys() == remote_targets.keys()
    assert all(torch.equal(local_targets[k], remote_targets[k]) for k in local_targets)


def test_a_module_the_server_lacks_fails_the_request(checkpoints, requests):
    """The harness resolves module ids against the server's own tree: a client-side addition is refused."""
    model = load("gpt2", checkpoints)
    model._module.transformer.h[0].add_module("probe", torch.nn.Identity())
    extra = StandardizedTransformer(model._module, tokenizer=model.tokenizer)
    with pytest.raises(RemoteFailure, match="Module:model.transformer.h.0.probe"):
        with extra.trace(IDS, remote=True):
            nnsight.save(extra.layers[0].layer_output)


@pytest.mark.parametrize("case", ["gpt2", "gptj"])
def test_run_with_cache_and_test_prompt_run_remotely_bit_exactly(case, checkpoints, requests):
    model = load(case, checkpoints)
    prompts = ["the cat sat on the mat", "Paris is in"]
    logits, cache = model.run_with_cache(prompts)
    logits_remote, cache_remote = model.run_with_cache(prompts, remote=True)
    assert torch.equal(logits, logits_remote) and cache.keys() == cache_remote.keys()
    assert not logits_remote.requires_grad and not any(cache_remote[key].requires_grad for key in cache_remote)
    assert ("attention_probabilities", 1) in cache  # the internals too, where the family has them
    for key in cache:
        assert torch.equal(cache[key], cache_remote[key]), key
    answer = [model.test_prompt("the cat sat on the", "mat", print_results=False, remote=remote) for remote in (0, 1)]
    assert answer[0] == answer[1] and requests


@pytest.mark.parametrize("model_type", ["jamba", "granitemoehybrid", "lfm2"])
def test_a_hybrid_runs_remotely_bit_exactly(model_type, checkpoints, requests):
    """Blocks with and without attention (block 0 mixes tokens otherwise, block 1 with attention), mixer_output
    included, and Granite-4.0-H's MLP contribution read inside the block's own code."""
    folder = checkpoints / model_type
    build_tiny(BY_MODEL_TYPE[model_type].tiny_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    huggingface._ID_CACHE[str(folder)] = str(folder)
    model = StandardizedTransformer(str(folder), attention_values=True)
    assert "mixer_output" in model.order(0) and "self_attn.attention_output" not in model.order(0)
    assert_same(read_everything(model, False), read_everything(model, True))
    assert_same(edit_everything(model, False), edit_everything(model, True))
    assert requests


@pytest.mark.parametrize("model_type", ["recurrent_gemma", "falcon_h1", "gpt_neox_japanese", "granitemoeshared",
                                        "qwen4_exp_text", "got_ocr2", "zamba2", "mamba", "reformer",
                                        "gemma3n_text", "inkling2_text", "minimax", "openai-gpt"])
def test_other_topologies_run_remotely_bit_exactly(model_type, checkpoints, requests):
    """Values read at operations inside a block's code (Falcon-H1's scaled attention, GPT-NeoX-Japanese's bias add,
    Granite's summed mixture), an attention found by its class (RecurrentGemma), a widened stream (Qwen4-Exp), a
    stream passed in two halves and padded (Reformer), a decoder under a multimodal model (GOT-OCR2) and adds from the
    normed stream scaled by factors (MiniMax): every value and edit, locally and on the plain server model."""
    folder = checkpoints / model_type
    build_tiny(BY_MODEL_TYPE[model_type].tiny_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    huggingface._ID_CACHE[str(folder)] = str(folder)
    config = BY_MODEL_TYPE[model_type].tiny_config()
    internals = not isinstance(BY_MODEL_TYPE[model_type].attention_of(config.get_text_config()), Unavailable)
    model = StandardizedTransformer(str(folder), attention_values=internals)
    # GOT-OCR2's vision tower computes attention in its own code: the server cannot switch the model to eager (GPT-1's
    # own code is eager already, so its attention values run remotely)
    if model_type == "got_ocr2":
        with pytest.raises(ValueError, match="cannot run remotely on GotOcr2.*disable_attention_values"):
            read_everything(model, True)
        assert not requests
        model.disable_attention_values()
    assert_same(read_everything(model, False), read_everything(model, True))
    assert_same(edit_everything(model, False), edit_everything(model, True))
    assert requests


def every_run(model, remote) -> dict:
    """Every value of every block call of a looped model, its logits, and the logits with the second run of the first
    looped block edited (in place, and by assignment)."""
    looped = next(i for i in range(model.num_layers) if model.runs_of(i) > 1)
    with torch.no_grad(), model.trace(IDS, remote=remote):
        saved = nnsight.save({})
        for i, run in model.schedule:
            at = model.layers[i].run(run) if model.runs_of(i) > 1 else model.layers[i]
            for key in model.order(i):
                owner, _, name = key.rpartition(".")
                saved[f"{i}.{run}.{key}"] = getattr(getattr(at, owner) if owner else at, name)
        saved["logits"] = model.logits
    with torch.no_grad(), model.trace(IDS, remote=remote):
        model.layers[looped].run(1).self_attn.attention_output[:] *= 0.5
        model.layers[looped + 1].run(1).layer_input = model.layers[looped + 1].run(1).layer_input * 0.5
        edited = model.logits.save()
    return {**saved, "edited": edited}


@pytest.mark.parametrize("model_type", ["dory", "hrm_text", "inkling2_loop_text"])
def test_the_runs_of_a_looped_block_run_remotely_bit_exactly(model_type, checkpoints, requests):
    """Dory's looped section and HRM-Text's two looped stacks: every value of every run of every block, and edits
    of runs, locally and on the plain server model (a run is chosen by pinning nnsight's occurrence, which the
    server does as well)."""
    folder = checkpoints / model_type
    build_tiny(BY_MODEL_TYPE[model_type].tiny_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    huggingface._ID_CACHE[str(folder)] = str(folder)
    model = StandardizedTransformer(str(folder), attention_values=True)
    looped = next(i for i in range(model.num_layers) if model.runs_of(i) > 1)
    assert model.runs_of(looped + 1) > 1
    local, remote = every_run(model, False), every_run(model, True)
    assert set(local) == set(remote) and len(local) > 100
    for key in local:
        assert torch.equal(local[key], remote[key]), key
    assert not torch.equal(local["edited"], local["logits"]) and len(requests) == 2
