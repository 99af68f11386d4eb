"""Configuration: one table of options serves the TOML file, the command line and `--help`.

Precedence: built-in default < `--config FILE` (TOML) < command-line flag. Every option is a top-level TOML key
spelt with underscores (`cache_threshold = 0.3`), and a flag spelt with dashes (`--cache-threshold 0.3`).
Backends are `[[backends]]` tables (`url`, optional `model` and `capacity_tokens`) or `--backend URL` flags;
flags replace the file's list. Prompt rewriting is the `[rewrite]` table (see `rewrite_config.py`).
Values are parsed strictly; a bad one raises `ConfigError` naming the key and the value.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from gateway.backends import BackendSpec
from gateway.errors import ConfigError
from gateway.headers import Network, parse_networks
from gateway.outlier import OutlierConfig
from gateway.policies import PolicyName
from gateway.rewrite_config import RewriteConfig
from gateway.router import RoutingConfig


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 5.0
    timeout_s: float = 3.0
    failure_threshold: int = 3
    success_threshold: int = 1


@dataclass(frozen=True)
class GatewayConfig:
    backends: tuple[BackendSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    rewrite: RewriteConfig = field(default_factory=RewriteConfig)
    max_tree_size: int = 67_108_864  # characters per backend index, as sglang-router
    eviction_interval_s: float = 60.0
    metrics_interval_s: float = 0.5
    request_timeout_s: float = 1800.0
    first_byte_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    max_retries: int = 2
    max_body_bytes: int = 32 * 1024 * 1024
    max_concurrent_requests: int = 1024
    max_queue_wait_s: float = 10.0
    client_body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 15.0
    write_timeout_s: float = 60.0
    shutdown_grace_s: float = 30.0
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()
    forward_client_credentials: bool = False
    trusted_proxies: tuple[Network, ...] = ()
    expose_backend_urls: bool = False
    workers: int = 1
    default_model: str | None = None
    responses_max_ids: int = 100_000  # stored-response owners remembered (gateway/responses.py)
    responses_ttl_s: float = 86_400.0
    log_level: str = "info"
    log_format: str = "text"
    state: str | None = None  # redis://HOST:PORT/DB shared by several instances (shared_state.py)

    def index_capacity_blocks(self, kv_capacity_tokens: int | None) -> int:
        """A backend's prefix-index bound in blocks: `max_tree_size` characters, or less when the share of its KV
        pool the policy models (`RoutingConfig.index_share`) holds fewer."""
        routing = self.routing
        bound_chars = self.max_tree_size
        if kv_capacity_tokens:
            modelled_tokens = kv_capacity_tokens * routing.index_share
            bound_chars = min(bound_chars, int(modelled_tokens * routing.chars_per_token))
        return max(1, bound_chars // routing.block_chars)


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key} must be an integer, got {value!r}") from None


def _float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{key} must be a number, got {value!r}") from None


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{key} must be true or false, got {value!r}")


def _strings(key: str, value: Any) -> tuple[str, ...]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(_str(key, item) for item in values)


def _networks(key: str, value: Any) -> tuple[Network, ...]:
    try:
        return parse_networks(_strings(key, value))
    except ValueError as exc:
        raise ConfigError(f"{key} must list IP addresses or networks like 10.0.0.0/8, got {value!r}: {exc}") from None


def _workers(key: str, value: Any) -> int:
    if value == "auto":
        return os.cpu_count() or 1
    return _at_least(1, _int)(key, value)


def _choice(enum: type[Enum]) -> Callable[[str, Any], Any]:
    def parse(key: str, value: Any) -> Any:
        try:
            return enum(value)
        except ValueError:
            allowed = ", ".join(str(member.value) for member in enum)
            raise ConfigError(f"{key} must be one of {allowed}, got {value!r}") from None
    return parse


def _at_least(minimum: float, parse: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    def checked(key: str, value: Any) -> Any:
        parsed = parse(key, value)
        if parsed < minimum:
            raise ConfigError(f"{key} must be >= {minimum}, got {value!r}")
        return parsed
    return checked


def _fraction(key: str, value: Any) -> float:
    parsed = _float(key, value)
    if not 0.0 <= parsed <= 1.0:
        raise ConfigError(f"{key} must be between 0 and 1, got {value!r}")
    return parsed


def _store_url(key: str, value: Any) -> str:
    parts = urlsplit(_str(key, value))
    db = parts.path.strip("/")
    if parts.scheme not in ("redis", "rediss") or not parts.hostname or not (db == "" or db.isdigit()):
        raise ConfigError(f"{key} must be a URL like redis://127.0.0.1:6379/0, got {value!r}")
    return str(value)


class LogLevel(str, Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogFormat(str, Enum):
    TEXT = "text"
    JSON = "json"


@dataclass(frozen=True)
class Option:
    key: str  # TOML key; the flag is --key-with-dashes
    section: str  # which dataclass it fills: "", "routing", "health" or "outlier"
    field: str
    parse: Callable[[str, Any], Any]
    help: str
    metavar: str | None = None
    repeatable: bool = False  # a list in TOML; the flag may be given several times


OPTIONS: tuple[Option, ...] = (
    Option("host", "", "host", _str, "address to listen on"),
    Option("port", "", "port", _at_least(1, _int), "port to listen on"),
    Option("policy", "routing", "policy", _choice(PolicyName),
           "routing policy: prefix_aware (cache affinity weighed against queued work), cache_aware "
           "(sglang-router's algorithm), round_robin, random, least_load or power_of_two", "NAME"),
    Option("cache_threshold", "routing", "cache_threshold", _fraction,
           "share of the prompt (0-1) that must be cached on a backend for affinity to count"),
    Option("balance_abs_threshold", "routing", "balance_abs_threshold", _at_least(0, _int),
           "in-flight requests by which a backend must exceed the least loaded one to count as overloaded"),
    Option("balance_rel_threshold", "routing", "balance_rel_threshold", _at_least(1.0, _float),
           "...and the factor by which it must exceed it (both must hold)"),
    Option("decode_weight_tokens", "routing", "decode_weight_tokens", _at_least(0.0, _float),
           "prefix_aware: prompt tokens of prefill one running request is worth in a backend's cost"),
    Option("affinity_weight", "routing", "affinity_weight", _at_least(1.0, _float),
           "prefix_aware: how many queued prefill tokens one uncached prompt token is worth (higher = stickier)"),
    Option("active_weight", "routing", "active_weight", _at_least(0.0, _float),
           "prefix_aware: queued prefill tokens one distinct prompt token of the running requests is worth "
           "(their KV memory; balances where long-lived conversations settle)"),
    Option("held_weight", "routing", "held_weight", _at_least(0.0, _float),
           "prefix_aware: queued prefill tokens one token of a backend's prefix index is worth to a request that "
           "starts a new branch there (a new conversation settles where the least is held)"),
    Option("block_chars", "routing", "block_chars", _at_least(8, _int),
           "characters per hashed block of the prefix index (~16 tokens at 64)"),
    Option("chars_per_token", "routing", "chars_per_token", _at_least(0.5, _float),
           "characters per token, to convert between prompt text and KV capacity in tokens"),
    Option("metrics_max_age_secs", "routing", "metrics_max_age_s", _at_least(0.0, _float),
           "seconds after which a backend's scraped load metrics are ignored as stale"),
    Option("max_tree_size", "", "max_tree_size", _at_least(64, _int),
           "upper bound of each backend's prefix index, in characters; the index is also bounded by "
           "--index-kv-share of the backend's reported KV capacity"),
    Option("index_kv_share", "routing", "index_kv_share", _fraction,
           "prefix_aware: share of a backend's reported KV capacity that its prefix index may hold: the engine "
           "keeps the rest for running requests, and predicting a hit it already evicted costs more than missing "
           "one (other policies model the whole pool, so cache_aware stays sglang-router's baseline)", "SHARE"),
    Option("eviction_interval_secs", "", "eviction_interval_s", _at_least(0.0, _float),
           "accepted for sglang-router compatibility; the index evicts on insert, so it never exceeds its bound"),
    Option("metrics_scrape_interval_secs", "", "metrics_interval_s", _at_least(0.0, _float),
           "seconds between scrapes of each backend's /metrics for queue and KV usage (0 disables)"),
    Option("health_check_interval_secs", "health", "interval_s", _at_least(0.1, _float),
           "seconds between active health checks (GET /health) of each backend"),
    Option("health_check_timeout_secs", "health", "timeout_s", _at_least(0.1, _float),
           "seconds a health check may take before it counts as failed"),
    Option("health_failure_threshold", "health", "failure_threshold", _at_least(1, _int),
           "consecutive failed checks that take a backend out"),
    Option("health_success_threshold", "health", "success_threshold", _at_least(1, _int),
           "consecutive good checks that bring a backend back"),
    Option("outlier_consecutive_failures", "outlier", "consecutive_failures", _at_least(0, _int),
           "failed requests in a row (500/502/503/504 answers, broken exchanges) that eject a backend from "
           "rotation; a refused connection or a timeout ejects at once, 4xx answers never count; 0 turns "
           "ejection off"),
    Option("outlier_base_ejection_secs", "outlier", "base_ejection_s", _at_least(0.1, _float),
           "seconds a backend's first ejection lasts; each further one while it keeps failing lasts twice as long, "
           "then it takes one request at a time until one succeeds"),
    Option("outlier_max_ejection_secs", "outlier", "max_ejection_s", _at_least(0.1, _float),
           "longest ejection, in seconds"),
    Option("request_timeout_secs", "", "request_timeout_s", _at_least(0.1, _float),
           "seconds a backend may stay silent between chunks, and may take to send a non-streamed answer (engines "
           "send its headers only when it is complete), before 504"),
    Option("first_byte_timeout_secs", "", "first_byte_timeout_s", _at_least(0.1, _float),
           "seconds a backend may take to start a streamed answer (its queue and prefill) before 504; counts as "
           "the backend's failure"),
    Option("connect_timeout_secs", "", "connect_timeout_s", _at_least(0.1, _float),
           "seconds to open a connection to a backend before trying another"),
    Option("max_retries", "", "max_retries", _at_least(0, _int),
           "times a request is sent again when its connection failed before any answer byte (to another "
           "backend when there is one)"),
    Option("max_body_bytes", "", "max_body_bytes", _at_least(1024, _int),
           "largest request body accepted, in bytes (413 above)"),
    Option("max_concurrent_requests", "", "max_concurrent_requests", _at_least(1, _int),
           "requests relayed at once; more wait (see --max-queue-wait-secs), then get 429"),
    Option("max_queue_wait_secs", "", "max_queue_wait_s", _at_least(0.0, _float),
           "seconds a request may wait for a slot before 429 with Retry-After"),
    Option("client_body_timeout_secs", "", "client_body_timeout_s", _at_least(0.1, _float),
           "seconds a client may take to send a request body before 400"),
    Option("keepalive_timeout_secs", "", "keepalive_timeout_s", _at_least(0.1, _float),
           "seconds a client connection may stay idle, or take to send its first request's headers "
           "(slow clients are closed)"),
    Option("write_timeout_secs", "", "write_timeout_s", _at_least(0.1, _float),
           "seconds a client that stopped reading an answer is given before it is dropped and the backend's "
           "request cancelled"),
    Option("shutdown_grace_secs", "", "shutdown_grace_s", _at_least(0.0, _float),
           "on SIGTERM, seconds open answers get to finish before they end with an error event"),
    Option("api_key", "", "api_keys", _strings,
           "client API key (Authorization: Bearer KEY) required on every route but /health and /ready; repeat "
           "for several; also read from --api-key-file and PREFIX_GATEWAY_API_KEYS (comma-separated)", "KEY",
           repeatable=True),
    Option("admin_api_key", "", "admin_api_keys", _strings,
           "key that alone opens /metrics, /backends and /dashboard (default: any client key does)", "KEY",
           repeatable=True),
    Option("forward_client_credentials", "", "forward_client_credentials", _bool,
           "pass the client's Authorization and Cookie headers to backends (true/false)", "BOOL"),
    Option("trusted_proxy", "", "trusted_proxies", _networks,
           "address or network of a proxy in front of the gateway whose X-Forwarded-For is extended, not "
           "replaced; repeatable", "NET", repeatable=True),
    Option("expose_backend_urls", "", "expose_backend_urls", _bool,
           "x-gateway-backend carries the backend's URL instead of its name (true/false)", "BOOL"),
    Option("workers", "", "workers", _workers,
           "processes serving the port (auto = one per core)", "N"),
    Option("default_model", "", "default_model", _str,
           "model for requests that name none, when several are served"),
    Option("state", "", "state", _store_url,
           "Redis (or Valkey) that several gateway instances share routing state through: placements, index "
           "corrections, load and health verdicts; each still routes on its local view if it is slow or gone",
           "redis://HOST:PORT/DB"),
    Option("responses_max_ids", "", "responses_max_ids", _at_least(1, _int),
           "stored responses (Responses API) whose backend the gateway remembers, to send follow-ups naming "
           "them there; the oldest are forgotten first"),
    Option("responses_ttl_secs", "", "responses_ttl_s", _at_least(1.0, _float),
           "seconds the gateway remembers which backend stored a response"),
    Option("log_level", "", "log_level", lambda key, value: _choice(LogLevel)(key, value).value,
           "log level: debug, info, warning or error"),
    Option("log_format", "", "log_format", lambda key, value: _choice(LogFormat)(key, value).value,
           "log lines as text, or json: one object per line with time, level, logger, message and the fields "
           "of the record (the access log's request_id, backend, route, match, status, duration_ms, ...)"),
)


def defaults() -> dict[str, Any]:
    """Each option's built-in default, by TOML key (for --help)."""
    config = GatewayConfig()
    sections = {"": config, "routing": config.routing, "health": config.health, "outlier": config.outlier}
    return {option.key: _shown(getattr(sections[option.section], option.field)) for option in OPTIONS}


