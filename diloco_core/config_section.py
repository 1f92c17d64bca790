"""A config section: a frozen dataclass that pydantic validates on construction.

The experiment config (`config.py`) and the deployment file's placements are trees of these. One
definition per field: its type (with the check its values must pass, as an `Annotated`
validator), its default, and its documentation (the string literal under it, which pydantic
reads as the field's description). The same definition validates keyword arguments, a parsed
YAML/TOML mapping, a `--set` override and the Dagster launchpad form, and is the source of the
form and of the generated `docs/config.md`. Checks across fields live in `__post_init__`.

Every failure, whichever layer finds it, is one `ConfigError` naming the dotted field path and
the reason, raised before any compute starts.
"""

import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import pydantic
import pydantic.dataclasses
from pydantic import AfterValidator, BeforeValidator


class ConfigError(ValueError):
    """A configuration value is invalid. `field` is the dotted path of the offending field."""

    def __init__(self, field_path: str, reason: str):
        self.field = field_path
        self.reason = reason
        super().__init__(f"{field_path}: {reason}")

    def prefixed(self, prefix: str) -> "ConfigError":
        return ConfigError(_join(prefix, self.field), self.reason)


def require(ok: bool, field_path: str, reason: str) -> None:
    if not ok:
        raise ConfigError(field_path, reason)


# extra="forbid": a misspelt field is an error, never a silently ignored key.
_SECTION = pydantic.ConfigDict(extra="forbid", use_attribute_docstrings=True)


def config_section(cls: type) -> type:
    """`cls` as a frozen, keyword-only pydantic dataclass whose constructor raises ConfigError
    (constructing it directly, `dataclasses.replace` or building it from a mapping)."""
    section = pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SECTION)(cls)
    validated_init = section.__init__

    @functools.wraps(validated_init)
    def __init__(self, *args, **kwargs):
        if args:    # a programming error, not a config value: said as Python would
            raise TypeError(f"{section.__name__} takes keyword arguments only")
        try:
            validated_init(self, *args, **kwargs)
        except pydantic.ValidationError as err:
            raise config_error(err, section) from None

    section.__init__ = __init__
    return section


def build_section(cls: type, mapping: Any, path: str = "") -> Any:
    """A section from a plain mapping (a parsed file, the form), validated as a whole; errors
    name their field under `path`."""
    if not isinstance(mapping, dict):
        raise ConfigError(path or "<root>", f"must be a mapping, got {mapping!r}")
    try:
        return _adapter(cls).validate_python(mapping)
    except pydantic.ValidationError as err:
        raise config_error(err, cls).prefixed(path) if path else config_error(err, cls) \
            from None


@functools.cache
def _adapter(cls: type) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(cls)


def field_docs(cls: type) -> dict[str, str]:
    """field name -> its documentation (the string literal under it), as one line."""
    return {name: " ".join((info.description or "").split())
            for name, info in cls.__pydantic_fields__.items()}


# ---- from pydantic's error to ours ----------------------------------------------------------

def _join(prefix: str, field: str) -> str:
    if not prefix:
        return field
    return f"{prefix}{field}" if field.startswith("[") else f"{prefix}.{field}"


def _path(loc: Sequence[Any]) -> str:
    path = ""
    for part in loc:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, str(part))
    return path


def _section_at(root: type, loc: Sequence[Any]) -> type | None:
    """The section class a location inside `root` names (None where it is not a section)."""
    import typing

    cls: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        hint = typing.get_type_hints(cls).get(str(part)) if hasattr(cls, "__pydantic_fields__") \
            else None
        if hint is None:
            return None
        if typing.get_origin(hint) is tuple:
            hint = typing.get_args(hint)[0]
        cls = hint
    return cls if hasattr(cls, "__pydantic_fields__") else None


_REASONS = {
    "missing": "is required",
    "missing_keyword_only_argument": "is required",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "dataclass_type": "must be a mapping",
    "dataclass_args_type": "must be a mapping",
    "dict_type": "must be a mapping",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
}


