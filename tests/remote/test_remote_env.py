"""The server's Python against the client's: which requests are refused, from fake ``/env`` answers and payloads
read without loading them; then against the real NDIF server (Python 3.12) where this machine can start it."""

from __future__ import annotations

import inspect
import sys

import nnsight
import pytest
import torch
from nnsight.intervention import serialization
from nnsight.intervention.backends.remote import RemoteBackend
from nnsight.modeling import huggingface
from nnsight.modeling.transformers import TransformersModel

from nnterp import StandardizedTransformer
from nnterp.core.remote_env import (
    MINIMUM_PYTHON,
    CheckedRemoteBackend,
    ServerPythonError,
    check_server_python,
    holds_bytecode,
    python_of,
    server_env,
)
from nnterp.spec.locations import At

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import CASES, IDS
from ..remote.ndif.harness import deployed, unavailable
from ..unit.test_shipped_code import Recorder

MAJOR, MINOR = sys.version_info[:2]


def env_of(major: int, minor: int) -> dict:
    return {"python_version": f"{major}.{minor}.1 (main, Jan  1 2026, 00:00:00) [GCC 12.2.0]", "packages": {}}


def test_python_of_reads_the_version_the_server_reports():
    assert python_of(env_of(3, 12)) == (3, 12)
    assert python_of({"python_version": "3.13.0 (main)"}) == (3, 13)
    assert python_of({}) is None and python_of({"python_version": "unknown"}) is None


def test_only_what_cannot_run_on_the_servers_python_is_refused():
    newer = env_of(MAJOR, MINOR + 1)
    for env in (env_of(MAJOR, MINOR), newer, {}):  # all source: runs on the same or a newer minor version
        check_server_python(env)
    check_server_python(env_of(MAJOR, MINOR), bytecode=True)  # bytecode of the server's own Python
    with pytest.raises(ServerPythonError, match=rf"bytecode.*server runs Python {MAJOR}\.{MINOR + 1}.*define"):
        check_server_python(newer, bytecode=True)
    with pytest.raises(ServerPythonError, match="does not say which Python"):
        check_server_python({}, bytecode=True)
    with pytest.raises(ServerPythonError, match="major versions"):
        check_server_python(env_of(MAJOR + 1, 0))
    with pytest.raises(ServerPythonError, match="older than nnterp's oldest Python"):
        check_server_python(env_of(*MINIMUM_PYTHON[:1], MINIMUM_PYTHON[1] - 1))


def made_by_exec():
    scope = {"__name__": "made_by_exec"}  # no module to find it in: it travels by value
    exec("def double(x):\n    return x * 2\ndef halve(x):\n    return x / 2\n", scope)  # no source file: bytecode
    return scope


def with_source(x):
    return x * 2


@pytest.mark.parametrize("compress", [False, True])
def test_holds_bytecode_says_what_the_pickler_wrote(compress):
    """Each payload read from its opcodes, against a pickler that records every code object it writes."""
    scope = made_by_exec()
    payloads = {"source only": (with_source, [1, 2], {"text": "CodeType"}),  # the word alone is no code
                "one sourceless function": (with_source, scope["double"]),
                "two, the second from the memo": (scope["double"], {"again": scope["halve"]}, torch.ones(3)),
                "a tensor": torch.arange(4)}
    for name, obj in payloads.items():
        Recorder.code = []
        buffer = serialization.io.BytesIO()
        Recorder(buffer, protocol=serialization.DEFAULT_PROTOCOL).dump(obj)
        blob = buffer.getvalue()
        if compress:
            import zstandard

            blob = zstandard.ZstdCompressor().compress(blob)
        assert holds_bytecode(blob, compressed=compress) == bool(Recorder.code), name
    assert not holds_bytecode(serialization.dumps(payloads["source only"]))
    assert holds_bytecode(serialization.dumps(payloads["one sourceless function"]))


@pytest.fixture
def plain_model(tmp_path):
    """nnsight's own model over a saved checkpoint (what the request carries is nnsight's and the block's alone)."""
    folder = tmp_path / "gpt2"
    build_tiny(CASES["gpt2"][0]()).save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    huggingface._ID_CACHE[str(folder)] = str(folder)
    return TransformersModel(str(folder), tokenizer=tokenizer, task="text-generation")


def checked(model):
    """The backend ``remote=True`` builds, checked."""
    return CheckedRemoteBackend.of(model._remote_backend(True, True, None, False))


