"""Loading `configs/*.py` files, applying `key=value` overrides, and turning sections into typed configs.

Every config error is one line that names the key and the fix, e.g.
"config key train.clip_low unknown; did you mean train.clip_eps_low?".
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections

from workflow_r1.rl.train_step import TrainConfig


class ConfigError(ValueError):
    pass


def load(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """`spec` = "path/to/config.py[:preset]" -> its get_config(preset), with `overrides` applied."""
    path, _, preset = spec.partition(":")
    file = pathlib.Path(path)
    if not file.exists():
        raise ConfigError(f"config file {path} not found (the configs live in configs/, e.g. configs/gsspo.py)")
    mod_spec = importlib.util.spec_from_file_location(f"_config_{file.stem}", file)
    module = importlib.util.module_from_spec(mod_spec)
    root = str(file.resolve().parents[1])  # so that `from configs import base` resolves
    sys.path.insert(0, root)
    try:
        mod_spec.loader.exec_module(module)
    finally:
        sys.path.remove(root)
    cfg = module.get_config(preset) if preset else module.get_config()
    for item in overrides:
        set_key(cfg, item)
    return cfg


def _keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for k, v in cfg.items():
        out.append(prefix + k)
        if isinstance(v, ml_collections.ConfigDict):
            out += _keys(v, prefix + k + ".")
    return out


def set_key(cfg: ml_collections.ConfigDict, item: str) -> None:
    """Applies one "dotted.key=value" override; the value is a Python literal or a bare string."""
    key, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    *parents, leaf = key.split(".")
    node = cfg
    for i, name in enumerate(parents + [leaf]):
        if not isinstance(node, ml_collections.ConfigDict) or name not in node:
            dotted = ".".join((parents + [leaf])[:i + 1])
            hint = difflib.get_close_matches(dotted, _keys(cfg), n=1)
            raise ConfigError(f"config key {dotted} unknown" + (f"; did you mean {hint[0]}?" if hint else ""))
        if i < len(parents):
            node = node[name]
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    try:
        node[leaf] = value
    except TypeError as exc:
        raise ConfigError(f"config key {key}: {exc}") from None


def train_config(section: ml_collections.ConfigDict) -> TrainConfig:
    """The `train` section -> TrainConfig (every key must be a TrainConfig field)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values: dict[str, Any] = section.to_dict()
    for k in values:
        if k not in fields:
            hint = difflib.get_close_matches(k, fields, n=1)
            raise ConfigError(f"config key train.{k} unknown" + (f"; did you mean train.{hint[0]}?" if hint else ""))
    return TrainConfig(**values)
