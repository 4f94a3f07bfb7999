"""The one loader of plugins: policies and routers are both built here, from a bundled name,
``file.py:Class`` or ``module:Class``, a class, or an object, and their options are read by one
rule.

A kind of plugin (``PluginKind``) is a word for messages (``policy``, ``router``), the method
that makes an object one (``plan``, ``route``), the bundled classes by name, and the two
exceptions its bad input raises (not found, bad option). ``build(kind, spec, options)``:

- a string or path: a bundled name, else ``file.py:Class`` (a file, imported under a name of
  its own) or ``module:Class`` (importable); the class is built with ``options``;
- a class with the kind's method: built with ``options``;
- an object with the kind's method: returned as it is (options go with a name or a class).

A class is built by its ``from_options(options)`` when it has one (the bundled policies and
routers: dataclasses over ``PolicyBase``/``RouterBase``, which read them by the rule below),
else by its constructor with the options as keyword arguments; an object with no ``name`` gets
the spec's (a class's name).

The rule for options (``coerce_options``): option names are strings, ``-`` read as ``_``; the
options are the dataclass's init fields, and a name that is none of them is one line naming
them all. An option's type is its default's, or, for an option whose default is missing or
None, its annotation's (``int | None``: an int, or None). A string (``-o key=value`` on the
command line) is parsed as that type: a bool (``1/0``, ``true/false``, ``yes/no``, ``on/off``),
an int, a finite float; any other type keeps the string. Any other value must have the type
already: a bool for a bool, an int (not a bool) for an int, a finite int or float for a float
(stored as a float); an option of any other type takes the value as it is.

Imports nothing from ``sim`` or ``engine``, nor from the rest of this package: ``policies.base``
and ``routers.base`` read their options through it, and routers sit beside the policies in the
same layer (``tests/test_layering.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Callable, Mapping

_PARSED = (bool, int, float)  # the types a string option is parsed as


@dataclass(frozen=True)
class PluginKind:
    """What ``build`` needs to know of a kind of plugin."""

    word: str  # "policy", "router": as messages name it
    method: str  # "plan", "route": an object with this method is one
    bundled: Mapping[str, type]  # the bundled classes by name
    not_found: type[Exception]  # an unknown name, a file that does not load, not such an object
    option_error: type[Exception]  # a bad option


def build(kind: PluginKind, spec: Any, options: Mapping[str, Any] | None = None) -> Any:
    """A plugin object of ``kind`` from ``spec`` (a bundled name, ``file.py:Class``,
    ``module:Class``, a class or an object) and its ``options``; bad input raises the kind's
    exceptions with one line."""
    options = option_keys(kind.word, options, kind.option_error)
    if isinstance(spec, Path):
        spec = str(spec)
    if isinstance(spec, str):
        if not spec.strip():
            raise kind.not_found(f"{kind.word} is empty")
        cls = kind.bundled.get(spec)
        if cls is None:
            if ":" not in spec:
                raise kind.not_found(
                    f"unknown {kind.word} '{spec}' (bundled: {', '.join(kind.bundled)}; or give file.py:Class)"
                )
            cls = load_class(kind, spec)
        return _construct(kind, cls, spec, options)
    if isinstance(spec, type):
        if not callable(getattr(spec, kind.method, None)):
            raise kind.not_found(f"{kind.word} class {spec.__name__} has no {kind.method}(view) method")
        return _construct(kind, spec, spec.__name__, options)
    if callable(getattr(spec, kind.method, None)):
        if options:
            name = getattr(spec, "name", type(spec).__name__)
            raise kind.option_error(
                f"options go with a {kind.word}'s name or class, not with a {kind.word} object "
                f"({name!r} is built already)"
            )
        return spec
    raise kind.not_found(
        f"a {kind.word} is a bundled name ({', '.join(kind.bundled)}), 'file.py:Class', a class or an object "
        f"with a {kind.method}(view) method; got {type(spec).__name__}"
    )


def _construct(kind: PluginKind, cls: type, label: str, options: dict[str, Any]) -> Any:
    """``cls`` built with ``options``: by its ``from_options`` when it has one, else its
    constructor; ``label`` names it in messages, and becomes the object's name if it has none."""
    if hasattr(cls, "from_options"):
        return cls.from_options(options)
    try:
        obj = cls(**options)
    except TypeError as exc:
        raise kind.option_error(f"{kind.word} '{label}': {exc}") from None
    except Exception as exc:  # a user's constructor: report, don't crash
        raise kind.option_error(f"{kind.word} '{label}': its constructor raised {type(exc).__name__}: {exc}") from None
    if not hasattr(obj, "name"):
        try:
            obj.name = label
        except AttributeError:  # (a class with __slots__)
            pass
    return obj


