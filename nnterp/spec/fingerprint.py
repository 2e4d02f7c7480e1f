"""One fingerprint of a Python value: the same in every process where the value is the same, another where it differs.

What a result depends on is written down as data: the proof's cache key (a family spec's functions and fields), a
collection's writer (its positions mask function, its dictionaries) and its steering (each vector). ``repr`` cannot
serve: a function's holds its memory address, another in every process, and a tensor's shows a few of its values.
Here a function is its code (bytecode, constants, names), its defaults and the values its closure holds; a tensor
or an array is its dtype, shape and a digest of every byte; a dataclass is its fields; a torch module is a checksum
of sampled weights (``weights_digest``); an object with the default repr is its type and attributes. Any other
object is its type and repr: a repr that holds an address differs between processes, so two such fingerprints
never wrongly agree.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import types

import numpy as np
import torch

SAMPLED = 64  # values of each weight tensor in ``weights_digest``: evenly spaced, exact bytes


def digest(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:24]


def tensor_digest(tensor: torch.Tensor) -> str:
    """A tensor by its dtype, shape and every byte (on any device)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{tensor.dtype} {tuple(tensor.shape)} {digest(data)}"


def weights_digest(module: torch.nn.Module) -> str:
    """A checksum of ``SAMPLED`` evenly spaced values of every weight and buffer kept in the state dict: exact
    bytes, the same on every device."""
    hashed = hashlib.sha256()
    buffers = [(f"{prefix}.{name}" if prefix else name, buffer) for prefix, owner in module.named_modules()
               for name, buffer in owner._buffers.items()
               if buffer is not None and name not in owner._non_persistent_buffers_set]
    for name, tensor in [*module.named_parameters(), *buffers]:
        hashed.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        if tensor.device.type == "meta" or not tensor.numel():  # offloaded: not here to read
            continue
        flat = tensor.detach().reshape(-1)
        count = min(flat.numel(), SAMPLED)
        picked = torch.arange(count) * (flat.numel() - 1) // max(count - 1, 1)  # integer steps: no rounding
        hashed.update(flat[picked.to(flat.device)].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()[:24]


def fingerprint(value, home: str | None = None) -> str:
    """The digest of ``describe(value, home)``."""
    return digest(repr(describe(value, home)))


def describe(root, home: str | None = None):
    """``root`` as plain data (tuples of strings, numbers and bytes) whose ``repr`` is the same in every process.

    ``home=None``: every function is its code, defaults and closure (a family spec's functions, wherever they
    are defined). ``home`` a module's name: a function of that module is also the values of the globals it reads
    (a mask function reading a module-level constant), and a function of another module (a library's) is its name.
    ``root`` itself, an object, is its type, its ``__call__`` and its attributes, whatever its repr.
    """
    seen: dict[int, object] = {}  # described once (a function that names itself); kept alive: no id is reused

    def cell(c):
        try:
            return walk(c.cell_contents)
        except ValueError:  # a cell not yet filled
            return "empty cell"

    def walk(value):
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return value
        if isinstance(value, (tuple, list)):
            return type(value).__name__, tuple(map(walk, value))
        if isinstance(value, (set, frozenset)):
            return "set", tuple(sorted(repr(walk(item)) for item in value))
        if isinstance(value, dict):
            return "dict", tuple(sorted((repr(walk(k)), repr(walk(v))) for k, v in value.items()))
        if isinstance(value, torch.Tensor):
            return "tensor", tensor_digest(value)
        if isinstance(value, np.ndarray):
            return "array", value.dtype.str, value.shape, digest(np.ascontiguousarray(value).tobytes())
        if isinstance(value, types.CodeType):
            return ("code", value.co_code, walk(value.co_consts), value.co_names, value.co_varnames,
                    value.co_freevars, value.co_argcount, value.co_kwonlyargcount)
        named = (types.ModuleType, type, types.BuiltinFunctionType)
        if isinstance(value, named) or (isinstance(value, types.FunctionType) and home is not None
                                        and value.__module__ != home):
            return (type(value).__name__, getattr(value, "__module__", None),
                    getattr(value, "__qualname__", value.__name__))
        if id(value) in seen:
            return "again", getattr(value, "__qualname__", type(value).__qualname__)
        seen[id(value)] = value
        if isinstance(value, types.FunctionType):
            code, defined = value.__code__, value.__globals__
            read = () if home is None else tuple((name, walk(defined[name])) for name in sorted(_names(code))
                                                 if name in defined)
            return ("function", walk(code), walk(value.__defaults__), walk(value.__kwdefaults__),
                    tuple(map(cell, value.__closure__ or ())), read)
        if isinstance(value, types.MethodType):
            return "method", walk(value.__func__), walk(value.__self__)
        if isinstance(value, functools.partial):
            return "partial", walk(value.func), walk(value.args), walk(value.keywords)
        if isinstance(value, torch.nn.Module):  # its weights' checksum, not all of them
            return "module", walk(type(value)), weights_digest(value)
        if dataclasses.is_dataclass(value):
            return "dataclass", walk(type(value)), tuple((field.name, walk(getattr(value, field.name)))
                                                         for field in dataclasses.fields(value))
        mine = value is root or value is getattr(root, "__self__", None)
        if mine or (type(value).__repr__ is object.__repr__ and hasattr(value, "__dict__")):  # its data, not an address
            call = type(value).__call__ if callable(value) else None
            return "data", walk(type(value)), walk(call), walk(getattr(value, "__dict__", None))
        return "object", walk(type(value)), repr(value)

    return walk(root)


def _names(code: types.CodeType) -> set[str]:
    """Every name ``code`` and the functions inside it look up (globals among them)."""
    return set(code.co_names).union(*(_names(const) for const in code.co_consts if isinstance(const, types.CodeType)))
