"""What a remote trace ships holds no code without source: no bytecode of the client's Python.

nnsight ships every function of a request as its source text, which compiles on any Python, except a function whose
source cannot be found (the methods ``@dataclass`` writes with ``exec``): that one travels as a code object of the
client's Python, which a server on another minor version cannot run. Here every request that ``remote=True`` sends
(plain values, the attention's values, edits, a looped model's runs, every tool that takes ``remote=``) is serialized
by nnsight's own path with a pickler that records each code object it writes; the payload must hold none. The trace
then runs here, so the tools get their results and go on to their next request.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import os
import subprocess
import sys
import tempfile
import types

import nnsight
import pytest
import torch
from nnsight.intervention import serialization
from nnsight.intervention.backends.remote import RemoteBackend
from nnsight.modeling import huggingface

import nnterp.core.remote_env
from nnterp import (
    Dictionary,
    Prompt,
    StandardizedTransformer,
    activation_patching,
    attribution_patching,
    collect,
    logit_difference,
    logit_lens,
    patchscope_lens,
    run_prompts,
    run_with_cache,
    splice,
    steered_generate,
    top_activations,
)
from nnterp import test_prompt as answer_ranks  # under its own name, pytest would collect it
from nnterp.core.validation import check_identity
from nnterp.families import BY_MODEL_TYPE
from nnterp.spec.locations import At
from nnterp.spec.sourced import sourced

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import CASES, IDS
from ..remote.test_remote import edit_everything, every_run, read_everything


class Recorder(serialization.CustomCloudPickler):
    """nnsight's pickler, noting every code object it writes (a function shipped as source writes none)."""

    code: list[str] = []

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            Recorder.code.append(f"{getattr(obj, 'co_qualname', obj.co_name)} ({obj.co_filename}:{obj.co_firstlineno})")
        return super().reducer_override(obj)

    def _dynamic_function_reduce(self, func):
        reduced = super()._dynamic_function_reduce(func)
        if reduced[0] is not serialization._load_function:  # nnsight found no source: this one goes as bytecode
            Recorder.code.append(f"{func.__module__}.{func.__qualname__} (no source)")
        return reduced


@pytest.fixture
def payloads(monkeypatch):
    """Each request ``remote=True`` sends: its size and the code objects it holds. Then it runs here."""
    sent = []

    def request(backend, request_model, tracer):
        Recorder.code = []
        blob = backend._serialize(tracer)  # nnsight's own: registers nnterp by value, then pickles the request
        sent.append({"bytes": len(blob), "code": sorted(set(Recorder.code))})
        tracer.execute(tracer.info.code)  # the saves land in the caller's frame, as after a remote run

    monkeypatch.setattr(serialization, "CustomCloudPickler", Recorder)  # what serialization.dumps pickles with
    monkeypatch.setattr(RemoteBackend, "request", request)
    # the request runs here: the server's Python, which it is checked against before it is sent, is this process's
    monkeypatch.setattr(nnterp.core.remote_env, "server_env", lambda host=None: {"python_version": sys.version})
    return sent


def assert_no_code_shipped(sent: list[dict]) -> None:
    assert sent, "no request was sent"
    assert all(request["bytes"] > 10_000 for request in sent)  # nnterp's classes travel with every request
    shipped = sorted({code for request in sent for code in request["code"]})
    assert not shipped, f"{len(shipped)} code objects travel as the client's bytecode:\n" + "\n".join(shipped)


def checkpoint(model_type: str, root, config=None) -> str:
    folder = root / model_type
    if not folder.is_dir():
        build_tiny(config or BY_MODEL_TYPE[model_type].tiny_config()).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
    huggingface._ID_CACHE[str(folder)] = str(folder)  # offline: the repo id is the folder
    return str(folder)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = checkpoint("gpt2", tmp_path_factory.mktemp("checkpoints"), CASES["gpt2"][0]())
    return StandardizedTransformer(folder, attention_values=True)


def test_reads_of_every_value_ship_no_bytecode(gpt2, payloads):
    saved = read_everything(gpt2, True)
    assert any(key.endswith("attention_probabilities") for key in saved)  # the attention's values too
    assert_no_code_shipped(payloads)


