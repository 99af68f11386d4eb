"""`python -m loadtest compare DIR...`: one table over many runs, with prefix_aware's ratios to the baselines.

Each DIR is the `--out` of one `loadtest run` (its `results.json`). For every run the table shows each policy's
goodput (requests/s meeting both SLOs, and their share: at a fixed arrival rate the share is the robust
comparison, since the rate also moves with when the last request ends), TTFT, hit rate (also as a share of the
oracle's) and balance. The `vs cache_aware / round_robin` columns put prefix_aware's p99 TTFT and goodput over
the baselines' from the *same* run: the machines are noisy, and only side-by-side numbers compare.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.report import markdown_table

SUBJECT = "prefix_aware"
BASELINES = ("cache_aware", "round_robin")
COLUMNS = ("scenario", "load (req/s)", "policy", "goodput/s", "SLO met", "TTFT p50 / p99 s", "hit rate", "of oracle",
           "max/mean", "p99 TTFT vs cache_aware / round_robin", "goodput vs cache_aware / round_robin")


@dataclass(frozen=True)
class Run:
    scenario: str
    rate: float | None
    summaries: dict[str, dict[str, Any]]  # by policy label, in run order


def load_run(directory: Path) -> Run:
    data = json.loads((directory / "results.json").read_text(encoding="utf-8"))
    summaries = {run["summary"]["label"]: run["summary"] for run in data["runs"]}
    return Run(data["scenario"]["name"], data["traffic"]["request_rate"], summaries)


def _ratio(value: float, baseline: float | None) -> str:
    if baseline is None or not baseline or math.isnan(baseline) or math.isnan(value):
        return "-"
    return f"{value / baseline:.2f}×"


def _ratios(run: Run, field: str, quantile: str | None) -> str:
    def value(label: str) -> float | None:
        summary = run.summaries.get(label)
        if summary is None:
            return None
        return summary[field][quantile] if quantile else summary[field]
    subject = value(SUBJECT)
    if subject is None:
        return "-"
    return " / ".join(_ratio(subject, value(label)) for label in BASELINES)


def rows(runs: Sequence[Run]) -> list[list[str]]:
    table = []
    for run in runs:
        for position, (label, s) in enumerate(run.summaries.items()):
            oracle = s["oracle_hit_rate"]
            first = position == 0
            table.append([
                run.scenario if first else "", f"{run.rate:g}" if first and run.rate else "",
                label, f"{s['goodput_per_s']:.1f}", f"{100 * s['slo_attainment']:.1f}%",
                f"{s['ttft_s']['p50']:.3f} / {s['ttft_s']['p99']:.3f}",
                f"{100 * s['hit_rate']:.1f}%", f"{100 * s['hit_rate'] / oracle:.0f}%" if oracle else "-",
                f"{s['replica_max_over_mean']:.2f}",
                _ratios(run, "ttft_s", "p99") if label == SUBJECT else "",
                _ratios(run, "goodput_per_s", None) if label == SUBJECT else "",
            ])
    return table


def compare(directories: Sequence[Path]) -> str:
    return markdown_table(COLUMNS, rows([load_run(directory) for directory in directories]))
