"""`python -m loadtest`: run scenarios side by side, list them, compare runs, or measure the gateway's own overhead."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.routing.policies.registry import POLICIES
from loadtest.compare import compare
from loadtest.cost import STEPS, CostConfig, cost_columns, cost_rows, measure_one_step, run_cpu, run_instructions
from loadtest.fronts import DEFAULT_FRONTS, FRONTS, front_names, missing
from loadtest.nginx import nginx_installed
from loadtest.overhead import OverheadConfig, run_overhead
from loadtest.overhead_report import COLUMNS as OVERHEAD_COLUMNS
from loadtest.overhead_report import overhead_rows, target_lines
from loadtest.report import markdown_table, print_report, text_table, write_outputs
from loadtest.runner import PEERS, Instances, Traffic, run_policies, run_target
from loadtest.scenarios import LoadLevel, Scenario, SessionKeys, list_scenarios, load_scenario, with_overrides
from loadtest.workload import generate, request_count, working_set_tokens
from loadtest.wrk import wrk_installed

DEFAULT_POLICIES = "round_robin,cache_aware,prefix_aware"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one scenario through each policy on a fresh fleet",
                              description="Run one scenario through each policy (and the peer), each on a fresh "
                              "fleet of simulated replicas, with the same seeded requests. Values left out come "
                              "from the scenario file (`python -m loadtest list`).")
    add_run_arguments(run)
    add_workload_arguments(run)
    add_arrival_arguments(run)
    add_fleet_arguments(run)
    add_target_arguments(run)
    commands.add_parser("list", help="list the scenario presets with their sizes and default loads")
    overhead = commands.add_parser("overhead", help="what each front costs: direct, sglang-router, smg, the gateway",
                                   description="Side by side, in one run: requests/s at 16 and 64 connections, "
                                   "latency at 1, CPU per request, memory and streamed chunks/s of each front "
                                   "before a zero-cost backend. Needs wrk and nginx (Debian: apt-get install wrk "
                                   "nginx-light).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_overhead_arguments(overhead)
    cost = commands.add_parser("cost", help="where a relayed request's CPU goes: the gateway's steps one at a time",
                               description="The gateway's steps added one at a time to a bare aiohttp relay, in "
                               "one process with the client and a zero-cost backend: CPU time (or, with "
                               "--instructions, instructions counted by valgrind) per request at each step.",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_cost_arguments(cost)
    table = commands.add_parser("compare", help="one markdown table over the --out directories of several runs",
                                description="One markdown table over several runs, with prefix_aware's p99 TTFT "
                                "and goodput as ratios to cache_aware's and round_robin's from the same run.")
    table.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="the --out directory of a `run`")
    return parser


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("scenario", help=f"a preset ({', '.join(list_scenarios())}) or a path to a TOML file")
    run.add_argument("--policies", default=DEFAULT_POLICIES, metavar="LIST",
                     help=f"comma-separated gateway policies, one run each (default: {DEFAULT_POLICIES})")
    run.add_argument("--peer", choices=PEERS, action="append", default=[],
                     help="also run this peer router (its cache_aware policy) in front of the same kind of fleet; "
                          "repeatable; skipped with a message when not installed (default: none)")
    run.add_argument("--out", type=Path, default=None, metavar="DIR",
                     help="write results.json, report.md and PNG plots here (default: print the table only)")
    run.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def add_workload_arguments(run: argparse.ArgumentParser) -> None:
    knobs = run.add_argument_group("workload (defaults from the scenario file)")
    knobs.add_argument("--num-prompts", type=int, default=None, metavar="N",
                       help="number of requests (multiturn: clients = N // rounds); default: groups x prompts "
                            "per group, or clients x rounds")
    knobs.add_argument("--seed", type=int, default=None, help="seed of texts, lengths, order and arrivals (default 0)")
    knobs.add_argument("--scale", type=float, default=None, metavar="FACTOR",
                       help="factor on every token length of the scenario (presets: 0.25, b2b-saas 0.0625)")
    knobs.add_argument("--random-range-ratio", type=float, default=None, metavar="RATIO",
                       help="lengths drawn uniformly from [L x RATIO, L] as in SGLang's bench; default 1.0 = fixed")
    knobs.add_argument("--session-keys", choices=[keys.value for keys in SessionKeys], default=None,
                       help="multiturn: how each conversation sends its session key (prompt_cache_key, user, the "
                            "x-session-id header) or none (default: the scenario's, else none)")
    slo = run.add_argument_group("goodput SLOs (simulated seconds)")
    slo.add_argument("--slo-ttft", type=float, default=None, metavar="S", help="TTFT target in s (default 2.0)")
    slo.add_argument("--slo-tpot", type=float, default=None, metavar="S", help="TPOT target in s (default 0.1)")


def add_arrival_arguments(run: argparse.ArgumentParser) -> None:
    load = run.add_argument_group("arrivals (simulated requests/s; multiturn: a round is ready when the "
                                  "previous round of its client has answered)")
    load.add_argument("--load", choices=[level.value for level in LoadLevel], default=None,
                      help="use the scenario's calibrated Poisson rate for this level (default: knee)")
    load.add_argument("--request-rate", type=float, default=None, metavar="RPS",
                      help="Poisson arrival rate in simulated requests/s (overrides --load)")
    load.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                      help="cap on requests in flight; given alone (no rate, no --load) it makes a closed loop "
                           "(default: the scenario's [load] max_concurrency, if any: a closed-loop preset)")
    load.add_argument("--no-stream", action="store_true", help="non-streaming requests (then TTFT = E2E)")


def add_fleet_arguments(run: argparse.ArgumentParser) -> None:
    fleet = run.add_argument_group("fleet (defaults from the scenario file)")
    fleet.add_argument("--replicas", type=int, default=None, metavar="N", help="simulated LLM replicas (presets: 4)")
    fleet.add_argument("--kv-capacity-tokens", type=int, default=None, metavar="TOKENS",
                       help="KV cache capacity of every replica in tokens (replaces a preset's per-replica "
                            "capacities)")
    fleet.add_argument("--time-scale", type=float, default=None, metavar="S",
                       help="wall seconds per simulated second (presets: 8.0); reported times are wall / S")
    fleet.add_argument("--max-running-requests", type=int, default=None, metavar="N",
                       help="per-replica batch cap (default: the replica's, 256)")
    fleet.add_argument("--instances", type=int, default=1, metavar="N",
                       help="gateway instances in front of the fleet, each request sent to the next (default 1)")
    fleet.add_argument("--state", action="store_true",
                       help="the instances share routing state through one redis-server started for the run")
    fleet.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for `gateway serve`, repeatable, e.g. --gateway-arg=--rewrite=off")


def add_target_arguments(run: argparse.ArgumentParser) -> None:
    target = run.add_argument_group("real deployment")
    target.add_argument("--target", default=None, metavar="URL",
                        help="base URL of a running OpenAI-compatible endpoint: no fleet is started, "
                             "--policies/--peer are ignored, times are real seconds")
    target.add_argument("--model", default=None, help="model for --target (default: the first of /v1/models)")
    target.add_argument("--oracle-capacity-tokens", type=int, default=None, metavar="TOKENS",
                        help="--target: total KV tokens of the deployment, for the oracle (default: no oracle)")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_overhead_arguments(overhead: argparse.ArgumentParser) -> None:
    overhead.add_argument("--rounds", type=positive_int, default=3,
                          help="interleaved rounds over the fronts; each figure is the median")
    overhead.add_argument("--duration-secs", type=positive_int, default=10, metavar="SECS",
                          help="measured seconds of each point, whole (after a warm-up of a fifth of it, 1-2 s)")
    overhead.add_argument("--fronts", default=",".join(DEFAULT_FRONTS), metavar="LIST",
                          help=f"comma-separated fronts to compare, of: {', '.join(FRONTS)}")
    overhead.add_argument("--stream-chunks", type=positive_int, default=64, metavar="N",
                          help="SSE chunks per streamed answer (one every 2 ms)")
    overhead.add_argument("--skip-peers", action="store_true", help="leave sglang-router and smg out")
    overhead.add_argument("--out", type=Path, default=None, metavar="DIR",
                          help="also write overhead.json and overhead.md here")


def add_cost_arguments(cost: argparse.ArgumentParser) -> None:
    cost.add_argument("--requests", type=positive_int, default=CostConfig.requests, metavar="N",
                      help="measured requests per step and round, after a warm-up")
    cost.add_argument("--rounds", type=positive_int, default=CostConfig.rounds,
                      help="interleaved rounds over the steps; each figure is the median (CPU time only)")
    cost.add_argument("--policy", default=CostConfig.policy, choices=list(POLICIES),
                      help="the gateway's routing policy")
    cost.add_argument("--steps", default=",".join(STEPS), metavar="LIST",
                      help=f"comma-separated steps to measure, of: {', '.join(STEPS)}")
    cost.add_argument("--system-tokens", type=positive_int, default=CostConfig.system_tokens, metavar="N",
                      help="tokens (~4 characters each) of the system prompt every request shares; each request "
                           "adds ~100 of its own (the overhead benchmark's prompts by default)")
    cost.add_argument("--new-prompts", action="store_true",
                      help="give every request a message of its own, new to the gateway as a conversation's next "
                           "turn is, instead of repeating the overhead benchmark's 300")
    cost.add_argument("--instructions", action="store_true",
                      help="count instructions under valgrind's callgrind (one run per step, ~30x slower) "
                           "instead of timing")
    cost.add_argument("--one-step", choices=list(STEPS), help=argparse.SUPPRESS)  # a child of --instructions


def command_cost(args: argparse.Namespace) -> int:
    steps = tuple(step.strip() for step in args.steps.split(",") if step.strip())
    unknown = [step for step in steps if step not in STEPS]
    if unknown or not steps:
        print(f"python -m loadtest cost: unknown steps {', '.join(unknown) or '(none given)'}; known: "
              f"{', '.join(STEPS)}", file=sys.stderr)
        return 2
    config = CostConfig(requests=args.requests, rounds=args.rounds, policy=args.policy, steps=steps,
                        system_tokens=args.system_tokens, new_prompts=args.new_prompts)
    if args.one_step:
        measure_one_step(args.one_step, config)
        return 0
    if args.instructions:
        if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
            print("python -m loadtest cost --instructions needs valgrind (Debian: apt-get install valgrind)",
                  file=sys.stderr)
            return 2
        unit, costs = "instructions", run_instructions(config)
        print(f"cost: instructions per request counted by callgrind over {config.requests} requests per step, "
              f"{config.prompts()}")
    else:
        unit, costs = "CPU us", run_cpu(config)
        print(f"cost: CPU time per request, medians of {config.rounds} interleaved rounds of {config.requests} "
              f"requests per step, {config.prompts()}")
    print(markdown_table(cost_columns(unit), cost_rows(costs)))
    return 0


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    scenario = load_scenario(args.scenario)
    return with_overrides(
        scenario,
        workload={"num_prompts": args.num_prompts, "seed": args.seed, "scale": args.scale,
                  "random_range_ratio": args.random_range_ratio,
                  "session_keys": SessionKeys(args.session_keys) if args.session_keys else None},
        fleet={"replicas": args.replicas, "kv_capacity_tokens": args.kv_capacity_tokens,
               # one capacity given on the command line is every replica's
               "replica_kv_capacity_tokens": () if args.kv_capacity_tokens else None,
               "time_scale": args.time_scale, "max_running_requests": args.max_running_requests},
        slo={"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
    )


def traffic_from_args(args: argparse.Namespace, scenario: Scenario) -> Traffic:
    rate, concurrency = args.request_rate, args.max_concurrency
    if rate is None and args.load is None and concurrency is None:
        concurrency = scenario.load.max_concurrency  # a closed-loop preset
    if rate is None and (args.load is not None or concurrency is None):
        rate = scenario.load.rate(LoadLevel(args.load or LoadLevel.KNEE.value))
    return Traffic(request_rate=rate, max_concurrency=concurrency, stream=not args.no_stream)


def command_run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    scenario = scenario_from_args(args)
    traffic = traffic_from_args(args, scenario)
    if args.target:
        outcomes = [run_target(scenario, args.target, traffic, model=args.model,
                               oracle_capacity_tokens=args.oracle_capacity_tokens)]
    else:
        policies = [policy.strip() for policy in args.policies.split(",") if policy.strip()]
        outcomes = run_policies(scenario, policies, traffic, peers=args.peer, gateway_args=args.gateway_arg,
                                instances=Instances(args.instances, args.state))
    print(print_report(scenario, outcomes))
    if args.out is not None:
        command = "python -m loadtest " + shlex.join(argv)
        for path in write_outputs(args.out, scenario, outcomes, command, traffic):
            print(f"wrote {path}", file=sys.stderr)
    return 1 if any(o.summary.errors == o.summary.requests for o in outcomes) else 0


def command_list() -> int:
    rows = []
    for name in list_scenarios():
        scenario = load_scenario(name)
        w, f = scenario.workload, scenario.fleet
        requests = request_count(generate(w))
        rows.append([name, str(requests), str(working_set_tokens(w)),
                     f.describe_capacity(), str(f.time_scale), _arrivals(scenario),
                     scenario.description])
    header = ["scenario", "requests", "working set tok", "fleet KV tok", "time-scale",
              "rate light/knee/overload", "description"]
    print(text_table(header, rows))
    return 0


def _arrivals(scenario: Scenario) -> str:
    load = scenario.load
    rates = f"{load.light:g} / {load.knee:g} / {load.overload:g}"
    return f"closed loop {load.max_concurrency} (or {rates})" if load.max_concurrency else rates


def overhead_config(args: argparse.Namespace) -> OverheadConfig:
    """The config of `overhead`; a front that is not installed is left out with a message."""
    fronts = []
    for name in front_names(args.fronts, args.skip_peers):
        reason = missing(name)
        if reason is None:
            fronts.append(name)
        else:
            print(f"python -m loadtest overhead: {name} left out: {reason}", file=sys.stderr)
    if not fronts:
        raise ValueError("no front to measure")
    return OverheadConfig(rounds=args.rounds, duration_s=args.duration_secs, fronts=tuple(fronts),
                          stream_chunks=args.stream_chunks)


def command_overhead(args: argparse.Namespace, argv: Sequence[str]) -> int:
    tools = [name for name, installed in (("wrk", wrk_installed()), ("nginx", nginx_installed())) if not installed]
    if tools:
        print(f"python -m loadtest overhead needs {' and '.join(tools)} (Debian: apt-get install wrk nginx-light)",
              file=sys.stderr)
        return 2
    try:
        config = overhead_config(args)
    except ValueError as exc:
        print(f"python -m loadtest overhead: {exc}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    results = run_overhead(config)
    rows = overhead_rows(results, config.stream_chunks)
    print(f"overhead: wrk before nginx (non-streaming) and a paced SSE backend ({config.stream_chunks} chunks, "
          f"one per 2 ms); medians of {config.rounds} interleaved rounds of {config.duration_s} s; "
          "ratios against sglang-router")
    # Other programs' load lowers requests/s (CPU per request holds): say how busy the machine was.
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores")
    print(markdown_table(OVERHEAD_COLUMNS, rows))
    print("\n".join(target_lines(results, config.stream_chunks)))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "overhead.json").write_text(json.dumps(
            {"command": "python -m loadtest " + shlex.join(argv), "config": dataclasses.asdict(config),
             "fronts": [dataclasses.asdict(r) for r in results]}, indent=1) + "\n", encoding="utf-8")
        (args.out / "overhead.md").write_text(markdown_table(OVERHEAD_COLUMNS, rows) + "\n", encoding="utf-8")
    errors = sum(p.errors for r in results for p in r.points.values())
    return 1 if errors or any(not r.points for r in results) else 0


def exit_on_sigterm(signum: int, frame: object) -> None:
    # SIGTERM (a `timeout`, a CI job cancelled) would otherwise end the process without unwinding, leaving the
    # replicas and gateways it started running; SystemExit runs the fleet's cleanup.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "list":
        return command_list()
    if args.command == "overhead":
        return command_overhead(args, argv)
    if args.command == "cost":
        return command_cost(args)
    if args.command == "compare":
        try:
            print(compare(args.dirs))
        except (OSError, ValueError, KeyError) as exc:  # a directory without a (valid) results.json
            print(f"python -m loadtest compare: {exc}", file=sys.stderr)
            return 2
        return 0
    return command_run(args, argv)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    sys.exit(main())