def test_edits_ship_no_bytecode(gpt2, payloads):
    edit_everything(gpt2, True)  # in place and by assignment
    with torch.no_grad(), gpt2.trace(IDS, remote=True):
        nnsight.save(gpt2.head_outputs(1))
        gpt2.scale_heads(1, [0, 2], 0.5)
        gpt2.layers[1].self_attn.attention_output = gpt2.layers[1].self_attn.attention_output * 2
    assert_no_code_shipped(payloads)


def test_the_runs_of_a_looped_block_ship_no_bytecode(tmp_path, payloads):
    model = StandardizedTransformer(checkpoint("dory", tmp_path), attention_values=True)
    saved = every_run(model, True)  # model.layers[i].run(k): reads and edits
    assert any(".1." in key for key in saved)
    assert_no_code_shipped(payloads)


@pytest.mark.slow  # outside the fast tier (./run.sh test --fast)
def test_every_tool_with_remote_ships_no_bytecode(gpt2, payloads, tmp_path):
    prompts = ["the cat sat on the mat", "Paris is in"]
    metric = logit_difference(5, 6)
    logit_lens(gpt2, prompts, remote=True)
    activation_patching(gpt2, "the cat sat", "the dog sat", metric, layers=[0, 2], remote=True, progress=False)
    activation_patching(gpt2, "the cat sat", "the dog sat", metric, per="head", remote=True, progress=False)
    attribution_patching(gpt2, "the cat sat", "the dog sat", metric, remote=True)
    patchscope_lens(gpt2, prompts, "the cat is", remote=True)
    steered_generate(gpt2, "the cat", 1, torch.ones(gpt2.hidden_size), max_new_tokens=2, remote=True)
    collect(gpt2, prompts * 2, tmp_path / "collected", ["layer_output", "mlp.mlp_output"], positions="all",
            batch_size=2, progress=False, remote=True)
    check_identity(gpt2, remote=True)
    run_with_cache(gpt2, prompts, remote=True)
    answer_ranks(gpt2, "the cat sat on the", "mat", print_results=False, remote=True)
    run_prompts(gpt2, [Prompt.from_strings("the cat sat on the", {"mat": "mat"}, gpt2.tokenizer)], progress=False,
                remote=True)
    features = 8
    generator = torch.Generator().manual_seed(0)
    dictionary = Dictionary(torch.randn(gpt2.hidden_size, features, generator=generator), torch.zeros(features),
                            torch.randn(features, gpt2.hidden_size, generator=generator),
                            torch.zeros(gpt2.hidden_size), site=(1, "layer_output"))
    top_activations(gpt2, dictionary, prompts, 0, k=2, remote=True)
    with torch.no_grad(), gpt2.trace(IDS, remote=True):
        with splice(gpt2, dictionary) as active:
            active[:] *= 0.5
    assert_no_code_shipped(payloads)


# -- what @sourced writes does what @dataclass writes -------------------------------------------------

def declare(decorate):
    """The same declarations, frozen and not, under ``decorate``."""

    @decorate
    @dataclasses.dataclass(frozen=True)
    class Point:
        x: int
        y: int = 2
        tags: list = dataclasses.field(default_factory=list, compare=False)
        hidden: str = dataclasses.field(default="h", repr=False)
        label: str = dataclasses.field(default="p", kw_only=True)

        def __post_init__(self):
            if self.x < 0:
                raise ValueError("negative")

    @decorate
    @dataclasses.dataclass
    class Box:
        content: object
        size: int = dataclasses.field(default=1, init=False)

    @decorate
    @dataclasses.dataclass(frozen=True)
    class Point3(Point):
        z: int = 0

    return Point, Box, Point3


def outcome(call):
    try:
        return ("value", call())
    except Exception as error:  # noqa: BLE001 - the kind of failure is compared
        return ("raises", type(error))


