"""Dataclasses whose methods have source, so that a remote trace ships them as text, never as bytecode.

``remote=True`` ships nnterp's classes by value, and nnsight ships each of their functions as source text, except
a function with no source: every method ``@dataclass`` writes with ``exec`` (``__init__``, ``__repr__``,
``__eq__``, ``__hash__``, a frozen class's ``__setattr__`` and ``__delattr__``) then travels as the client's own
bytecode, which another minor version of Python does not run (a server on 3.12 failed building a frozen dataclass
shipped from 3.11, and crashed on its ``repr``). ``@sourced`` over ``@dataclass(...)`` replaces each of those
methods by one written here that does the same from the class's fields. The class stays the dataclass it was
declared: ``fields``, ``replace``, frozen, compared and hashed as its options say; its repr shows a function field
by name, without the address ``@dataclass``'s shows (so a spec prints the same in every process).
"""

from __future__ import annotations

import _thread
import dataclasses
import inspect
import operator
import types

# (object id, thread id) of the reprs in progress: a record that holds itself shows "..."
_REPRS_RUNNING: set[tuple[int, int]] = set()


def sourced(cls: type) -> type:
    """Give the methods ``@dataclass`` wrote for ``cls`` source (put it above the ``@dataclass`` line)."""
    fields = dataclasses.fields(cls)
    makers = {"__init__": _init, "__repr__": _repr, "__eq__": _eq, "__hash__": _hash,
              "__setattr__": _frozen_setattr, "__delattr__": _frozen_delattr}
    for name, maker in makers.items():
        method = cls.__dict__.get(name)
        if method is None or _has_source(method):  # not written by @dataclass: the class's own, or inherited
            continue
        written = maker(cls, fields)
        written.__qualname__ = f"{cls.__qualname__}.{name}"
        if name == "__init__":
            written.__signature__ = inspect.signature(method)  # help() and docs still show the fields
        setattr(cls, name, written)
    return cls


def _has_source(function) -> bool:
    try:
        inspect.getsource(function)  # follows __wrapped__: @dataclass's repr wrapper has none
    except (OSError, TypeError):
        return False
    return True


def _key(fields) -> operator.attrgetter:
    """The values that compare or hash, after the class (so that it is a tuple, even of one field)."""
    return operator.attrgetter("__class__", *(field.name for field in fields))


def _init(cls, fields):
    init = tuple(field for field in fields if field.init)
    positional = tuple(field.name for field in init if not field.kw_only)
    accepted = frozenset(field.name for field in init)
    defaults = {field.name: field.default for field in fields if field.default is not dataclasses.MISSING}
    factories = {field.name: field.default_factory for field in fields
                 if field.default_factory is not dataclasses.MISSING}
    names = tuple(field.name for field in fields if field.init or field.name in defaults or field.name in factories)
    frozen = cls.__dataclass_params__.frozen
    post_init = hasattr(cls, "__post_init__")

    def __init__(self, *args, **kwargs):
        if len(args) > len(positional):
            raise TypeError(f"{cls.__qualname__}() takes {len(positional)} positional arguments "
                            f"but {len(args)} were given")
        given = dict(zip(positional, args))
        for name, value in kwargs.items():
            if name not in accepted or name in given:
                problem = "multiple values for argument" if name in given else "an unexpected keyword argument"
                raise TypeError(f"{cls.__qualname__}() got {problem} {name!r}")
            given[name] = value
        for name in names:
            if name in given:
                value = given[name]
            elif name in factories:
                value = factories[name]()
            elif name in defaults:
                value = defaults[name]
            else:
                raise TypeError(f"{cls.__qualname__}() missing required argument: {name!r}")
            if frozen:
                object.__setattr__(self, name, value)
            else:
                setattr(self, name, value)
        if post_init:
            self.__post_init__()

    return __init__


def _repr(cls, fields):
    shown = tuple(field.name for field in fields if field.repr)

    def __repr__(self):
        running = (id(self), _thread.get_ident())
        if running in _REPRS_RUNNING:
            return "..."
        _REPRS_RUNNING.add(running)
        try:
            parts = ", ".join(f"{name}={_shown(getattr(self, name))}" for name in shown)
        finally:
            _REPRS_RUNNING.discard(running)
        return f"{self.__class__.__qualname__}({parts})"

    return __repr__


def _shown(value) -> str:
    """A field's repr; a function's without its address, so that a record prints the same in every process."""
    if isinstance(value, types.FunctionType):
        return f"<function {value.__module__}.{value.__qualname__}>"
    return repr(value)


def _eq(cls, fields):
    key = _key(field for field in fields if field.compare)

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return key(self) == key(other)
        return NotImplemented

    return __eq__


def _hash(cls, fields):
    key = _key(field for field in fields if (field.compare if field.hash is None else field.hash))

    def __hash__(self):
        return hash(key(self))

    return __hash__


def _frozen_setattr(cls, fields):
    names = frozenset(field.name for field in fields)

    def __setattr__(self, name, value):
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    return __setattr__


def _frozen_delattr(cls, fields):
    names = frozenset(field.name for field in fields)

    def __delattr__(self, name):
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    return __delattr__
