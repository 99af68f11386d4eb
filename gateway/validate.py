"""Parsers for configuration values, shared by the option table (`config.py`) and the `[rewrite]` table
(`rewrite_config.py`) so both read and complain alike.

Every parser takes `(key, value)` and returns the value as its type, or raises `ConfigError` saying
`KEY must be WHAT, got VALUE`. A value may come as its TOML type or as the text a command-line flag carries
(`"8000"`, `"true"`); anything else is an error, never a guess (`"yes"` is not a boolean, `1` is not `true`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from enum import Enum
from typing import Any, NoReturn, TypeVar

from gateway.errors import ConfigError

T = TypeVar("T")
E = TypeVar("E", bound=Enum)
N = TypeVar("N", int, float)
Parse = Callable[[str, Any], T]


def fail(key: str, expected: str, value: Any) -> NoReturn:
    raise ConfigError(f"{key} must be {expected}, got {value!r}")


def integer(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        fail(key, "an integer", value)
    try:
        return int(value)
    except ValueError:
        fail(key, "an integer", value)


def number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        fail(key, "a number", value)
    try:
        parsed = float(value)
    except ValueError:
        fail(key, "a number", value)
    if not math.isfinite(parsed):
        fail(key, "a finite number", value)
    return parsed


def string(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        fail(key, "a non-empty string", value)
    return value


def boolean(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    fail(key, "true or false", value)


def string_list(key: str, value: Any) -> list[str]:
    """A TOML array of strings; each bad item is named by its index (`key[2]`)."""
    if not isinstance(value, list):
        fail(key, "an array of strings", value)
    return [string(f"{key}[{index}]", item) for index, item in enumerate(value)]


def strings(key: str, value: Any) -> tuple[str, ...]:
    """One string or several: a repeatable flag gives a list, a TOML key either."""
    return tuple(string_list(key, value if isinstance(value, (list, tuple)) and not isinstance(value, str)
                             else [value]))


def table(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
        fail(key, "a table", value)
    return value


def known_keys(key: str, value: Mapping[str, Any], known: Collection[str]) -> None:
    """Reject the first key of `value` not in `known`, by its full name (`key.name`)."""
    unknown = sorted(set(value) - set(known))
    if unknown:
        name = f"{key}.{unknown[0]}" if key else unknown[0]
        raise ConfigError(f"unknown config key {name!r} (known: {', '.join(sorted(known))})")


def choice(enum: type[E]) -> Parse[E]:
    def parse(key: str, value: Any) -> E:
        try:
            return enum(value)
        except ValueError:
            fail(key, "one of " + ", ".join(str(member.value) for member in enum), value)
    return parse


def one_of(names: Collection[str]) -> Parse[str]:
    """A string from a fixed set of names (e.g. the registered policies)."""
    def parse(key: str, value: Any) -> str:
        if value not in names:
            fail(key, "one of " + ", ".join(names), value)
        return str(value)
    return parse


def at_least(minimum: N, parse: Parse[N]) -> Parse[N]:
    def checked(key: str, value: Any) -> N:
        parsed = parse(key, value)
        if parsed < minimum:
            fail(key, f">= {minimum}", value)
        return parsed
    return checked


def fraction(key: str, value: Any) -> float:
    parsed = number(key, value)
    if not 0.0 <= parsed <= 1.0:
        fail(key, "between 0 and 1", value)
    return parsed
