"""Run configuration: `configs/*.py` files read by absl + ml_collections `config_flags`.

Every entry point that takes a run configuration defines `--config` with
`config_flags.DEFINE_config_file` and runs through `app.run(main, flags_parser=parse_flags)`:

    python -m workflow_r1.train --config=configs/gsspo.py:local --config.train.learning_rate=3e-6

`--config=FILE.py:PRESET` calls the file's `get_config(PRESET)`; every field is overridable as
`--config.section.key=value`, parsed by the field's type (big_vision / MaxText style, so a sweep is a
list of overrides). What this module adds to `config_flags`:

- `section(cls)`: a config section built from the dataclass it configures, so every default lives
  once (in the dataclass) and every field is settable from the command line. Optional fields
  (`X | None`) accept a Python literal, `None` included (`--config.train.tis_cap=None`).
- `to_dataclass(cls, section, name)`: the section back as the dataclass, type-checked.
- One-line errors that name the key and the fix, before any work starts:
  "config key train.clip_low unknown; did you mean train.clip_eps_low?".
- `load(spec, overrides)`: the same parsing without a command line (tests, sweeps, the ablation);
  `override_args(argv, cfg)` reads a command line's overrides as the `key=value` list it takes.
- `parser(retired)`: `parse_flags` for an entry point some of whose flags `--config.key=value`
  replaced: each is one line naming the new form ("--override is gone; write --config.steps=3
  instead").
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import pathlib
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import ml_collections
from absl import app, flags
from ml_collections import config_flags

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file, key or value that cannot be used; the message names it and the fix."""


# --------------------------------------------------------------------------------------------------
# Sections <-> dataclasses
# --------------------------------------------------------------------------------------------------

def _field_types(cls: type) -> dict[str, tuple[type, ...]]:
    """Field name -> the accepted value types of a dataclass field (NoneType included if Optional)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        out[f.name] = tuple(typing.get_origin(a) or a for a in args)
    return out


def _is_optional(accepted: tuple[type, ...]) -> bool:
    return type(None) in accepted


def section(cls: type, **values: Any) -> ml_collections.ConfigDict:
    """A ConfigDict with every field of dataclass `cls`: its default, or the value given here.

    Optional fields become FieldReferences of type `object`, so the command line can set them to a
    value or to None; `to_dataclass` type-checks them. Float fields always hold floats (so an
    override such as `=3e-6` or `=1` parses as a float).
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(_unknown_message(f"{cls.__name__}.{unknown[0]}", [f"{cls.__name__}.{n}" for n in names]))
    types_ = _field_types(cls)
    c = ml_collections.ConfigDict()
    for f in dataclasses.fields(cls):
        if f.name in values:
            value = values[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            raise ConfigError(f"{cls.__name__}.{f.name} has no default; pass it to configlib.section")
        accepted = types_[f.name]
        if _is_optional(accepted):
            c[f.name] = ml_collections.FieldReference(value, field_type=object)
        elif accepted == (float,) and isinstance(value, int) and not isinstance(value, bool):
            c[f.name] = float(value)
        elif isinstance(value, tuple):
            c[f.name] = list(value)  # config_flags parses list literals; tuples need repeated flags
        else:
            c[f.name] = value
    return c


def _check_type(where: str, value: Any, accepted: tuple[type, ...]) -> Any:
    if value is None and _is_optional(accepted):
        return None
    for t in accepted:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is tuple and isinstance(value, (list, tuple)):
            return tuple(value)
        if t is int and isinstance(value, bool):
            continue
        if t is not type(None) and isinstance(value, t):
            return value
    names = " or ".join("None" if t is type(None) else t.__name__ for t in accepted)
    raise ConfigError(f"config key {where}={value!r} must be {names}")


def to_dataclass(cls: type[T], values: ml_collections.ConfigDict | dict[str, Any], name: str) -> T:
    """The config section `name` as dataclass `cls`: every key must be a field, every value its type."""
    d = values.to_dict() if isinstance(values, ml_collections.ConfigDict) else dict(values)
    types_ = _field_types(cls)
    for k in d:
        if k not in types_:
            raise ConfigError(_unknown_message(f"{name}.{k}", [f"{name}.{f}" for f in types_]))
    checked = {k: _check_type(f"{name}.{k}", v, types_[k]) for k, v in d.items()}
    try:
        return cls(**checked)
    except ValueError as exc:
        # The top-level keys (steps, epochs, ...) are no section: "config: steps must be >= 0, got -1".
        # A message that names its key ("train.learning_rate must be in (0, 1], got nan") needs no section.
        if str(exc).startswith(f"{name}."):
            raise ConfigError(f"config key {exc}") from None
        raise ConfigError(f"{name}: {exc}" if name == "config" else f"config section {name}: {exc}") from None


def train_config(values: ml_collections.ConfigDict) -> Any:
    """The `train` section as a `TrainConfig`."""
    from workflow_r1.rl.train_state import TrainConfig

    return to_dataclass(TrainConfig, values, "train")


# --------------------------------------------------------------------------------------------------
# Loading and overrides
# --------------------------------------------------------------------------------------------------

def _keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for k, v in cfg.items():
        out.append(prefix + k)
        if isinstance(v, ml_collections.ConfigDict):
            out += _keys(v, prefix + k + ".")
    return out


def _unknown_message(key: str, known: Sequence[str]) -> str:
    hint = difflib.get_close_matches(key, list(known), n=1)
    return f"config key {key} unknown" + (f"; did you mean {hint[0]}?" if hint else "")


def check_keys(cfg: ml_collections.ConfigDict, keys: Sequence[str]) -> None:
    """Raises ConfigError (with a did-you-mean) for the first dotted key that `cfg` does not have."""
    known = _keys(cfg)
    for key in keys:
        node: Any = cfg
        parts = key.split(".")
        for i, name in enumerate(parts):
            if not isinstance(node, ml_collections.ConfigDict) or name not in node:
                raise ConfigError(_unknown_message(".".join(parts[:i + 1]), known))
            node = node[name]


def _import_root(path: pathlib.Path) -> str:
    """The directory that makes `from configs import base` resolve for a file in configs/."""
    return str(path.resolve().parents[1])


def read_file(spec: str) -> ml_collections.ConfigDict:
    """`FILE.py[:PRESET]` -> its get_config(PRESET), with one-line errors for a bad path or preset."""
    path, _, preset = spec.partition(":")
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path} not found (the configs live in configs/, e.g. "
                          "--config=configs/gsspo.py:local)")
    root = _import_root(file)
    if root not in sys.path:
        sys.path.insert(0, root)
    return _parse(spec, (), lock=False)


