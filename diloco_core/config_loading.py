"""Building an `ExperimentConfig` from plain mappings (parsed YAML/TOML) and CLI overrides.

Strict: an unknown key, a wrong type or a bad value raises `ConfigError` with the dotted field
path, before anything is computed. Reading the file itself is the caller's job (no I/O here).
"""

import dataclasses
import json
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from diloco_core.config import ConfigError, ExperimentConfig, ModelConfig


def parse_config_text(text: str, fmt: str) -> dict:
    """Parse YAML or TOML text into a mapping ("yaml" | "toml")."""
    if fmt == "toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError("<file>", f"not valid TOML: {err}") from None
    if fmt == "yaml":
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError("<file>", f"not valid YAML: {' '.join(str(err).split())}"
                              ) from None
        if loaded is None:
            return {}
        if not isinstance(loaded, Mapping):
            raise ConfigError("<root>", f"must be a mapping, got {type(loaded).__name__}")
        return dict(loaded)
    raise ValueError(f"unknown config format {fmt!r}; use yaml or toml")


_INFINITY = ("inf", "+inf", "infinity", "+infinity")
# YAML 1.1 (PyYAML) reads exponent literals without a dot, such as `6e-3` or `1e6`, as strings;
# a user writing `inner.lr=6e-3` means the number.
_EXPONENT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _exponent_literal(value: Any) -> float | None:
    if isinstance(value, str) and _EXPONENT_LITERAL.fullmatch(value.strip()):
        return float(value)
    return None


def _coerce(value: Any, annotation: Any, path: str) -> Any:
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a mapping, got {value!r}")
        return build_dataclass(annotation, value, path)
    if origin is tuple:
        args = typing.get_args(annotation)
        if not isinstance(value, Sequence) or isinstance(value, str | bytes):
            raise ConfigError(path, f"must be a list, got {value!r}")
        return tuple(_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (types.UnionType, typing.Union):
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if annotation is int:
        value = v if (v := _exponent_literal(value)) is not None else value
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(path, f"must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str) and value.strip().lower() in _INFINITY:
            return math.inf  # how strict JSON (config_to_mapping) spells an unbounded setting
        value = v if (v := _exponent_literal(value)) is not None else value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {value!r}")
        return value
    return value


# Fields that moved, so that an old config gets the new name rather than a list of fields.
MOVED = {"orchestration.block_on_overlap": "sync.block_on_overlap (the simulator's pacing "
                                          "rule too)"}


def build_dataclass(cls: type, mapping: Mapping[str, Any], path: str) -> Any:
    """A config dataclass from a plain mapping, strictly: unknown keys and wrong types raise
    `ConfigError` under `path` (also used for the deployment file, outside the core)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    unknown = sorted(set(mapping) - names)
    if unknown:
        moved = MOVED.get(f"{prefix}{unknown[0]}")
        if moved is not None:
            raise ConfigError(f"{prefix}{unknown[0]}", f"moved: it is {moved} now")
        raise ConfigError(f"{prefix}{unknown[0]}",
                          f"unknown field; valid fields are {', '.join(sorted(names))}")
    kwargs = {name: _coerce(value, hints[name], f"{prefix}{name}")
              for name, value in mapping.items()}
    try:
        if cls is ModelConfig:
            preset = kwargs.pop("preset", ModelConfig.preset)
            return ModelConfig.from_preset(preset, **kwargs)
        return cls(**kwargs)
    except ConfigError as err:
        raise err.prefixed(path) if path else err from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(dotted, f"cannot set a field inside non-mapping {key!r}")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`sync.min_quorum=2` -> ("sync.min_quorum", 2); values parse as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(text, "override must look like field.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(text, "override has an empty field path")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(key, f"cannot parse value {raw!r}: {err}") from None
    return key, value


def overrides_to_mapping(overrides: Sequence[str]) -> dict:
    """`["sync.min_quorum=2", ...]` as a nested mapping, e.g. to layer under a config file."""
    tree: dict = {}
    for override in overrides:
        key, value = parse_override(override)
        _set_dotted(tree, key, value)
    return tree


def merge_mappings(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict:
    """`top` over `base`, recursively for nested mappings (lists are replaced, not merged)."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_mappings(merged[key], value)
        else:
            merged[key] = value
    return merged


def config_from_mapping(mapping: Mapping[str, Any] | None = None,
                        overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Defaults, then the mapping, then `field.path=value` overrides, validated once."""
    tree = json.loads(json.dumps(mapping or {}, default=list))  # deep copy of plain data
    for override in overrides:
        key, value = parse_override(override)
        _set_dotted(tree, key, value)
    return build_dataclass(ExperimentConfig, tree, "")


def config_to_mapping(cfg: ExperimentConfig) -> dict:
    """The full config as plain data (strict JSON/YAML-safe, infinity as "inf"), e.g. to record
    with a run; `config_from_mapping` reads it back to an equal config."""
    def strict(value: Any) -> Any:
        if isinstance(value, float) and math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [strict(v) for v in value]
        return value

    return strict(json.loads(json.dumps(dataclasses.asdict(cfg))))
