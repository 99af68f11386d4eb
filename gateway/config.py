"""Configuration: one table of options serves the TOML file, the command line and `--help`.

Precedence: built-in default < `--config FILE` (TOML) < command-line flag. Every option is a top-level TOML key
spelt with underscores (`cache_threshold = 0.3`), and a flag spelt with dashes (`--cache-threshold 0.3`).
Backends are `[[backends]]` tables (`url`, optional `model` and `capacity_tokens`) or `--backend URL` flags;
flags replace the file's list. Backends found at run time (`backend_dns`, `backend_file`) come on top of them.
Prompt rewriting is the `[rewrite]` table (see `rewrite_config.py`).
Values are parsed strictly; a bad one raises `ConfigError` naming the key and the value.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from gateway import validate
from gateway.api.headers import Network, parse_networks
from gateway.cpus import usable_cpus
from gateway.errors import ConfigError
from gateway.fleet.backends import BackendSpec
from gateway.fleet.discovery import DnsName
from gateway.fleet.outlier import OutlierConfig
from gateway.rewrite.config import RewriteConfig
from gateway.routing.policies import registry
from gateway.routing.router import RoutingConfig
from gateway.validate import at_least, boolean, fraction, integer, number, string, strings


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 5.0
    timeout_s: float = 3.0
    failure_threshold: int = 3
    success_threshold: int = 1


@dataclass(frozen=True)
class GatewayConfig:
    backends: tuple[BackendSpec, ...] = ()
    backend_dns: tuple[str, ...] = ()  # HOST:PORT names re-resolved for backends (fleet/discovery.py)
    backend_dns_interval_s: float = 5.0
    backend_file: str | None = None  # a file of backend URLs, watched (fleet/discovery.py)
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None  # the admin API's own listener (api/admin.py); None: off
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
    shutdown_delay_s: float = 0.0
    max_connections: int | None = None  # None: sized from the open-file limit (gateway/api/connections.py)
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()
    forward_client_credentials: bool = False
    trusted_proxies: tuple[Network, ...] = ()
    expose_backend_urls: bool = False
    workers: int = 1
    default_model: str | None = None
    responses_max_ids: int = 100_000  # stored-response owners remembered (gateway/api/responses.py)
    responses_ttl_s: float = 86_400.0
    session_header: str = "x-session-id"  # a client's session key (gateway/api/prompts.py session_key)
    log_level: str = "info"
    log_format: str = "text"
    state: str | None = None  # redis://HOST:PORT/DB shared by several instances (shared_state.py)

    def index_capacity_blocks(self, kv_capacity_tokens: int | None) -> int:
        """A backend's prefix-index bound in blocks: `max_tree_size` characters, or less when the share of its KV
        pool the policy models (its config's `index_share`) holds fewer."""
        routing = self.routing
        bound_chars = self.max_tree_size
        if kv_capacity_tokens:
            modelled_tokens = kv_capacity_tokens * routing.policy_config.index_share
            bound_chars = min(bound_chars, int(modelled_tokens * routing.chars_per_token))
        return max(1, bound_chars // routing.block_chars)


def _networks(key: str, value: Any) -> tuple[Network, ...]:
    try:
        return parse_networks(strings(key, value))
    except ValueError as exc:
        raise ConfigError(f"{key} must list IP addresses or networks like 10.0.0.0/8, got {value!r}: {exc}") from None


def _header_name(key: str, value: Any) -> str:
    if value == "":
        return ""
    name = string(key, value).strip().lower()
    if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9a-z-]+", name):
        validate.fail(key, "an HTTP header name like x-session-id", value)
    return name


def _workers(key: str, value: Any) -> int:
    if value == "auto":
        return usable_cpus()
    return at_least(1, integer)(key, value)


def _dns_names(key: str, value: Any) -> tuple[str, ...]:
    """The names, each once: a name given twice (`h:1` and `http://h:1` too) is one source, not two watching the
    same URLs."""
    unique: dict[DnsName, str] = {}
    for name in strings(key, value):
        try:
            unique.setdefault(DnsName.parse(name), name)
        except ValueError as exc:
            raise ConfigError(f"{key} must be HOST:PORT names, got {name!r}: {exc}") from None
    return tuple(unique.values())


def _store_url(key: str, value: Any) -> str:
    parts = urlsplit(string(key, value))
    db = parts.path.strip("/")
    if parts.scheme not in ("redis", "rediss") or not parts.hostname or not (db == "" or db.isdigit()):
        validate.fail(key, "a URL like redis://127.0.0.1:6379/0", value)
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
    # Which dataclass it fills: "" (GatewayConfig), "routing", "health", "outlier", or "policy": a knob of every
    # policy whose config has a field of that name (gateway/routing/policies/registry.py); --help names them.
    section: str
    field: str
    parse: Callable[[str, Any], Any]
    help: str
    metavar: str | None = None
    repeatable: bool = False  # a list in TOML; the flag may be given several times

    @property
    def shown_help(self) -> str:
        if self.section != "policy":
            return self.help
        return ", ".join(registry.policies_with(self.field)) + ": " + self.help


OPTIONS: tuple[Option, ...] = (
    Option("backend_dns", "", "backend_dns", _dns_names,
           "DNS name whose A/AAAA records are the backends (a Kubernetes headless Service), as HOST:PORT (or "
           "https://HOST:PORT), re-resolved every --backend-dns-interval-secs: new addresses join after their first "
           "good health check, vanished ones drain and leave; repeatable, combines with --backend", "HOST:PORT",
           repeatable=True),
    Option("backend_dns_interval_secs", "", "backend_dns_interval_s", at_least(0.1, number),
           "seconds between resolutions of each --backend-dns name"),
    Option("backend_file", "", "backend_file", string,
           "file of backend URLs, one per line (# starts a comment), watched for changes: added URLs join after "
           "their first good health check, removed ones drain and leave; combines with --backend", "FILE"),
    Option("admin_port", "", "admin_port", at_least(1, integer),
           "port of the admin API (GET/POST/DELETE /admin/backends: list, add, drain and remove backends at run "
           "time), a listener of its own; off unless given. It requires --admin-api-key unless --admin-host is a "
           "loopback address, and a single worker (--workers 1)"),
    Option("admin_host", "", "admin_host", string, "address the admin API listens on"),
    Option("host", "", "host", string, "address to listen on"),
    Option("port", "", "port", at_least(1, integer), "port to listen on"),
    Option("policy", "routing", "policy", validate.one_of(registry.POLICIES),
           "routing policy: " + registry.describe(), "NAME"),
    Option("cache_threshold", "policy", "cache_threshold", fraction,
           "share of the prompt (0-1) that must be cached on a backend for affinity to count"),
    Option("balance_abs_threshold", "policy", "balance_abs_threshold", at_least(0, integer),
           "in-flight requests by which a backend must exceed the least loaded one to count as overloaded"),
    Option("balance_rel_threshold", "policy", "balance_rel_threshold", at_least(1.0, number),
           "...and the factor by which it must exceed it (both must hold)"),
    Option("decode_weight_tokens", "policy", "decode_weight_tokens", at_least(0.0, number),
           "prompt tokens of prefill one running request is worth in a backend's cost"),
    Option("affinity_weight", "policy", "affinity_weight", at_least(1.0, number),
           "how many queued prefill tokens one uncached prompt token is worth on a cache three quarters full "
           "or more; on an emptier one less, down to 1 on an empty one (higher = stickier)"),
    Option("active_weight", "policy", "active_weight", at_least(0.0, number),
           "queued prefill tokens one distinct prompt token of the running requests is worth "
           "(their KV memory; balances where long-lived conversations settle)"),
    Option("held_weight", "policy", "held_weight", at_least(0.0, number),
           "queued prefill tokens one token of a backend's prefix index is worth to a request that "
           "starts a new branch there (a new conversation settles where the least is held)"),
    Option("session_weight", "policy", "session_weight", fraction,
           "how far a session key (--session-header, prompt_cache_key, user) is believed: the tokens its backend "
           "computed for the key's last request, when the index no longer predicts them, count as cached there "
           "at this share; 0 ignores keys"),
    Option("session_header", "", "session_header", _header_name,
           "request header carrying a client's session key; it wins over the body's prompt_cache_key and user "
           "(\"\" reads keys from the body only)", "NAME"),
    Option("session_max_keys", "routing", "session_max_keys", at_least(1, integer),
           "session keys whose last backend is remembered; the least recently used are forgotten first"),
    Option("session_ttl_secs", "routing", "session_ttl_s", at_least(1.0, number),
           "seconds a session key's last backend is remembered after its last request"),
    Option("block_chars", "routing", "block_chars", at_least(8, integer),
           "characters per hashed block of the prefix index (~16 tokens at 64)"),
    Option("chars_per_token", "routing", "chars_per_token", at_least(0.5, number),
           "characters per token, to convert between prompt text and KV capacity in tokens"),
    Option("metrics_max_age_secs", "policy", "metrics_max_age_s", at_least(0.0, number),
           "seconds after which a backend's scraped load metrics are ignored as stale"),
    Option("max_tree_size", "", "max_tree_size", at_least(64, integer),
           "upper bound of each backend's prefix index, in characters; the index is also bounded by "
           "--index-kv-share of the backend's reported KV capacity"),
    Option("index_kv_share", "policy", "index_kv_share", fraction,
           "share of a backend's reported KV capacity that its prefix index may hold: the engine "
           "keeps the rest for running requests, and predicting a hit it already evicted costs more than missing "
           "one (other policies model the whole pool, so cache_aware stays sglang-router's baseline)", "SHARE"),
    Option("eviction_interval_secs", "", "eviction_interval_s", at_least(0.0, number),
           "accepted for sglang-router compatibility; the index evicts on insert, so it never exceeds its bound"),
    Option("metrics_scrape_interval_secs", "", "metrics_interval_s", at_least(0.0, number),
           "seconds between scrapes of each backend's /metrics for queue and KV usage (0 disables)"),
    Option("health_check_interval_secs", "health", "interval_s", at_least(0.1, number),
           "seconds between active health checks (GET /health) of each backend"),
    Option("health_check_timeout_secs", "health", "timeout_s", at_least(0.1, number),
           "seconds a health check may take before it counts as failed"),
    Option("health_failure_threshold", "health", "failure_threshold", at_least(1, integer),
           "consecutive failed checks that take a backend out"),
    Option("health_success_threshold", "health", "success_threshold", at_least(1, integer),
           "consecutive good checks that bring a backend back"),
    Option("outlier_consecutive_failures", "outlier", "consecutive_failures", at_least(0, integer),
           "failed requests in a row (500/502/503/504 answers, broken exchanges) that eject a backend from "
           "rotation; a refused connection or a timeout ejects at once, 4xx answers never count; 0 turns "
           "ejection off"),
    Option("outlier_base_ejection_secs", "outlier", "base_ejection_s", at_least(0.1, number),
           "seconds a backend's first ejection lasts; each further one while it keeps failing lasts twice as long, "
           "then it takes one request at a time until one succeeds"),
    Option("outlier_max_ejection_secs", "outlier", "max_ejection_s", at_least(0.1, number),
           "longest ejection, in seconds"),
    Option("request_timeout_secs", "", "request_timeout_s", at_least(0.1, number),
           "seconds a backend may stay silent between chunks, and may take to send a non-streamed answer (engines "
           "send its headers only when it is complete), before 504"),
    Option("first_byte_timeout_secs", "", "first_byte_timeout_s", at_least(0.1, number),
           "seconds a backend may take to start a streamed answer (its queue and prefill) before 504; counts as "
           "the backend's failure"),
    Option("connect_timeout_secs", "", "connect_timeout_s", at_least(0.1, number),
           "seconds to open a connection to a backend before trying another"),
    Option("max_retries", "", "max_retries", at_least(0, integer),
           "times a request is sent again when its connection failed before any answer byte (to another "
           "backend when there is one)"),
    Option("max_body_bytes", "", "max_body_bytes", at_least(1024, integer),
           "largest request body accepted, in bytes (413 above)"),
    Option("max_concurrent_requests", "", "max_concurrent_requests", at_least(1, integer),
           "requests relayed at once; more wait (see --max-queue-wait-secs), then get 429"),
    Option("max_queue_wait_secs", "", "max_queue_wait_s", at_least(0.0, number),
           "seconds a request may wait for a slot before 429 with Retry-After"),
    Option("client_body_timeout_secs", "", "client_body_timeout_s", at_least(0.1, number),
           "seconds a client may take to send a request body before 400"),
    Option("keepalive_timeout_secs", "", "keepalive_timeout_s", at_least(0.1, number),
           "seconds a client connection may stay idle, or take to send its first request's headers "
           "(slow clients are closed)"),
    Option("write_timeout_secs", "", "write_timeout_s", at_least(0.1, number),
           "seconds a client that stopped reading an answer is given before it is dropped and the backend's "
           "request cancelled"),
    Option("shutdown_grace_secs", "", "shutdown_grace_s", at_least(0.0, number),
           "on SIGTERM, seconds open requests get to finish; then open streams end with an SSE error event "
           "and requests still waiting for their backend get 503"),
    Option("shutdown_delay_secs", "", "shutdown_delay_s", at_least(0.0, number),
           "on SIGTERM, seconds /ready answers 503 while the gateway still accepts and serves, before it stops "
           "accepting and the grace period starts: time for load balancers (probing /ready, or Kubernetes spreading "
           "the endpoint's removal) to stop sending; 0 stops accepting at once"),
    Option("max_connections", "", "max_connections", at_least(1, integer),
           "client connections open at once, per worker; a new one beyond is closed unanswered (counted in "
           "gateway_client_connections_refused_total); none = the open-file limit less 64, halved, leaving the "
           "rest for backend connections and files", "N"),
    Option("api_key", "", "api_keys", strings,
           "client API key (Authorization: Bearer KEY) required on every route but /health and /ready; repeat "
           "for several; also read from --api-key-file and PREFIX_GATEWAY_API_KEYS (comma-separated)", "KEY",
           repeatable=True),
    Option("admin_api_key", "", "admin_api_keys", strings,
           "key that alone opens /metrics, /backends and /dashboard (without one, any client key does) and the "
           "admin API of --admin-port", "KEY",
           repeatable=True),
    Option("forward_client_credentials", "", "forward_client_credentials", boolean,
           "pass the client's Authorization and Cookie headers to backends (true/false)", "BOOL"),
    Option("trusted_proxy", "", "trusted_proxies", _networks,
           "address or network of a proxy in front of the gateway whose X-Forwarded-For is extended, not "
           "replaced; repeatable", "NET", repeatable=True),
    Option("expose_backend_urls", "", "expose_backend_urls", boolean,
           "x-gateway-backend carries the backend's URL instead of its name (true/false)", "BOOL"),
    Option("workers", "", "workers", _workers,
           "processes serving the port (auto = one per CPU the gateway may use: its CPU affinity, capped by a "
           "container's CPU limit)", "N"),
    Option("default_model", "", "default_model", string,
           "model for requests that name none, when several are served"),
    Option("state", "", "state", _store_url,
           "Redis (or Valkey) that several gateway instances share routing state through: placements, index "
           "corrections, load and health verdicts; each still routes on its local view if it is slow or gone",
           "redis://HOST:PORT/DB"),
    Option("responses_max_ids", "", "responses_max_ids", at_least(1, integer),
           "stored responses (Responses API) whose backend the gateway remembers, to send follow-ups naming "
           "them there; the oldest are forgotten first"),
    Option("responses_ttl_secs", "", "responses_ttl_s", at_least(1.0, number),
           "seconds the gateway remembers which backend stored a response"),
    Option("log_level", "", "log_level", lambda key, value: validate.choice(LogLevel)(key, value).value,
           "log level: debug, info, warning or error"),
    Option("log_format", "", "log_format", lambda key, value: validate.choice(LogFormat)(key, value).value,
           "log lines as text, or json: one object per line with time, level, logger, message and the fields "
           "of the record (the access log's request_id, backend, route, match, status, duration_ms, ...)"),
)


def defaults() -> dict[str, Any]:
    """Each option's built-in default, by TOML key (for --help)."""
    config = GatewayConfig()
    sections = {"": config, "routing": config.routing, "health": config.health, "outlier": config.outlier}
    return {option.key: _shown(registry.knob_default(option.field) if option.section == "policy"
                               else getattr(sections[option.section], option.field)) for option in OPTIONS}


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
    validate.known_keys("", merged, [option.key for option in OPTIONS] + ["backends", "rewrite"])
    sections: dict[str, dict[str, Any]] = {"": {}, "routing": {}, "health": {}, "outlier": {}, "policy": {}}
    for option in OPTIONS:
        if option.key in merged:
            sections[option.section][option.field] = option.parse(option.key, merged[option.key])
    routing = sections["routing"]
    policy = routing.setdefault("policy", registry.DEFAULT_POLICY)
    return _checked(GatewayConfig(
        backends=parse_backends(merged.get("backends", [])),
        routing=RoutingConfig(policy_config=registry.configure(policy, sections["policy"]), **routing),
        health=HealthConfig(**sections["health"]),
        outlier=_outlier(sections["outlier"]),
        rewrite=RewriteConfig.from_toml(validate.table("rewrite", merged.get("rewrite", {}))),
        **sections[""],
    ))


def _checked(config: GatewayConfig) -> GatewayConfig:
    """What no single option can say is wrong: the admin API's guard and its single process."""
    if config.admin_port is None:
        return config
    if not config.admin_api_keys and not is_loopback(config.admin_host):
        raise ConfigError(f"admin_port on {config.admin_host!r} needs admin_api_key: without one only a loopback "
                          "admin_host (127.0.0.1, ::1, localhost) may serve the admin API")
    if config.workers > 1:
        raise ConfigError("admin_port needs workers = 1: each worker has its own pool, and an admin request would "
                          "reach one of them; change backends of several workers with backend_file or backend_dns")
    if config.admin_port == config.port and config.admin_host == config.host:
        raise ConfigError(f"admin_port must differ from port ({config.port})")
    return config


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _outlier(values: dict[str, Any]) -> OutlierConfig:
    config = OutlierConfig(**values)
    if config.max_ejection_s < config.base_ejection_s:
        raise ConfigError(f"outlier_max_ejection_secs must be >= outlier_base_ejection_secs "
                          f"({config.base_ejection_s:g}), got {config.max_ejection_s:g}")
    return config


def parse_backends(value: Any) -> tuple[BackendSpec, ...]:
    if not isinstance(value, list):
        validate.fail("backends", "a list", value)
    specs = []
    for i, entry in enumerate(value):
        key = f"backends[{i}]"
        table = {"url": entry} if isinstance(entry, str) else dict(validate.table(key, entry))
        validate.known_keys(key, table, ("url", "model", "capacity_tokens", "name", "api_key"))
        url = check_url(f"{key}.url", table.get("url"))
        model = string(f"{key}.model", table["model"]) if "model" in table else None
        capacity = at_least(1, integer)(f"{key}.capacity_tokens", table["capacity_tokens"]) \
            if "capacity_tokens" in table else None
        name = string(f"{key}.name", table["name"]) if "name" in table else f"backend-{i + 1}"
        api_key = string(f"{key}.api_key", table["api_key"]) if "api_key" in table else None
        specs.append(BackendSpec(url, model, capacity, name, api_key))
    urls = [spec.url for spec in specs]
    names = [spec.name for spec in specs]
    duplicate = next((url for url in urls if urls.count(url) > 1), None) or \
        next((name for name in names if names.count(name) > 1), None)
    if duplicate:
        raise ConfigError(f"backends lists {duplicate!r} twice")
    return tuple(specs)


def check_url(key: str, value: Any) -> str:
    url = string(key, value).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        validate.fail(key, "an http(s) URL like http://127.0.0.1:30001", value)
    return url
