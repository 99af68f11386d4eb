"""`loadtest compare`: the cross-run table and its same-run ratios, from hand-written results.json files."""

import json
from pathlib import Path

from loadtest.__main__ import main
from loadtest.compare import compare


def summary(label: str, p99: float, goodput: float, hit_rate: float, oracle: float | None) -> dict:
    return {"label": label, "goodput_per_s": goodput, "slo_attainment": 1.0,
            "ttft_s": {"p50": 0.01, "p90": 0.02, "p99": p99, "mean": 0.01}, "hit_rate": hit_rate,
            "oracle_hit_rate": oracle, "replica_max_over_mean": 1.0}


def write_run(directory: Path, scenario: str, rate: float, summaries: list[dict]) -> Path:
    directory.mkdir()
    results = {"scenario": {"name": scenario}, "traffic": {"request_rate": rate},
               "runs": [{"summary": s, "requests": []} for s in summaries]}
    (directory / "results.json").write_text(json.dumps(results), encoding="utf-8")
    return directory


def test_prefix_aware_ratios_are_taken_against_baselines_of_the_same_run(tmp_path: Path) -> None:
    run = write_run(tmp_path / "multiturn", "multiturn", 120.0, [
        summary("round_robin", 0.8, 90.0, 0.3, 0.8),
        summary("cache_aware", 1.0, 100.0, 0.7, 0.8),
        summary("prefix_aware", 0.4, 110.0, 0.76, 0.8),
    ])
    table = compare([run])
    subject = next(line for line in table.splitlines() if "| prefix_aware |" in line)
    assert "| 95% |" in subject  # 76% of the oracle's 80%
    assert "0.40× / 0.50×" in subject and "1.10× / 1.22×" in subject
    assert table.splitlines()[2].startswith("| multiturn | 120 | round_robin |")


def test_missing_baseline_or_oracle_shows_a_dash(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "unique", "unique", 80.0, [summary("prefix_aware", 0.4, 110.0, 0.0, None)])
    assert main(["compare", str(run)]) == 0
    subject = capsys.readouterr().out.splitlines()[-1]
    assert subject.count("- / -") == 2 and "| - |" in subject


def test_a_directory_without_results_is_an_error_not_a_traceback(tmp_path: Path, capsys) -> None:
    assert main(["compare", str(tmp_path / "missing")]) == 2
    assert "results.json" in capsys.readouterr().err