def load_class(kind: PluginKind, spec: str) -> type:
    """The class ``spec`` names (``file.py:Class`` or ``module:Class``), which must have the
    kind's method; anything wrong is the kind's ``not_found`` error."""
    where, _, attr = spec.rpartition(":")
    error = kind.not_found
    try:
        if where.endswith(".py") or "/" in where:
            path = Path(where)
            if not path.is_file():
                raise error(f"{kind.word} file not found: {where}")
            tag = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
            name = f"_user_{kind.word}_{path.stem}_{tag}"
            mod_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(mod_spec)
            # registered before it runs, as an import would: @dataclass (with postponed
            # annotations), pickle and typing look the module up by name while it executes
            sys.modules[name] = module
            # its folder importable, as when a script runs: a policy file may import its neighbours
            folder = str(path.resolve().parent)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            try:
                mod_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:  # (a console script's path has no ".")
                sys.path.append(os.getcwd())
            module = importlib.import_module(where)
    except error:
        raise
    except Exception as exc:  # a user's file: report, don't crash
        raise error(f"cannot load {kind.word} '{spec}': {type(exc).__name__}: {exc}") from None
    cls = getattr(module, attr, None)
    if cls is None or not inspect.isclass(cls) or not callable(getattr(cls, kind.method, None)):
        raise error(f"'{spec}' is not a class with a {kind.method}(view) method")
    return cls


# ---------------------------------------------------------------------------- options


def option_keys(word: str, options: Mapping[str, Any] | None, error: Callable[[str], Exception]) -> dict[str, Any]:
    """``options`` as a dict with ``-`` in names read as ``_``; a name that is not a non-empty
    string raises ``error(message)`` (an exception type, or a function that makes one)."""
    if options is not None and not isinstance(options, Mapping):
        raise error(f"{word} options are a mapping of names to values, got {type(options).__name__} {options!r}")
    out: dict[str, Any] = {}
    for key, value in dict(options or {}).items():
        if not isinstance(key, str) or not key:
            raise error(f"{word} option names are strings, got {key!r}")
        out[key.replace("-", "_")] = value
    return out


def option_names(cls: type) -> list[str]:
    """The options of a dataclass plugin: its init fields."""
    return [f.name for f in dataclasses.fields(cls) if f.init]


def construct(cls: type, options: Mapping[str, Any] | None, word: str, error: type[Exception]) -> Any:
    """The dataclass plugin ``cls`` built with ``options`` read by the rule (``from_options`` of
    ``PolicyBase`` and ``RouterBase``); a bad option, or a value its own checks refuse
    (``__post_init__``), is ``error`` naming the plugin."""
    name = getattr(cls, "name", cls.__name__)
    kwargs = coerce_options(cls, options, word, error)
    try:
        return cls(**kwargs)
    except error:
        raise
    except (TypeError, ValueError) as exc:
        raise error(f"{word} '{name}': {exc}") from None


def coerce_options(cls: type, options: Mapping[str, Any] | None, word: str, error: type[Exception]) -> dict[str, Any]:
    """``options`` as keyword arguments of the dataclass ``cls``, each of its option's type (the
    rule in this module's docstring); anything else is ``error`` with one line."""
    name = getattr(cls, "name", cls.__name__)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    out: dict[str, Any] = {}
    for key, raw in option_keys(word, options, error).items():
        f = fields.get(key)
        if f is None:
            known = ", ".join(sorted(fields)) or "none"
            raise error(f"{word} '{name}' has no option '{key}' (options: {known})")
        kind, nullable = _option_type(cls, f)
        if raw is None and nullable:
            out[key] = None
            continue
        try:
            out[key] = parse_option(raw, kind) if isinstance(raw, str) else checked_option(raw, kind)
        except ValueError:
            raise error(f"{word} '{name}': option {key}={raw!r} is not a valid {kind.__name__}") from None
    return out


def parse_option(raw: str, kind: type) -> Any:
    """A ``-o key=value`` string as an option of type ``kind`` (bool, int, a finite float; any other
    type keeps the string). Raises ValueError when the string is not one."""
    if kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(raw)
    if kind is int:
        return int(raw)
    if kind is float:
        value = float(raw)
        if not math.isfinite(value):
            raise ValueError(raw)
        return value
    return raw


def checked_option(value: Any, kind: type) -> Any:
    """A Python value (not a string) of an option of type ``kind``: ValueError when it is not one."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    else:
        return value
    if not ok:
        raise ValueError(value)
    return float(value) if kind is float else value


def _option_type(cls: type, f: dataclasses.Field) -> tuple[type, bool]:
    """(the option's type, whether None is a value of it): the default's type; for a default that
    is missing or None, the annotation's when it names one of bool, int, float, str (or it or
    None), else ``object`` (any value)."""
    if f.default is not dataclasses.MISSING and f.default is not None:
        return type(f.default), False
    try:
        hint = typing.get_type_hints(cls).get(f.name)
    except Exception:  # (an annotation that does not evaluate: take any value)
        hint = None
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, UnionType) else (hint,)
    nullable = f.default is None or type(None) in args
    named = [a for a in args if a is not type(None)]
    if len(named) == 1 and named[0] in (*_PARSED, str):
        return named[0], nullable
    return object, True
