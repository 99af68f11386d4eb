"""`prefix-gateway check-config FILE`: validates without starting; exit 0 with a summary, 2 naming the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main

REPO = Path(__file__).resolve().parent.parent


def test_shipped_config_is_valid_and_summarised_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(REPO / "config" / "gateway.toml")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "valid: policy prefix_aware, 3 backends" in out


def test_config_without_backends_is_valid_for_serve_with_backend_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('policy = "round_robin"\n')
    assert main(["check-config", str(path)]) == 0
    assert "no backends" in capsys.readouterr().out


@pytest.mark.parametrize("text, named", [
    ('cache_threshold = 1.5\n', "cache_threshold"),
    ('polcy = "prefix_aware"\n', "'polcy'"),
    ('[[backends]]\nurl = "http://127.0.0.1:1"\nweight = 2\n', "'backends[0].weight'"),
    ('[rewrite]\nenabled = "yes"\n', "rewrite.enabled"),
    ('port = \n', "not valid TOML"),
])
def test_bad_config_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           text: str, named: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert named in captured.err


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(tmp_path / "absent.toml")]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_run_time_backend_options_are_accepted_and_summarised(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('backend_dns = ["vllm-headless.llm.svc:8000"]\nbackend_dns_interval_secs = 2\n'
                    'backend_file = "/etc/prefix-gateway/backends.txt"\nadmin_port = 9100\nadmin_host = "0.0.0.0"\n'
                    'admin_api_key = ["admin-secret"]\n')
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "DNS vllm-headless.llm.svc:8000, file /etc/prefix-gateway/backends.txt" in out
    assert "admin API on 0.0.0.0:9100" in out


def test_an_admin_port_open_to_the_network_without_an_admin_key_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('admin_port = 9100\nadmin_host = "0.0.0.0"\n')
    assert main(["check-config", str(path)]) == 2
    assert "admin_api_key" in capsys.readouterr().err
