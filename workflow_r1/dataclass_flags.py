"""absl flags generated from a dataclass: one flag per field, so adding a field adds a flag.

    holders = define(ServerConfig, flags.FLAGS, exclude=("token",))   # --max_batch, --max_tokens, ...
    ServerConfig(**values(ServerConfig, holders))

Each flag takes the field's name, its type (int, float, str, bool, or a `typing.Literal` of strings,
which becomes an enum), its default (the field's default, or its default_factory called once at
definition), and its help from the field's `metadata["help"]` or else from the class docstring's
entry for the field: a line `name: text` (or `name, other: text` for several fields), continued by
the more indented lines below it. A field without help, or of a type no flag parses, is an error
when the flags are defined, so a new field cannot slip in undocumented. The config files' sections
are the same idea for ml_collections (`configlib.section`).
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from absl import flags

# The flags this module defines belong to the module that calls `define` (absl's --help groups them there).
flags.disclaim_key_flags()

_ENTRY = re.compile(r"^([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*):\s+(\S.*)$")


def docstring_help(cls: type) -> dict[str, str]:
    """Field name -> its entry in the docstring of `cls` or of the dataclass it derives from (the
    nearest class's entry wins; continuation lines joined, spaces collapsed)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and "__doc__" in vars(klass):
            out.update(_entries(klass.__doc__ or "", {f.name for f in dataclasses.fields(cls)}))
    return out


def _entries(doc: str, names: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    current: list[str] = []
    parts: list[str] = []

    def close() -> None:
        for name in current:
            out[name] = re.sub(r"\s+", " ", " ".join(parts)).strip()

    for line in inspect.cleandoc(doc).splitlines():
        m = _ENTRY.match(line)
        if m and all(n.strip() in names for n in m.group(1).split(",")):
            close()
            current, parts = [n.strip() for n in m.group(1).split(",")], [m.group(2)]
        elif current and line[:1].isspace() and line.strip():
            parts.append(line.strip())
        else:
            close()
            current, parts = [], []
    close()
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"{f.name} has no default: a flag needs one")


def define(cls: type, flag_values: flags.FlagValues = flags.FLAGS, *, exclude: Iterable[str] = (),
           module_name: str | None = None) -> dict[str, flags.FlagHolder]:
    """Defines one flag per field of dataclass `cls` (but those in `exclude`) on `flag_values`;
    returns field name -> FlagHolder."""
    hints = typing.get_type_hints(cls)
    helps = docstring_help(cls)
    skip = set(exclude)
    holders: dict[str, flags.FlagHolder] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        help_text = f.metadata.get("help") or helps.get(f.name)
        if not help_text:
            raise TypeError(f"{cls.__name__}.{f.name} has no help: add a line '{f.name}: ...' to the "
                            "class docstring (or metadata={'help': ...})")
        hint, default = hints[f.name], _default(f)
        kw = dict(flag_values=flag_values, module_name=module_name)
        if typing.get_origin(hint) is typing.Literal:
            choices = list(typing.get_args(hint))
            if not all(isinstance(c, str) for c in choices):
                raise TypeError(f"{cls.__name__}.{f.name}: a Literal flag takes strings, got {choices}")
            holders[f.name] = flags.DEFINE_enum(f.name, default, choices, help_text, **kw)
        elif hint is bool:
            holders[f.name] = flags.DEFINE_boolean(f.name, default, help_text, **kw)
        elif hint is int:
            holders[f.name] = flags.DEFINE_integer(f.name, default, help_text, **kw)
        elif hint is float:
            holders[f.name] = flags.DEFINE_float(f.name, float(default), help_text, **kw)
        elif hint is str:
            holders[f.name] = flags.DEFINE_string(f.name, default, help_text, **kw)
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag type for {hint!r} (int, float, str, bool, "
                            "Literal of str)")
    return holders


def values(cls: type, holders: Mapping[str, flags.FlagHolder]) -> dict[str, Any]:
    """The parsed values of `cls`'s fields that have a flag in `holders`, as keyword arguments of `cls`."""
    return {f.name: holders[f.name].value for f in dataclasses.fields(cls) if f.name in holders}