_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")


def _overrides_in(argv: Sequence[str]) -> list[str]:
    return [m.group(1) for a in argv if (m := _OVERRIDE.match(a))]


def _config_spec_in(argv: Sequence[str], default: str | None) -> str | None:
    spec = default
    for i, a in enumerate(argv):
        if a.startswith(("--config=", "-config=")):
            spec = a.split("=", 1)[1]
        elif a in ("--config", "-config") and i + 1 < len(argv):
            spec = argv[i + 1]
    return spec


def override_args(argv: Sequence[str], cfg: ml_collections.ConfigDict) -> list[str]:
    """The `--config.key=value` overrides of a command line as `key=value` strings, in order, for
    `load` (`--config.key value` and, for a bool, `--config.key` / `--noconfig.key` too). A sweep
    or the ablation passes them on to every run it makes."""
    out, args, i = [], list(argv), 0
    while i < len(args):
        m = re.match(r"^--?(no)?config\.([^=]+)(=(.*))?$", args[i], flags=re.S)
        i += 1
        if not m:
            continue
        negated, key, value = m.group(1), m.group(2), m.group(4)
        if value is None:
            node: Any = cfg
            for part in key.split("."):
                node = node[part] if isinstance(node, ml_collections.ConfigDict) and part in node else None
            if negated or isinstance(node, bool) or i >= len(args):
                value = "False" if negated else "True"
            else:
                value, i = args[i], i + 1
        out.append(f"{key}={value}")
    return out


# A flag an entry point had before `--config.key=value` did its work -> what to write instead: a
# string, or a function of the value given (None when none was).
Retired = Mapping[str, str | Callable[[str | None], str]]


def _retired_in(argv: Sequence[str], retired: Retired) -> str | None:
    for i, a in enumerate(argv):
        name, eq, value = a.lstrip("-").partition("=")
        if a.startswith("-") and name in retired:
            instead = retired[name]
            given = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            return f"--{name} is gone; write {instead(given) if callable(instead) else instead} instead"
    return None


def parser(retired: Retired) -> Callable[[list[str]], list[str]]:
    """`parse_flags` that also refuses each of `retired`'s flags in one line naming the new form,
    e.g. "--override is gone; write --config.model.checkpoint=/m instead"."""
    return functools.partial(parse_flags, retired=retired)


def parse_flags(argv: list[str], retired: Retired | None = None) -> list[str]:
    """absl `flags_parser` for entry points with a `--config` flag: checks the config file and every
    `--config.*` key first (and refuses a `retired` flag), printing one line and exiting with status
    2 on a mistake, then parses."""
    gone = _retired_in(argv[1:], retired or {})
    if gone:
        print(f"error: {gone}", file=sys.stderr)
        raise SystemExit(2)
    default = flags.FLAGS["config"].default if "config" in flags.FLAGS else None
    spec = _config_spec_in(argv[1:], default if isinstance(default, str) else None)
    try:
        if spec:
            check_keys(read_file(spec), _overrides_in(argv[1:]))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        return flags.FLAGS(argv)
    except flags.Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def load(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """`FILE.py[:PRESET]` with `key=value` overrides, parsed exactly as `--config.key=value` would be."""
    cfg = read_file(spec)  # one-line errors for the file; registers the import root
    check_keys(cfg, [o.partition("=")[0] for o in overrides])
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} must look like section.key=value")
    return _parse(spec, overrides, lock=True)


def _parse(spec: str, overrides: Sequence[str], lock: bool) -> ml_collections.ConfigDict:
    """Runs config_flags on a private flag registry: `--config=spec --config.<override> ...`."""
    argv = ["load", f"--config={spec}"] + [f"--config.{o}" for o in overrides]
    fv = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=lock, sys_argv=argv)
    try:
        fv(argv)
    except flags.Error as exc:
        raise ConfigError(f"config {_error_line(exc)}") from None
    return holder.value


def _error_line(exc: Exception) -> str:
    """The informative line of an absl / config_flags error (get_config errors come with a traceback:
    its last line is the exception raised by the config file)."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    return lines[-1].strip() if "Traceback" in str(exc) else lines[0]


def app_run(main: Any) -> None:
    """`app.run(main)` with the config checks of `parse_flags`."""
    app.run(main, flags_parser=parse_flags)
