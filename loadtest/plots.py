"""PNG plots of a run with matplotlib's Agg backend (files only, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot is imported)

from loadtest.runner import RunOutcome  # noqa: E402


def write_plots(out_dir: Path, name: str, outcomes: Sequence[RunOutcome], time_scale: float) -> list[Path]:
    return [ttft_cdf(out_dir / "ttft_cdf.png", name, outcomes, time_scale),
            hit_rates(out_dir / "hit_rate.png", name, outcomes),
            requests_per_replica(out_dir / "requests_per_replica.png", name, outcomes)]


def ttft_cdf(path: Path, name: str, outcomes: Sequence[RunOutcome], time_scale: float) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for outcome in outcomes:
        values = sorted(r.ttft_s / time_scale for r in outcome.drive.results if r.ttft_s is not None)
        if values:
            axes.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=outcome.summary.label)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (simulated s, log scale)")
    axes.set_ylabel("share of requests")
    axes.set_title(f"{name}: TTFT CDF")
    axes.grid(True, alpha=0.3)
    axes.legend()
    return _save(figure, path)


def hit_rates(path: Path, name: str, outcomes: Sequence[RunOutcome]) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    labels = [o.summary.label for o in outcomes]
    axes.bar(labels, [100 * o.summary.hit_rate for o in outcomes], color="tab:blue", label="fleet hit rate")
    oracle = next((o.summary.oracle_hit_rate for o in outcomes if o.summary.oracle_hit_rate is not None), None)
    if oracle is not None:
        axes.axhline(100 * oracle, color="tab:red", linestyle="--", label=f"oracle {100 * oracle:.1f}%")
    axes.set_ylabel("cached / prompt tokens (%)")
    axes.set_ylim(0, 100)
    axes.set_title(f"{name}: cache hit rate vs oracle")
    axes.legend()
    return _save(figure, path)


def requests_per_replica(path: Path, name: str, outcomes: Sequence[RunOutcome]) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, len(outcomes))
    replicas = max((len(o.summary.requests_per_replica) for o in outcomes), default=0)
    for index, outcome in enumerate(outcomes):
        counts = list(outcome.summary.requests_per_replica.values())
        positions = [replica - 0.4 + (index + 0.5) * width for replica in range(len(counts))]
        axes.bar(positions, counts, width=width, label=outcome.summary.label)
    # Replica ids differ between runs (fresh ports), so replicas are numbered by their sorted id.
    axes.set_xticks(range(replicas), [f"replica {i}" for i in range(replicas)])
    axes.set_xlabel("replica (numbered by sorted id within each run)")
    axes.set_ylabel("requests served")
    axes.set_title(f"{name}: requests per replica")
    axes.legend(loc="lower right")
    return _save(figure, path)


def _save(figure: plt.Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
