"""Building an `ExperimentConfig` from plain mappings (parsed YAML/TOML) and CLI overrides.

Strict: an unknown key, a wrong type or a bad value raises `ConfigError` with the dotted field
path, before anything is computed (the sections' own validation, `config_section.py`). Reading
the file itself is the caller's job (no I/O here).
"""

import dataclasses
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from diloco_core.config import ConfigError, ExperimentConfig
from diloco_core.config_section import build_section


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


# Fields that moved, so that an old config gets the new name rather than a list of fields.
MOVED = {"orchestration.block_on_overlap": "sync.block_on_overlap (the simulator's pacing "
                                          "rule too)"}


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
    try:
        return build_section(ExperimentConfig, tree)
    except ConfigError as err:
        if err.field in MOVED and err.reason.startswith("unknown field"):
            raise ConfigError(err.field, f"moved: it is {MOVED[err.field]} now") from None
        raise


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
