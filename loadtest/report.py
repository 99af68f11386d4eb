"""What a run leaves behind: the table on stdout, and with `--out DIR` results.json, report.md and plots.

Latencies in the tables are simulated seconds (TTFT, E2E) and milliseconds (TPOT, ITL); see `stats.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.runner import RunOutcome
from loadtest.scenarios import Kind, Popularity, Scenario, Workload
from loadtest.workload import group_count, prompt_count

COLUMNS = ("policy", "req/s", "out tok/s", "goodput/s", "TTFT p50/p90/p99 s", "TPOT p50/p99 ms",
           "ITL p50/p99 ms", "E2E p50/p99 s", "hit rate", "oracle", "max/mean", "errors")


def _num(value: float, digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.1f}%"


def table_rows(outcomes: Sequence[RunOutcome]) -> list[list[str]]:
    rows = []
    for outcome in outcomes:
        s = outcome.summary
        rows.append([
            s.label, _num(s.requests_per_s), _num(s.output_tokens_per_s, 0), _num(s.goodput_per_s),
            f"{_num(s.ttft_s.p50)} / {_num(s.ttft_s.p90)} / {_num(s.ttft_s.p99)}",
            f"{_num(1000 * s.tpot_s.p50, 1)} / {_num(1000 * s.tpot_s.p99, 1)}",
            f"{_num(1000 * s.itl_s.p50, 1)} / {_num(1000 * s.itl_s.p99, 1)}",
            f"{_num(s.e2e_s.p50)} / {_num(s.e2e_s.p99)}",
            _pct(s.hit_rate), _pct(s.oracle_hit_rate), _num(s.replica_max_over_mean), str(s.errors),
        ])
    return rows


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()
    return "\n".join([line(header), line(["-" * width for width in widths]), *map(line, rows)])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def scenario_line(scenario: Scenario) -> str:
    w, f = scenario.workload, scenario.fleet
    return (f"{scenario.name}: {scenario.description}{_resized(w)} | scale {w.scale}, seed {w.seed}, "
            f"replicas of {f.describe_capacity()} KV tokens, time-scale {f.time_scale} | "
            f"SLO TTFT <= {scenario.slo.ttft_s} s, TPOT <= {1000 * scenario.slo.tpot_s:.0f} ms")


def _resized(w: Workload) -> str:
    """What --num-prompts made of a shared-prefix workload: its groups shrink with it (`group_count`)."""
    if w.num_prompts is None or w.kind is Kind.MULTITURN or w.popularity is Popularity.UNIQUE:
        return ""
    count = prompt_count(w)
    return f" (--num-prompts {count}: {group_count(w, count)} of {w.groups} groups)"


def print_report(scenario: Scenario, outcomes: Sequence[RunOutcome]) -> str:
    return scenario_line(scenario) + "\n" + text_table(COLUMNS, table_rows(outcomes))


def results_json(scenario: Scenario, outcomes: Sequence[RunOutcome], command: str, traffic: Any) -> dict[str, Any]:
    return {
        "command": command,
        "scenario": dataclasses.asdict(scenario),
        "traffic": dataclasses.asdict(traffic),
        "units": "seconds are simulated seconds (wall-clock / time_scale); rates per simulated second",
        "runs": [{"summary": dataclasses.asdict(o.summary),
                  "requests": [dataclasses.asdict(r) for r in o.drive.results]} for o in outcomes],
    }


def write_outputs(out_dir: Path, scenario: Scenario, outcomes: Sequence[RunOutcome], command: str,
                  traffic: Any) -> list[Path]:
    from loadtest.plots import write_plots  # matplotlib only when files are asked for

    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.json"
    results.write_text(json.dumps(results_json(scenario, outcomes, command, traffic), indent=1, default=str,
                                  allow_nan=True) + "\n", encoding="utf-8")
    plots = write_plots(out_dir, scenario.name, outcomes, scenario.fleet.time_scale)
    report = out_dir / "report.md"
    report.write_text(report_markdown(scenario, outcomes, command, plots), encoding="utf-8")
    return [results, report, *plots]


def report_markdown(scenario: Scenario, outcomes: Sequence[RunOutcome], command: str, plots: Sequence[Path]) -> str:
    w = scenario.workload
    parts = [
        f"# Load test: {scenario.name}", "", scenario.description, "", f"Source: {scenario.source}", "",
        f"Command: `{command}`", "", scenario_line(scenario), "",
        markdown_table(COLUMNS, table_rows(outcomes)), "",
        "Times are simulated seconds (wall-clock divided by the replicas' time-scale). Goodput counts requests "
        "meeting both SLOs. Hit rate = cached / prompt tokens as the replicas reported them; oracle = the same "
        "requests, as the client sent them (before any gateway rewrite, so a gateway that moves IDs off the "
        "prefix can beat it), through one cache of the fleet's total capacity; max/mean = requests on the "
        "busiest replica over the mean.", "",
        f"Workload: `{json.dumps(dataclasses.asdict(w), default=str)}`", "",
    ]
    parts += [f"![{plot.stem}]({plot.name})" for plot in plots]
    return "\n".join(parts) + "\n"