def _shown(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"config file {path!r} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None


def build_config(file_values: Mapping[str, Any], flag_values: Mapping[str, Any]) -> GatewayConfig:
    """Merge the TOML file's values and the flags (which win) into a validated GatewayConfig."""
    merged = {**file_values, **flag_values}
    known = {option.key for option in OPTIONS} | {"backends", "rewrite"}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}")
    sections: dict[str, dict[str, Any]] = {"": {}, "routing": {}, "health": {}, "outlier": {}}
    for option in OPTIONS:
        if option.key in merged:
            sections[option.section][option.field] = option.parse(option.key, merged[option.key])
    return GatewayConfig(
        backends=parse_backends(merged.get("backends", [])),
        routing=RoutingConfig(**sections["routing"]),
        health=HealthConfig(**sections["health"]),
        outlier=_outlier(sections["outlier"]),
        rewrite=RewriteConfig.from_toml(_table("rewrite", merged.get("rewrite", {}))),
        **sections[""],
    )


def _outlier(values: dict[str, Any]) -> OutlierConfig:
    config = OutlierConfig(**values)
    if config.max_ejection_s < config.base_ejection_s:
        raise ConfigError(f"outlier_max_ejection_secs must be >= outlier_base_ejection_secs "
                          f"({config.base_ejection_s:g}), got {config.max_ejection_s:g}")
    return config


