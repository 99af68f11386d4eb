"""The type checker and the linter as tests: `python -m pytest` alone tells whether the code type-checks and
passes `ruff check` (rules in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parent.parent


def test_gateway_and_loadtest_type_check() -> None:
    report, errors, status = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                      "--cache-dir", str(ROOT / ".mypy_cache"),
                                      str(ROOT / "gateway"), str(ROOT / "simulator"), str(ROOT / "loadtest")])
    assert status == 0, report + errors


def test_gateway_loadtest_and_tests_pass_the_linter() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "gateway", "simulator", "loadtest",
                             "tests"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