def test_the_checked_backend_refuses_bytecode_for_another_python_before_sending(plain_model, monkeypatch):
    sent = []

    def request(backend, request_model, tracer):  # the network hop: the request runs here
        backend._serialize(tracer)
        sent.append(request_model.model_key)
        tracer.execute(tracer.info.code)

    monkeypatch.setattr(RemoteBackend, "request", request)
    backend = checked(plain_model)
    assert type(backend) is CheckedRemoteBackend and backend.model_key == plain_model.to_model_key()
    double = made_by_exec()["double"]
    monkeypatch.setattr("nnterp.core.remote_env.server_env", lambda host=None: env_of(MAJOR, MINOR + 1))
    with torch.no_grad(), plain_model.trace(IDS, backend=checked(plain_model)):
        doubled = nnsight.save(with_source(plain_model.transformer.h[0].output))
    assert len(sent) == 1 and doubled.shape[:2] == IDS.shape
    with pytest.raises(ServerPythonError, match="without source"):
        with torch.no_grad(), plain_model.trace(IDS, backend=checked(plain_model)):
            nnsight.save(double(plain_model.transformer.h[0].output))
    assert len(sent) == 1  # refused before it was sent
    monkeypatch.setattr("nnterp.core.remote_env.server_env", lambda host=None: env_of(MAJOR, MINOR))
    with torch.no_grad(), plain_model.trace(IDS, backend=checked(plain_model)):
        doubled = nnsight.save(double(plain_model.transformer.h[0].output))  # the same Python: the bytecode runs
    assert len(sent) == 2
    assert CheckedRemoteBackend.of("local") == "local"


def test_server_env_asks_the_host_it_is_given(monkeypatch):
    asked = []

    class Answer:
        def raise_for_status(self):
            pass

        def json(self):
            return env_of(3, 12)

    import httpx

    monkeypatch.setattr(httpx, "get", lambda url, timeout: asked.append(url) or Answer())
    assert server_env("http://127.0.0.1:1/", refresh=True) == env_of(3, 12)
    assert server_env("http://127.0.0.1:1/") == env_of(3, 12)  # once per process
    assert asked == ["http://127.0.0.1:1/env"]


# -- the real server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ndif():
    """The real NDIF server (Python 3.12) with a tiny GPT-2 deployed, as tests/remote/test_ndif_real.py starts it."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no real NDIF server here: {reason}")
    with deployed({"nnterp-ci/gpt2": build_tiny(CASES["gpt2"][0]())}, tiny_tokenizer()) as server:
        yield server


def test_the_real_servers_env_is_checked(ndif):
    env = server_env(ndif.url, refresh=True)
    assert python_of(env) >= (3, 12) and "nnsight" in env["packages"]  # NDIF needs 3.12 or later
    assert server_env(refresh=True) == env  # the configured host, through nnsight's own fetch
    check_server_python(env)  # nnterp's requests hold source only: they run on a newer Python
    if python_of(env) != sys.version_info[:2]:
        with pytest.raises(ServerPythonError, match="without source"):
            check_server_python(env, bytecode=True)


def test_records_built_and_printed_on_the_real_server_behave_as_here(ndif):
    """A frozen record built inside the block, on the server's Python, from the source the request carries
    (as bytecode of another Python it failed there: 'cell' object does not support item assignment)."""
    model = StandardizedTransformer("nnterp-ci/gpt2")

    def run(remote):
        with torch.no_grad(), model.trace(IDS, remote=remote):
            made = At("attn", "output", index=1, heads=True)
            shown = nnsight.save(repr(made))
            same = nnsight.save([made == At("attn", "output", index=1, heads=True),
                                 hash(made) == hash(At("attn", "output", index=1, heads=True)),
                                 made == At("attn", "output")])
            layer = nnsight.save(model.layers[0].layer_output)
        return shown, same, layer

    torch.set_num_threads(1)
    (shown, same, layer), (shown_there, same_there, layer_there) = run(False), run(True)
    assert shown_there == shown == repr(At("attn", "output", index=1, heads=True))
    assert same_there == same == [True, True, False]
    assert torch.equal(layer, layer_there)


def test_a_request_finds_each_source_once_and_is_the_request_nnsight_builds(tmp_path, monkeypatch):
    folder = tmp_path / "gpt2"
    build_tiny(CASES["gpt2"][0]()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.setitem(huggingface._ID_CACHE, str(folder), str(folder))
    model = StandardizedTransformer(str(folder))
    built, asked = [], []
    find = inspect.getsourcelines

    def counted(obj):
        asked.append(obj)
        return find(obj)

    def request(backend, request_model, tracer):  # the network hop: nnsight's own request, then the checked one
        # (twice: nnsight's first pickling of a trace tags the modules it references, which its later ones name)
        built.extend(RemoteBackend._serialize(backend, tracer) for _ in range(2))
        monkeypatch.setattr(inspect, "getsourcelines", counted)
        built.extend(backend._serialize(tracer) for _ in range(2))
        tracer.execute(tracer.info.code)

    monkeypatch.setattr(RemoteBackend, "request", request)
    monkeypatch.setattr("nnterp.core.remote_env.server_env", lambda host=None: env_of(MAJOR, MINOR))
    with torch.no_grad(), model.trace(IDS, remote=True):
        saved = nnsight.save(model.layers[1].mlp.mlp_output)
    with torch.no_grad(), model.trace(IDS):
        local = nnsight.save(model.layers[1].mlp.mlp_output)
    assert torch.equal(saved, local)
    assert built[1] == built[2] == built[3]  # the same bytes as nnsight's own request
    shipped = {id(getattr(obj, "__code__", obj)) for obj in asked}
    assert len(asked) == len(shipped)  # each function's source found once, and not again for the second request
    assert inspect.getsourcelines is counted  # put back as it was when the request was built
