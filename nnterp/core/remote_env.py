"""The server's Python against the client's, before a remote trace is sent.

A request carries code in two forms. Functions with source travel as text and are compiled by the server's own
Python, so they run on any version that parses them; nnterp's own code is written for its oldest supported Python
(``MINIMUM_PYTHON``), and every nnterp class a trace ships has source (``nnterp.spec.sourced``). A function without
source (a method ``@dataclass`` writes, a function made with ``exec`` or typed at a prompt) travels as the code
object of the client's Python: bytecode changes with every minor version, and a server of another one fails on it,
or crashes (a frozen dataclass shipped from 3.11 failed to build on 3.12, and its ``repr`` killed the server's model
process). NDIF runs Python 3.12 or later.

``check_server_python`` refuses what cannot run safely; ``server_env`` fetches what the server reports at ``/env``;
``CheckedRemoteBackend`` runs the check on each request's actual payload before it is sent.
"""

from __future__ import annotations

import contextlib
import inspect
import pickletools
import sys
from typing import Any

from nnsight.intervention.backends.remote import RemoteBackend

from ..spec.errors import NNterpError

MINIMUM_PYTHON = (3, 10)  # nnterp's requires-python: the oldest Python its shipped source is written for

_ENVS: dict[str, dict] = {}  # host -> its /env, fetched once per process


class ServerPythonError(NNterpError, RuntimeError):
    """The request cannot run safely on the server's Python."""


def server_env(host: str | None = None, refresh: bool = False) -> dict:
    """What the NDIF server at ``host`` (default: nnsight's configured host) reports at ``/env``:
    ``{"python_version": <its sys.version>, "packages": {name: version}}``, fetched once per process."""
    import nnsight
    from nnsight import ndif

    if host is None or host == nnsight.CONFIG.API.HOST:
        return ndif.get_remote_env(force_refresh=refresh)  # nnsight's own, cached the same way
    if refresh or host not in _ENVS:
        import httpx  # nnsight's HTTP client

        response = httpx.get(f"{host.rstrip('/')}/env", timeout=httpx.Timeout(5.0, read=60.0))
        response.raise_for_status()
        _ENVS[host] = response.json()
    return _ENVS[host]


def python_of(env: dict) -> tuple[int, int] | None:
    """``(major, minor)`` of the Python an environment reports, or None where it says none."""
    try:
        major, minor = env["python_version"].split()[0].split(".")[:2]
        return int(major), int(minor)
    except (KeyError, AttributeError, ValueError):
        return None


def check_server_python(server_env: dict, bytecode: bool = False) -> None:
    """Raise ``ServerPythonError`` where a request cannot run safely on the server's Python (``server_env`` as
    ``/env`` reports it); ``bytecode``: the request holds code without source (``holds_bytecode``).

    Refused: another major version; a server older than nnterp's oldest Python (nnterp's shipped source may not
    parse there); and, where the request holds bytecode, any other minor version, or a server that does not say
    which Python it runs. A request whose code is all source runs on any newer minor version (a 3.11 client on
    NDIF's 3.12): what still differs then is only what the server's Python does with the same source (a syntax of
    the client's Python that an older server cannot parse fails there, as a SyntaxError)."""
    client = sys.version_info[:2]
    server = python_of(server_env)
    here = f"{client[0]}.{client[1]}"
    if server is None:
        if bytecode:
            raise ServerPythonError(
                f"The server does not say which Python it runs, and this request holds code without source, which "
                f"runs only on the Python it was made on (Python {here} here). {_WITHOUT_BYTECODE}")
        return
    there = f"{server[0]}.{server[1]}"
    if server[0] != client[0]:
        raise ServerPythonError(f"The server runs Python {there} and this client Python {here}: a request does not "
                                "cross major versions. Use a client on the server's Python.")
    if server < MINIMUM_PYTHON:
        raise ServerPythonError(
            f"The server runs Python {there}, older than nnterp's oldest Python ({MINIMUM_PYTHON[0]}."
            f"{MINIMUM_PYTHON[1]}): the nnterp code a request ships may not compile there.")
    if bytecode and server != client:
        raise ServerPythonError(
            f"This request holds code without source, which travels as Python {here}'s bytecode, and the server "
            f"runs Python {there}, where such bytecode fails or crashes the server's model process. "
            f"{_WITHOUT_BYTECODE}")


