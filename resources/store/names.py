"""Names that become storage keys (experiment, learner, region) are validated before use.

Only lowercase letters, digits, '-' and '_' (1-63 characters, starting with a letter or digit),
so a name can never contain '/', '..', whitespace or anything a key could escape its prefix with.
"""

import re

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


class InvalidName(ValueError):
    """A name that would be unsafe as part of a storage key."""


def check_name(kind: str, value: object) -> str:
    if not isinstance(value, str) or _NAME.fullmatch(value) is None:
        raise InvalidName(f"{kind} name {value!r} is not allowed: use 1-63 characters of "
                          "a-z, 0-9, '-' and '_', starting with a letter or digit")
    return value


def join_key(*parts: str) -> str:
    """Join key segments; each must be non-empty and free of '/', '.' or '..' segments."""
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\\" in part:
            raise InvalidName(f"unsafe key segment {part!r}")
    return "/".join(parts)
