"""`prefix-gateway serve` (the gateway), `prefix-gateway demo` (the gateway in front of simulated replicas) and
`prefix-gateway check-config FILE` (validate a config file without starting)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.config import OPTIONS, GatewayConfig, build_config, defaults, load_toml
from gateway.errors import ConfigError
from gateway.observe.logs import configure_logging

SERVE_EPILOG = """\
Every option can also be set in the TOML file given by --config, as a top-level key spelt with underscores
(cache_threshold = 0.3); flags win over the file. Backends there are [[backends]] tables with url and optional
model and capacity_tokens; prompt rewriting is the [rewrite] table. See config/gateway.toml.

Upstream calls ignore HTTP_PROXY, HTTPS_PROXY, ALL_PROXY and NO_PROXY: the gateway always talks to its
backends directly.
"""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of the options below")
    parser.add_argument("--backend", dest="backends", action="append", metavar="URL", default=argparse.SUPPRESS,
                        help="base URL of an engine replica, e.g. http://127.0.0.1:30001; repeat for each")
    parser.add_argument("--rewrite", choices=["on", "off"], default=argparse.SUPPRESS,
                        help="move volatile IDs off the prompt prefix (default on; [rewrite] table for rules)")
    parser.add_argument("--api-key-file", metavar="FILE", default=argparse.SUPPRESS,
                        help="file with client API keys, one per line (added to --api-key)")
    shown = defaults()
    for option in OPTIONS:
        default = shown[option.key]
        parser.add_argument("--" + option.key.replace("_", "-"), dest=option.key, default=argparse.SUPPRESS,
                            action="append" if option.repeatable else "store",
                            metavar=option.metavar or option.key.split("_")[-1].upper(),
                            help=f"{option.shown_help} (default: {_shown_default(default)})")


def _shown_default(value: Any) -> str:
    if value is None or value == ():
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    flags: dict[str, Any] = {key: value for key, value in vars(args).items()
                             if key not in ("config", "command", "rewrite", "handler", "api_key_file")}
    file_values = load_toml(args.config) if args.config else {}
    extra_keys = api_keys_from(getattr(args, "api_key_file", None), os.environ)
    if extra_keys:
        flags["api_key"] = [*file_values.get("api_key", []), *flags.get("api_key", []), *extra_keys]
    if "rewrite" in vars(args):
        table = dict(file_values.get("rewrite", {}))
        table["enabled"] = args.rewrite == "on"
        flags["rewrite"] = table
    config = build_config(file_values, flags)
    if not (config.backends or config.backend_dns or config.backend_file or config.admin_port):
        raise ConfigError("no backends: give --backend URL (repeatable) or [[backends]] in the config file, or "
                          "find them at run time with --backend-dns, --backend-file or --admin-port")
    return config


def api_keys_from(path: str | None, environ: Mapping[str, str]) -> list[str]:
    """Client keys kept out of the command line: one per line in a file, or comma-separated in
    PREFIX_GATEWAY_API_KEYS."""
    keys = [key.strip() for key in environ.get("PREFIX_GATEWAY_API_KEYS", "").split(",")]
    if path:
        try:
            with open(path, encoding="utf-8") as file:
                keys += [line.strip() for line in file if not line.lstrip().startswith("#")]
        except OSError as exc:
            raise ConfigError(f"api_key_file {path!r} cannot be read: {exc.strerror}") from None
    return [key for key in keys if key]


def serve(args: argparse.Namespace) -> int:
    from gateway.server import serve as run_server

    config = config_from_args(args)
    configure_logging(config.log_level, config.log_format)
    return run_server(config)


def demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    configure_logging("info")
    return run_demo(replicas=args.replicas, port=args.port, time_scale=args.time_scale, workers=args.workers)


def _demo_workers(value: str) -> int:
    """As `serve --workers` reads it (a count or auto), from the one option table."""
    try:
        workers: int = next(option for option in OPTIONS if option.key == "workers").parse("workers", value)
        return workers
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_config(args: argparse.Namespace) -> int:
    """Validate a config file as `serve --config FILE` would, without starting; errors exit 2 (see main)."""
    config = build_config(load_toml(args.file), {})
    backends = f"{len(config.backends)} backends" if config.backends else "no backends (give --backend when serving)"
    found = [*(f"DNS {name}" for name in config.backend_dns), *([f"file {config.backend_file}"] if
                                                               config.backend_file else [])]
    if found:
        backends = f"{len(config.backends)} backends + those of {', '.join(found)}"
    if config.admin_port:
        backends += f", admin API on {config.admin_host}:{config.admin_port}"
    print(f"{args.file}: valid: policy {config.routing.policy}, {backends}, listens on {config.host}:"
          f"{config.port}, rewrite {'on' if config.rewrite.enabled else 'off'}, log {config.log_format}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefix-gateway",
                                     description="Prefix-aware load-balancing gateway for LLM serving replicas.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the gateway in front of engine replicas",
                                       epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(serve_parser)
    serve_parser.set_defaults(handler=serve)
    demo_parser = commands.add_parser("demo", help="run the gateway in front of simulated replicas (no GPU)")
    demo_parser.add_argument("--replicas", type=int, default=4, help="simulated LLM replicas (default: 4)")
    demo_parser.add_argument("--port", type=int, default=8000, help="port of the gateway (default: 8000)")
    demo_parser.add_argument("--time-scale", type=float, default=0.1,
                             help="speed of the simulated engines: 1.0 = an 8B model on one H100, "
                                  "0.1 = ten times faster (default: 0.1)")
    demo_parser.add_argument("--workers", type=_demo_workers, default=1, metavar="N",
                             help="gateway processes on the port, sharing routing state through a private "
                                  "redis-server (needs redis-server installed; default: 1)")
    demo_parser.set_defaults(handler=demo)
    check_parser = commands.add_parser("check-config", help="validate a TOML config file without starting")
    check_parser.add_argument("file", metavar="FILE", help="the TOML file `serve --config` would read")
    check_parser.set_defaults(handler=check_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except ConfigError as exc:
        print(f"prefix-gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
