"""The shipped Grafana dashboard and Prometheus rules use only metrics the gateway exports, in valid PromQL."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.backends import BackendSpec
from gateway.fleet.pool import Pool
from gateway.observe.metrics import GatewayMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "prefix-gateway.json"
RULES = DEPLOY / "prometheus" / "rules.yaml"
# A metric or recording-rule name that belongs to the gateway; quoted label values are removed before matching.
NAME = re.compile(r"(?<![\w:$])(gateway[a-zA-Z0-9_:]*)")


def exported_names() -> set[str]:
    """Every sample name in the exposition of a real registry after one request of each kind was recorded."""
    pool = Pool([BackendSpec("http://127.0.0.1:30001", "m")], 1000, retry_after_s=1)
    metrics = GatewayMetrics(pool)
    backend = "http://127.0.0.1:30001"
    metrics.requests.labels("chat", "m", backend, "prefix", "200").inc()
    metrics.upstream_latency.labels("chat", backend).observe(0.2)
    metrics.upstream_ttfb.labels("chat", backend).observe(0.1)
    metrics.prefix_match.labels("m", "prefix").observe(0.5)
    for counter in (metrics.prompt_tokens, metrics.cached_tokens, metrics.predicted_cached_tokens):
        counter.labels("m", backend).inc(10)
    metrics.index_corrections.labels(backend).inc()
    metrics.prefix_turn("m", backend, found=True)
    metrics.upstream_errors.labels(backend, "timeout").inc()
    metrics.rewritten_spans.labels("uuid", "move").inc()
    families = text_string_to_metric_families(metrics.render().decode())
    return {sample.name for family in families for sample in family.samples}


def names_in(expr: str) -> set[str]:
    return set(NAME.findall(re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)))


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def panel_queries() -> Iterator[str]:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]


def dashboard_queries() -> Iterator[str]:
    """The panels' PromQL and the template variables' Grafana queries (`label_values(...)`)."""
    yield from panel_queries()
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["definition"]


def test_rules_use_only_exported_metrics() -> None:
    exported = exported_names()
    for rule in rules():
        assert names_in(rule["expr"]) <= exported, rule["record"]


def test_dashboard_uses_only_exported_metrics_or_recorded_rules() -> None:
    known = exported_names() | {rule["record"] for rule in rules()}
    queries = list(dashboard_queries())
    assert len(queries) > 20
    for query in queries:
        assert names_in(query), query
        assert names_in(query) <= known, query


def test_dashboard_shows_what_operators_ask_for() -> None:
    used = set().union(*(names_in(query) for query in dashboard_queries()))
    assert {"gateway_requests_total", "gateway_upstream_ttfb_seconds_bucket", "gateway_cached_tokens_total",
            "gateway_predicted_cached_tokens_total", "gateway_backend_in_flight_requests",
            "gateway_backend_pending_prefill_tokens", "gateway_upstream_errors_total",
            "gateway_rewrite_spans_total"} <= used


def test_dashboard_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        grid = panel["gridPos"]
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & taken, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        taken |= cells


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian package prometheus)")
def test_rules_and_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    checked = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # promtool checks expressions only inside rules, so the dashboard's become rules of a scratch file.
    as_rules = [{"record": f"dashboard:query_{i}", "expr": query.replace("$job", ".*")}
                for i, query in enumerate(panel_queries())]
    scratch = tmp_path / "dashboard-rules.yaml"
    scratch.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": as_rules}]}))
    checked = subprocess.run(["promtool", "check", "rules", str(scratch)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
