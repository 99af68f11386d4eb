"""The type checker as a test: `python -m pytest` alone tells whether gateway/ and loadtest/ type-check."""

from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parent.parent


def test_gateway_and_loadtest_type_check() -> None:
    report, errors, status = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                      "--cache-dir", str(ROOT / ".mypy_cache"),
                                      str(ROOT / "gateway"), str(ROOT / "loadtest")])
    assert status == 0, report + errors