def test_sourced_methods_behave_as_the_dataclass_methods():
    (point, box, point3), (plain_point, plain_box, plain_point3) = declare(sourced), declare(lambda cls: cls)
    for method in ("__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__"):
        inspect.getsource(getattr(point, method))  # each has source now
    assert inspect.signature(point) == inspect.signature(plain_point)

    def behaviours(Point, Box, Point3):  # noqa: N803 - the classes
        a, b = Point(1, tags=["t"], label="q"), Point(1, 2, ["u"], "h", label="q")
        fine = Box([1])
        fine.content = 3
        return [repr(a), repr(Point3(1, z=5)), repr(fine), a == b, a == Point(1), a == Point3(1), hash(a) == hash(b),
                hash(Point(1)) == hash(Point(2)), fine == Box(3), fine.size, Box.__hash__ is None,
                dataclasses.replace(a, x=4), dataclasses.asdict(a), outcome(lambda: setattr(a, "x", 2)),
                outcome(lambda: delattr(a, "y")), outcome(lambda: setattr(a, "new", 1)), outcome(lambda: Point()),
                outcome(lambda: Point(1, 2, [], "h", "label")), outcome(lambda: Point(1, x=1)),
                outcome(lambda: Point(1, nope=1)), outcome(lambda: Point(-1)), outcome(lambda: Box(1, size=2)),
                a.__match_args__]

    def text(items):  # the classes are distinct objects: compare what they print
        return [repr(item) for item in items]

    assert text(behaviours(point, box, point3)) == text(behaviours(plain_point, plain_box, plain_point3))


# where nnterp cannot be imported, the payload's classes are rebuilt from it, their methods compiled from its source
REBUILD = """
import importlib.abc, json, pickle, sys

class NoNnterp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "nnterp":
            raise ModuleNotFoundError(name)

sys.meta_path.insert(0, NoNnterp())
location, At = pickle.loads(sys.stdin.buffer.read())
again = At("attn", "output", index=1, heads=True)

def failure(call):
    try:
        call()
    except Exception as error:
        return type(error).__name__ + ": " + str(error)

print(json.dumps([repr(location), location == again, hash(location) == hash(again), location == At("attn", "output"),
                  failure(lambda: setattr(location, "index", 2)), failure(lambda: At("attn", "sideways"))]))
"""


def test_a_shipped_location_rebuilt_from_its_source_behaves_as_here():
    """The bytes a request carries, loaded in a process without nnterp: the methods compiled from the shipped source
    construct, compare, hash, print and stay frozen as the originals do here."""
    nnsight.register("nnterp")  # what remote=True does: nnterp's classes travel by value
    location = At("attn", "output", index=1, heads=True)
    Recorder.code = []
    buffer = io.BytesIO()
    Recorder(buffer, protocol=serialization.DEFAULT_PROTOCOL).dump((location, At))
    assert Recorder.code == []
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    there = subprocess.run([sys.executable, "-c", REBUILD], input=buffer.getvalue(), capture_output=True, env=env,
                           cwd=tempfile.gettempdir(), check=False)
    assert there.returncode == 0, there.stderr.decode()[-3000:]

    def failure(call):
        try:
            call()
        except Exception as error:  # noqa: BLE001 - the message is compared
            return f"{type(error).__name__}: {error}"

    again = At("attn", "output", index=1, heads=True)
    here = [repr(location), location == again, hash(location) == hash(again), location == At("attn", "output"),
            failure(lambda: setattr(location, "index", 2)), failure(lambda: At("attn", "sideways"))]
    assert json.loads(there.stdout) == here
    assert here[1:4] == [True, True, False] and here[4].startswith("FrozenInstanceError")


def test_code_a_trace_runs_calls_its_bases_explicitly():
    """A zero-argument ``super()`` needs the ``__class__`` cell of the class body, which a class rebuilt on a server
    from its source does not give: "super(): __class__ cell not found" there. Specs and their vocabulary run in
    traces, so they name their base."""
    import ast
    from pathlib import Path

    import nnterp

    root = Path(nnterp.__file__).parent
    found = [f"{path.relative_to(root)}:{node.lineno}" for package in ("spec", "families")
             for path in sorted((root / package).rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
             and not node.args]
    assert not found, found