_WITHOUT_BYTECODE = (
    "Code without source is a function made with exec or typed at an interactive prompt, or a method @dataclass "
    "writes (decorate a dataclass you use in a trace with nnterp.spec.sourced.sourced above its @dataclass line): define "
    "the functions a trace uses in a file, or run the client on the server's Python.")


def holds_bytecode(payload: bytes, compressed: bool = False) -> bool:
    """Whether a serialized request builds a code object (bytecode), read from its pickle opcodes without loading it.

    A code object is built by calling cloudpickle's ``_builtin_type("CodeType")``; the first one of a payload names
    that global and that string (later ones reuse it from the pickle's memo)."""
    if compressed:
        import zstandard  # what nnsight compresses requests with

        payload = zstandard.ZstdDecompressor().decompress(payload)
    # the first code object pickles the string "CodeType" itself (protocol 4 and 5: SHORT_BINUNICODE, 2 and 3:
    # BINUNICODE), which the source text a request ships (where the word may stand) never holds: most requests are
    # read in C alone
    if b"\x8c\x08CodeType" not in payload and b"X\x08\x00\x00\x00CodeType" not in payload:
        return False
    memo: list = []
    pushed: list = [None, None]  # the last two values pushed (what STACK_GLOBAL and a call take)
    argument: Any  # its type is the opcode's: an int for the GETs, a string for GLOBAL
    for opcode, argument, _ in pickletools.genops(payload):
        name = opcode.name
        if name == "FRAME":  # framing only: pushes nothing
            continue
        if name == "MEMOIZE":
            memo.append(pushed[-1])
            continue
        if name in ("BINGET", "LONG_BINGET", "GET"):
            value = memo[int(argument)] if int(argument) < len(memo) else None
        elif name == "STACK_GLOBAL":
            value = ("global", *pushed)
        elif name == "GLOBAL":
            value = ("global", *argument.split(" ", 1))
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            value = argument
        else:
            value = None
        if value == "CodeType" and pushed[-1] == ("global", "cloudpickle.cloudpickle", "_builtin_type"):
            return True
        pushed = [pushed[-1], value]
    return False


class CheckedRemoteBackend(RemoteBackend):
    """nnsight's remote backend, refusing a request its server's Python cannot run safely (``check_server_python``)
    before it is sent: the check reads the request as serialized, and the server's ``/env`` (once per host)."""

    @classmethod
    def of(cls, backend):
        """The checked backend in place of nnsight's ``RemoteBackend`` ``backend`` (anything else as it is: the
        local simulation runs on this Python)."""
        if type(backend) is not RemoteBackend:
            return backend
        return cls(backend.model_key, host=backend.host, api_key=backend.api_key or None, env=backend.env,
                   blocking=backend.blocking, job_id=backend.job_id, verbose=backend.verbose)

    def _serialize(self, tracer) -> bytes:
        with _sources_found_once():
            blob = super()._serialize(tracer)
        check_server_python(server_env(self.host), holds_bytecode(blob, self.compress))
        return blob


_SOURCE_LINES: dict = {}  # code object -> inspect.getsourcelines's answer for the functions with that code


@contextlib.contextmanager
def _sources_found_once():
    """While a request is pickled, inspect finds a function's source lines once per process. nnsight asks for the
    source of every function it ships, twice per request, and inspect re-tokenizes the file from the function's first
    line each time: most of the time a request takes to build (half a second for a tiny model's read). The lines are
    the same each time, since a file is read once per process (``linecache``, as nnsight reads it)."""
    find = inspect.getsourcelines

    def found_once(obj):
        code = getattr(inspect.unwrap(obj), "__code__", None) if inspect.isfunction(obj) else None
        if code is None:
            return find(obj)
        if code not in _SOURCE_LINES:
            _SOURCE_LINES[code] = find(obj)
        lines, start = _SOURCE_LINES[code]
        return list(lines), start

    inspect.getsourcelines = found_once
    try:
        yield
    finally:
        inspect.getsourcelines = find
