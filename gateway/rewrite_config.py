"""The ``[rewrite]`` table of the config file: what `gateway/rewrite.py` moves, strips or keeps, and where.

Every key is optional; unknown keys, wrong types, unknown rule names, bad actions and bad regexes are errors
that name the key and the value:

    [rewrite]
    enabled = true             # global switch; a model listed in [rewrite.models] overrides it
    window_chars = 2048        # spans must start within this many characters of the prompt text
    default_action = "move"    # move | strip | keep
    disable = ["epoch"]        # built-in rules to turn off
    [rewrite.actions]          # per-rule action, built-in or user rule
    iso_datetime = "strip"
    [[rewrite.rules]]          # user rules come before the built-ins; no capturing groups (use (?:...))
    name = "ticket"
    pattern = "TICKET-[0-9]{4,}"
    action = "move"            # optional: [rewrite.actions], then this, then default_action
    [rewrite.models]
    "my-embedding-model" = false
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gateway.errors import ConfigError
from gateway.rewrite_rules import BUILTIN_RULE_NAMES, Action, RuleSpec, embeddable

_RULE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_TABLE_KEYS = ("enabled", "window_chars", "default_action", "disable", "actions", "rules", "models")
_RULE_KEYS = ("name", "pattern", "action")


@dataclass(frozen=True)
class RewriteConfig:
    enabled: bool = True
    window_chars: int = 2048
    default_action: Action = Action.MOVE
    actions: Mapping[str, Action] = field(default_factory=dict)
    disabled: frozenset[str] = frozenset()
    custom_rules: tuple[RuleSpec, ...] = ()
    models: Mapping[str, bool] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as plain values (a MappingProxyType is not picklable): workers get the config this way."""
        return (RewriteConfig, (self.enabled, self.window_chars, self.default_action, dict(self.actions),
                                self.disabled, self.custom_rules, dict(self.models)))

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", MappingProxyType(dict(self.actions)))
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        if type(self.window_chars) is not int or self.window_chars < 1:
            raise ConfigError(f"rewrite.window_chars: must be a positive integer (got {self.window_chars!r})")
        for name in sorted(self.disabled):
            if name not in BUILTIN_RULE_NAMES:
                raise ConfigError(f"rewrite.disable: {name!r} is not a built-in rule "
                                  f"(built-ins: {', '.join(BUILTIN_RULE_NAMES)})")
        names = set(BUILTIN_RULE_NAMES)
        for index, spec in enumerate(self.custom_rules):
            _check_rule(index, spec, names)
            names.add(spec.name)
        for name in self.actions:
            if name not in names:
                raise ConfigError(f"rewrite.actions.{name}: no rule has this name (got {name!r})")

    @classmethod
    def from_toml(cls, table: Mapping[str, Any]) -> RewriteConfig:
        """Build from the parsed ``[rewrite]`` table; strict about keys and types."""
        _check_keys(table, _TABLE_KEYS, "rewrite")
        disabled = _str_list(table.get("disable", []), "rewrite.disable")
        for index, name in enumerate(disabled):
            if name not in BUILTIN_RULE_NAMES:
                raise ConfigError(f"rewrite.disable[{index}]: not a built-in rule (got {name!r}; "
                                  f"built-ins: {', '.join(BUILTIN_RULE_NAMES)})")
        actions = _table(table.get("actions", {}), "rewrite.actions")
        models = _table(table.get("models", {}), "rewrite.models")
        return cls(
            enabled=_bool(table.get("enabled", True), "rewrite.enabled"),
            window_chars=_int(table.get("window_chars", 2048), "rewrite.window_chars"),
            default_action=_action(table.get("default_action", "move"), "rewrite.default_action"),
            actions={name: _action(value, f"rewrite.actions.{name}") for name, value in actions.items()},
            disabled=frozenset(disabled),
            custom_rules=_rule_specs(table.get("rules", []), "rewrite.rules"),
            models={name: _bool(value, f"rewrite.models.{name}") for name, value in models.items()},
        )


def _check_rule(index: int, spec: RuleSpec, taken: set[str]) -> None:
    key = f"rewrite.rules[{index}]"
    if not _RULE_NAME.fullmatch(spec.name) or spec.name in taken:
        why = "is already taken" if spec.name in taken else "must be letters, digits, '_', '.' or '-'"
        raise ConfigError(f"{key}.name: {why} (got {spec.name!r})")
    try:
        compiled = re.compile(spec.pattern)
        re.compile(embeddable(spec.pattern))
    except re.error as exc:
        raise ConfigError(f"{key}.pattern: invalid regular expression: {exc} (got {spec.pattern!r})") from exc
    if compiled.groups:
        raise ConfigError(f"{key}.pattern: capturing groups are not allowed, use (?:...) "
                          f"(got {spec.pattern!r})")
    if compiled.search("") is not None:
        raise ConfigError(f"{key}.pattern: matches the empty string (got {spec.pattern!r})")


def _rule_specs(value: Any, key: str) -> tuple[RuleSpec, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}: must be an array of tables (got {value!r})")
    specs = []
    for index, entry in enumerate(value):
        entry_key = f"{key}[{index}]"
        entry = _table(entry, entry_key)
        _check_keys(entry, _RULE_KEYS, entry_key)
        for required in ("name", "pattern"):
            if required not in entry:
                raise ConfigError(f"{entry_key}.{required}: missing (got {dict(entry)!r})")
        action = entry.get("action")
        specs.append(RuleSpec(_str(entry["name"], f"{entry_key}.name"),
                              _str(entry["pattern"], f"{entry_key}.pattern"),
                              None if action is None else _action(action, f"{entry_key}.action")))
    return tuple(specs)


def _check_keys(table: Mapping[str, Any], known: Sequence[str], key: str) -> None:
    for name in table:
        if name not in known:
            raise ConfigError(f"{key}.{name}: unknown key (got {name!r}; known: {', '.join(known)})")


def _table(value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
        raise ConfigError(f"{key}: must be a table (got {value!r})")
    return value


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: must be true or false (got {value!r})")
    return value


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: must be a positive integer (got {value!r})")
    return value


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: must be a string (got {value!r})")
    return value


def _str_list(value: Any, key: str) -> list[str]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}: must be an array of strings (got {value!r})")
    return [_str(item, f"{key}[{index}]") for index, item in enumerate(value)]


def _action(value: Any, key: str) -> Action:
    if isinstance(value, str):
        try:
            return Action(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: must be one of {', '.join(action.value for action in Action)} (got {value!r})")