def config_error(err: pydantic.ValidationError, root: type) -> ConfigError:
    """The first of pydantic's errors as a ConfigError with the dotted path of its field."""
    first = err.errors(include_url=False)[0]
    loc, kind = tuple(first["loc"]), first["type"]
    path = _path(loc)
    raised = (first.get("ctx") or {}).get("error")
    if isinstance(raised, ConfigError):
        return raised.prefixed(path) if path else raised
    if isinstance(raised, ValueError):
        return ConfigError(path or "<root>", str(raised))
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        section = _section_at(root, loc[:-1])
        valid = ", ".join(sorted(section.__pydantic_fields__)) if section else ""
        return ConfigError(path, "unknown field" + (f"; valid fields are {valid}" if valid
                                                    else ""))
    reason = _REASONS.get(kind, first["msg"])
    if kind not in ("missing", "missing_keyword_only_argument"):
        reason = f"{reason}, got {first['input']!r}"
    return ConfigError(path or "<root>", reason)


# ---- value types: the coercions a YAML/TOML file and a --set override need ------------------

_INFINITY = ("inf", "+inf", "infinity", "+infinity")
# YAML 1.1 (PyYAML) reads exponent literals without a dot, such as `6e-3` or `1e6`, as strings;
# a user writing `inner.lr=6e-3` means the number.
_EXPONENT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _number_text(value: Any) -> Any:
    if isinstance(value, str) and _EXPONENT_LITERAL.fullmatch(value.strip()):
        return float(value)
    return value


def _integer(value: Any) -> int:
    value = _number_text(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be an integer, got {value!r}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, str) and value.strip().lower() in _INFINITY:
        return math.inf     # how strict JSON (config_to_mapping) spells an unbounded setting
    value = _number_text(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"must be a number, got {value!r}")
    return float(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


def _checked(ok: Callable[[Any], bool], reason: str) -> AfterValidator:
    """A check on a field's value: `reason` (with the value) when `ok` is false."""
    def check(value: Any) -> Any:
        if not ok(value):
            raise ValueError(f"{reason}, got {value!r}")
        return value
    return AfterValidator(check)


Integer = Annotated[int, BeforeValidator(_integer)]
Number = Annotated[float, BeforeValidator(_number)]
Flag = Annotated[bool, BeforeValidator(_flag)]


def integer_at_least(low: int, high: int | None = None, reason: str = "") -> Any:
    """An integer >= low (and <= high)."""
    if high is None:
        return Annotated[Integer, _checked(lambda v: v >= low,
                                           reason or f"must be an integer >= {low}")]
    return Annotated[Integer, _checked(lambda v: low <= v <= high,
                                       reason or f"must be an integer in [{low}, {high}]")]


def number_at_least(low: float, *, finite: bool = True, strict: bool = False,
                    note: str = "") -> Any:
    """A number > low (`strict`) or >= low, finite unless `finite` is false."""
    bound = f"{'>' if strict else '>='} {low:g}{note}"
    reason = f"must be a finite number {bound}" if finite else f"must be a number {bound}"
    return Annotated[Number, _checked(
        lambda v: (v > low if strict else v >= low) and (not finite or math.isfinite(v)),
        reason)]


def unit_interval(*, low_open: bool, high_open: bool) -> Any:
    """A number in [0, 1], with either end open."""
    interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
    return Annotated[Number, _checked(
        lambda v: math.isfinite(v) and (v > 0 if low_open else v >= 0)
        and (v < 1 if high_open else v <= 1), f"must be in {interval}")]


def one_of(*choices: str) -> Any:
    """A string that is one of `choices`."""
    return Annotated[str, _checked(lambda v: v in choices,
                                   f"must be one of {', '.join(choices)}")]


def text(ok: Callable[[str], bool], reason: str) -> Any:
    """A string that passes `ok`."""
    return Annotated[str, _checked(ok, reason)]


PositiveNumber = number_at_least(0, strict=True)
Count = integer_at_least(0)
PositiveInteger = integer_at_least(1)
