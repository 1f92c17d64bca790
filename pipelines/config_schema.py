"""The experiment config as a typed schema: the `train` job's launchpad form and the config
reference (`docs/config.md`).

One source, nothing restated by hand: the config sections of `diloco_core/config.py` (pydantic
dataclasses), their types, defaults and each field's documentation (the string under it, which
pydantic keeps as the field's description). The form has every field, typed, each optional: a
field left empty keeps its default (shown in its description), so the form layers like a config
file, between the defaults and the overrides. The sections themselves validate the result (each
field's check, then the checks across fields) when the run is launched and name a bad field.

    python -m pipelines.config_schema > docs/config.md     # regenerate the reference
"""

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any

import dagster as dg
import pydantic

from diloco_core.config import ExperimentConfig, ModelConfig
from diloco_core.config_section import field_docs


def _fields(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    return getattr(hint, "__name__", str(hint))


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return "empty" if value in ((), [], "") else repr(value) if isinstance(value, str) \
        else str(value)


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    path: str
    type: str
    default: str              # the experiment default (simulator, `diloco simulate`)
    orchestrated: str         # under the orchestrated launch defaults (demo, `train`)
    doc: str


def _walk(cls: type, plain: Any, orchestrated: Any, prefix: str) -> list[FieldDoc]:
    docs = field_docs(cls)
    rows = []
    for name, hint in _fields(cls):
        path = f"{prefix}{name}"
        a, b = getattr(plain, name), getattr(orchestrated, name)
        if dataclasses.is_dataclass(hint):
            rows += _walk(hint, a, b, f"{path}.")
            continue
        doc = docs.get(name, "")
        if cls is ModelConfig and name != "preset":
            doc = f"{doc} (from the preset unless set)"
        rows.append(FieldDoc(path, _type_name(hint), _shown(a), _shown(b), doc))
    return rows


@functools.cache
def reference() -> tuple[FieldDoc, ...]:
    """Every field of the experiment config, in the order of the dataclasses."""
    from pipelines.commands.config_layers import load_config
    from pipelines.launch_defaults import ORCHESTRATED_DEFAULTS

    orchestrated = load_config(None, [], base=ORCHESTRATED_DEFAULTS)
    return tuple(_walk(ExperimentConfig, ExperimentConfig(), orchestrated, ""))


# ---- the launchpad form ----------------------------------------------------------------------

def _form_type(hint: Any) -> Any:
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return list[form_model(item) if dataclasses.is_dataclass(item) else item]
    return hint


@functools.cache
def form_model(cls: type = ExperimentConfig) -> type[dg.Config]:
    """A Dagster (pydantic) config class mirroring `cls`: nested sections for nested configs,
    every other field optional (None: keep the default), described by its documentation and its
    default under the orchestrated launch defaults."""
    docs = {row.path: row for row in reference()}
    prefix = _prefix_of(cls)
    own_docs = field_docs(cls)
    fields: dict[str, Any] = {}
    for name, hint in _fields(cls):
        if dataclasses.is_dataclass(hint):
            nested = form_model(hint)
            summary = (hint.__doc__ or "").strip().splitlines()[0]
            fields[name] = (nested, pydantic.Field(default_factory=nested, description=summary))
            continue
        row = docs.get(f"{prefix}{name}")
        described = own_docs.get(name, "")
        if row is not None:
            shown = row.orchestrated if row.orchestrated == row.default else \
                f"{row.orchestrated} ({row.default} without orchestrated_defaults)"
            described = f"{row.doc} (default: {shown})"
        fields[name] = (_form_type(hint) | None,
                        pydantic.Field(default=None, description=described))
    return pydantic.create_model(f"{cls.__name__}Form", __base__=dg.Config, **fields)


def _prefix_of(cls: type) -> str | None:
    """The dotted path of the section `cls` is, under ExperimentConfig ("" for the root);
    None for list items (outages), which have no path of their own."""
    if cls is ExperimentConfig:
        return ""
    for name, hint in _fields(ExperimentConfig):
        if hint is cls:
            return f"{name}."
    return None


def form_to_mapping(form: pydantic.BaseModel) -> dict:
    """The fields a user filled in, as a nested mapping (empty sections dropped)."""
    def prune(value: Any) -> Any:
        if isinstance(value, Mapping):
            kept = {k: prune(v) for k, v in value.items() if v is not None}
            return {k: v for k, v in kept.items() if v != {}}
        if isinstance(value, list):
            return [prune(v) for v in value]
        return value

    return prune(form.model_dump(exclude_none=True))


# ---- the reference page ----------------------------------------------------------------------

def reference_markdown() -> str:
    lines = [
        "# Experiment config reference",
        "",
        "Generated from `diloco_core/config.py` by `python -m pipelines.config_schema > "
        "docs/config.md`; a test fails when this page and the code disagree.",
        "",
        "Set a field in a YAML or TOML file (`--config`), with `--set path=value`, or in the "
        "`train` job's launchpad form (`ops.start_experiment.config.experiment`). "
        "**orchestrated** is the value `diloco demo` and the `train` job use (the orchestrated "
        "launch defaults, `pipelines/launch_defaults.py`); **default** the value without them "
        "(`diloco simulate`). `diloco config --orchestrated` prints them all for a given file "
        "and overrides.",
        "",
        "| field | type | orchestrated | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for row in reference():
        doc = row.doc.replace("|", "\\|")
        orchestrated = row.orchestrated if row.orchestrated != row.default else "same"
        lines.append(f"| `{row.path}` | {row.type} | {orchestrated} | {row.default} | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