def _table(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a table, got {value!r}")
    return value


def parse_backends(value: Any) -> tuple[BackendSpec, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"backends must be a list, got {value!r}")
    specs = []
    for i, entry in enumerate(value):
        key = f"backends[{i}]"
        table = {"url": entry} if isinstance(entry, str) else dict(_table(key, entry))
        extra = sorted(set(table) - {"url", "model", "capacity_tokens", "name", "api_key"})
        if extra:
            raise ConfigError(f"unknown config key {key}.{extra[0]!r}")
        url = check_url(f"{key}.url", table.get("url"))
        model = _str(f"{key}.model", table["model"]) if "model" in table else None
        capacity = _at_least(1, _int)(f"{key}.capacity_tokens", table["capacity_tokens"]) \
            if "capacity_tokens" in table else None
        name = _str(f"{key}.name", table["name"]) if "name" in table else f"backend-{i + 1}"
        api_key = _str(f"{key}.api_key", table["api_key"]) if "api_key" in table else None
        specs.append(BackendSpec(url, model, capacity, name, api_key))
    urls = [spec.url for spec in specs]
    names = [spec.name for spec in specs]
    duplicate = next((url for url in urls if urls.count(url) > 1), None) or \
        next((name for name in names if names.count(name) > 1), None)
    if duplicate:
        raise ConfigError(f"backends lists {duplicate!r} twice")
    return tuple(specs)


def check_url(key: str, value: Any) -> str:
    url = _str(key, value).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key} must be an http(s) URL like http://127.0.0.1:30001, got {value!r}")
    return url
