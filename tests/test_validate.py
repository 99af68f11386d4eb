"""The shared value parsers: TOML types and flag text accepted, anything else named with its key and value."""

import pytest

from gateway import validate
from gateway.errors import ConfigError


def test_flag_text_and_toml_types_parse_alike() -> None:
    assert validate.integer("port", "8000") == validate.integer("port", 8000) == 8000
    assert validate.number("w", "0.5") == validate.number("w", 0.5) == 0.5
    assert validate.boolean("b", "True") is validate.boolean("b", True) is True
    assert validate.strings("k", "one") == ("one",) and validate.strings("k", ["a", "b"]) == ("a", "b")


@pytest.mark.parametrize(("parse", "value", "message"), [
    (validate.integer, True, "port must be an integer, got True"),
    (validate.integer, 1.5, "port must be an integer, got 1.5"),
    (validate.number, "inf", "port must be a finite number, got 'inf'"),
    (validate.boolean, 1, "port must be true or false, got 1"),
    (validate.boolean, "yes", "port must be true or false, got 'yes'"),
    (validate.string, "", "port must be a non-empty string, got ''"),
    (validate.fraction, 2, "port must be between 0 and 1, got 2"),
    (validate.at_least(1, validate.integer), "0", "port must be >= 1, got '0'"),
    (validate.one_of(["a", "b"]), "c", "port must be one of a, b, got 'c'"),
])
def test_bad_values_name_the_key_and_the_value(parse: validate.Parse[object], value: object, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse("port", value)
    assert str(raised.value) == message


def test_list_items_are_named_by_index_and_unknown_keys_by_full_name() -> None:
    with pytest.raises(ConfigError, match=r"rewrite.disable\[1\] must be a non-empty string, got 3"):
        validate.string_list("rewrite.disable", ["a", 3])
    with pytest.raises(ConfigError, match=r"unknown config key 'rewrite.enable' \(known: enabled\)"):
        validate.known_keys("rewrite", {"enable": True}, ["enabled"])
