"""The ``[rewrite]`` table of the config file: what `gateway/rewrite/__init__.py` moves, strips or keeps, and where.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gateway import validate
from gateway.errors import ConfigError
from gateway.rewrite.rules import BUILTIN_RULE_NAMES, Action, RuleSpec, embeddable
from gateway.validate import at_least, boolean, integer, string, string_list

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
            validate.fail("rewrite.window_chars", "a positive integer", self.window_chars)
        for name in sorted(self.disabled):
            _check_builtin("rewrite.disable", name)
        names = set(BUILTIN_RULE_NAMES)
        for index, spec in enumerate(self.custom_rules):
            _check_rule(index, spec, names)
            names.add(spec.name)
        for name in self.actions:
            if name not in names:
                validate.fail(f"rewrite.actions.{name}", "the name of a rule", name)

    @classmethod
    def from_toml(cls, table: Mapping[str, Any]) -> RewriteConfig:
        """Build from the parsed ``[rewrite]`` table; strict about keys and types."""
        validate.known_keys("rewrite", table, _TABLE_KEYS)
        disabled = string_list("rewrite.disable", table.get("disable", []))
        for index, name in enumerate(disabled):
            _check_builtin(f"rewrite.disable[{index}]", name)
        actions = validate.table("rewrite.actions", table.get("actions", {}))
        models = validate.table("rewrite.models", table.get("models", {}))
        return cls(
            enabled=boolean("rewrite.enabled", table.get("enabled", True)),
            window_chars=at_least(1, integer)("rewrite.window_chars", table.get("window_chars", 2048)),
            default_action=_action("rewrite.default_action", table.get("default_action", "move")),
            actions={name: _action(f"rewrite.actions.{name}", value) for name, value in actions.items()},
            disabled=frozenset(disabled),
            custom_rules=_rule_specs("rewrite.rules", table.get("rules", [])),
            models={name: boolean(f"rewrite.models.{name}", value) for name, value in models.items()},
        )


def _check_builtin(key: str, name: str) -> None:
    if name not in BUILTIN_RULE_NAMES:
        validate.fail(key, "a built-in rule (" + ", ".join(BUILTIN_RULE_NAMES) + ")", name)


def _check_rule(index: int, spec: RuleSpec, taken: set[str]) -> None:
    key = f"rewrite.rules[{index}]"
    if spec.name in taken:
        validate.fail(f"{key}.name", "a name no other rule has", spec.name)
    if not _RULE_NAME.fullmatch(spec.name):
        validate.fail(f"{key}.name", "letters, digits, '_', '.' or '-'", spec.name)
    try:
        compiled = re.compile(spec.pattern)
        re.compile(embeddable(spec.pattern))
    except re.error as exc:
        raise ConfigError(f"{key}.pattern must be a regular expression ({exc}), got {spec.pattern!r}") from exc
    if compiled.groups:
        validate.fail(f"{key}.pattern", "free of capturing groups (use (?:...))", spec.pattern)
    if compiled.search("") is not None:
        validate.fail(f"{key}.pattern", "a pattern that cannot match the empty string", spec.pattern)


def _rule_specs(key: str, value: Any) -> tuple[RuleSpec, ...]:
    if not isinstance(value, list):
        validate.fail(key, "an array of tables", value)
    specs = []
    for index, entry in enumerate(value):
        entry_key = f"{key}[{index}]"
        entry = validate.table(entry_key, entry)
        validate.known_keys(entry_key, entry, _RULE_KEYS)
        for required in ("name", "pattern"):
            if required not in entry:
                raise ConfigError(f"{entry_key}.{required} is missing, got {dict(entry)!r}")
        action = entry.get("action")
        specs.append(RuleSpec(string(f"{entry_key}.name", entry["name"]),
                              string(f"{entry_key}.pattern", entry["pattern"]),
                              None if action is None else _action(f"{entry_key}.action", action)))
    return tuple(specs)


def _action(key: str, value: Any) -> Action:
    return validate.choice(Action)(key, value)
