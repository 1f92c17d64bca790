"""Names that become storage keys (experiment, learner, region) are validated before use.

Only lowercase letters, digits, '-' and '_' (1-63 characters, starting with a letter or digit),
so a name can never contain '/', '..', whitespace or anything a key could escape its prefix with.

Experiment and learner names must also differ from the fixed path segments of the store's
layout (`rounds`, `contributions`, `learners`, `syncer`, `faults`, ...: `layout` registers them as
it is imported). Such a name would make one kind of key look like another: in an experiment
named `contributions`, a learner named `rounds` could pass the key of a round's decision off as
one of its own contributions.
"""

import re
from collections.abc import Iterable

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


class InvalidName(ValueError):
    """A name that would be unsafe as part of a storage key."""


# The kinds of names that become path segments next to the layout's own.
RESERVED_KINDS = ("experiment", "learner")
_reserved: frozenset[str] = frozenset()


def reserve(segments: Iterable[str]) -> None:
    """Called by `layout` as it is imported, with the fixed segments of its keys."""
    global _reserved
    _reserved = frozenset(segments)


def reserved_names() -> frozenset[str]:
    """The names no experiment or learner may take: the layout's own path segments."""
    if not _reserved:
        # Importing the layout registers them (while it lays out its keys to find them, this
        # returns the empty set: its placeholder names pass).
        import resources.store.layout  # noqa: F401
    return _reserved


def check_name(kind: str, value: object) -> str:
    if not isinstance(value, str) or _NAME.fullmatch(value) is None:
        raise InvalidName(f"{kind} name {value!r} is not allowed: use 1-63 characters of "
                          "a-z, 0-9, '-' and '_', starting with a letter or digit")
    if kind in RESERVED_KINDS and value in reserved_names():
        raise InvalidName(f"{kind} name {value!r} is reserved: it is a path segment of the "
                          "store's layout (" + ", ".join(sorted(reserved_names())) + "), and "
                          f"as a{'n' if kind[0] in 'aeiou' else ''} {kind} name it would make "
                          "one kind of key pass for another")
    return value


def join_key(*parts: str) -> str:
    """Join key segments; each must be non-empty and free of '/', '.' or '..' segments."""
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\\" in part:
            raise InvalidName(f"unsafe key segment {part!r}")
    return "/".join(parts)
