import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import build_parser, config_from_args
from gateway.config import OPTIONS, build_config
from gateway.errors import ConfigError
from gateway.routing.policies.cache_aware import CacheAwareConfig
from gateway.routing.policies.prefix_aware import PrefixAwareConfig

ROOT = Path(__file__).resolve().parent.parent


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_sglang_router_defaults_and_no_config_file_needed() -> None:
    config = parse("--backend", "http://127.0.0.1:30001", "--backend", "http://127.0.0.1:30002/")
    assert [b.url for b in config.backends] == ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    routing = config.routing
    knobs = routing.policy_config
    assert isinstance(knobs, PrefixAwareConfig) and routing.policy == "prefix_aware"
    assert (knobs.cache_threshold, knobs.balance_abs_threshold, knobs.balance_rel_threshold) == (0.3, 64, 1.5)
    assert config.max_tree_size == 67_108_864
    assert knobs.index_share == 0.85  # prefix_aware leaves the engine room for running requests
    baseline = parse("--backend", "http://127.0.0.1:1", "--policy", "cache_aware").routing.policy_config
    assert baseline.index_share == 1.0  # cache_aware models the whole pool, as it always did


def test_flags_win_over_the_file(tmp_path: Path) -> None:
    file = tmp_path / "g.toml"
    file.write_text('policy = "cache_aware"\ncache_threshold = 0.5\nport = 9000\n'
                    '[[backends]]\nurl = "http://127.0.0.1:1"\nmodel = "m"\ncapacity_tokens = 100\n'
                    '[rewrite]\nwindow_chars = 100\n')
    config = parse("--config", str(file), "--cache-threshold", "0.7", "--rewrite", "off")
    assert config.routing.policy == "cache_aware" and config.routing.policy_config == CacheAwareConfig(0.7)
    assert config.port == 9000
    assert config.backends[0].model == "m" and config.backends[0].capacity_tokens == 100
    assert config.rewrite.window_chars == 100 and config.rewrite.enabled is False


def test_shipped_example_config_is_valid() -> None:
    config = parse("--config", str(ROOT / "config" / "gateway.toml"))
    assert len(config.backends) == 3


@pytest.mark.parametrize(("values", "message"), [
    ({"cache_threshold": 1.5}, "cache_threshold must be between 0 and 1, got 1.5"),
    ({"port": True}, "port must be an integer, got True"),
    ({"policy": "fastest"}, "policy must be one of"),
    ({"cache_treshold": 0.3}, "unknown config key 'cache_treshold'"),
    ({"backends": [{"url": "127.0.0.1:30001"}]}, "backends[0].url must be an http(s) URL"),
    ({"backends": ["http://a:1", "http://a:1"]}, "lists 'http://a:1' twice"),
    ({"backends": [{"url": "http://a:1", "weight": 2}]}, "unknown config key 'backends[0].weight'"),
    ({"rewrite": {"enabled": "yes"}}, "rewrite.enabled"),
    ({"outlier_base_ejection_secs": 60, "outlier_max_ejection_secs": 30},
     "outlier_max_ejection_secs must be >= outlier_base_ejection_secs (60), got 30"),
    ({"outlier_consecutive_failures": -1}, "outlier_consecutive_failures must be >= 0, got -1"),
])
def test_bad_values_name_the_key_and_the_value(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        build_config(values, {})
    assert message in str(raised.value)


def test_no_backend_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no backends"):
        parse()


def test_help_explains_every_flag_with_its_default() -> None:
    help_text = subprocess.run([sys.executable, "-m", "gateway", "serve", "--help"], capture_output=True,
                               text=True, check=True).stdout
    for option in OPTIONS:
        assert "--" + option.key.replace("_", "-") in help_text
    assert "(default: 0.3)" in help_text and "HTTP_PROXY" in help_text


def test_config_error_exits_2_with_a_message() -> None:
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--backend", "http://a:1",
                             "--cache-threshold", "2"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "cache_threshold must be between 0 and 1, got '2'" in result.stderr
