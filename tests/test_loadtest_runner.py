"""A small end-to-end run of the runner and the CLI: real replicas and gateways on loopback, seconds long.

No timing assertions: only that every request is answered, the accounting adds up and the files appear.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.__main__ import main
from loadtest.runner import Instances, Traffic, run_policies, sglang_router_installed
from loadtest.scenarios import FleetSpec, Kind, LoadRates, Scenario, SessionKeys, Slo, Workload
from simulator.fleet import redis_installed


def tiny_scenario(kind: Kind = Kind.SHARED_PREFIX) -> Scenario:
    workload = Workload(kind=kind, groups=4, prompts_per_group=4, clients=3, rounds=3, system_tokens=256,
                        question_tokens=16, output_tokens=4, seed=5)
    return Scenario("tiny", "tiny test scenario", "test", workload,
                    FleetSpec(replicas=2, kv_capacity_tokens=4096, time_scale=0.01), LoadRates(), Slo())


def test_two_policies_answer_every_request_and_report_hits() -> None:
    outcomes = run_policies(tiny_scenario(), ["round_robin", "prefix_aware"],
                            Traffic(request_rate=None, max_concurrency=4))
    assert [o.summary.label for o in outcomes] == ["round_robin", "prefix_aware"]
    for outcome in outcomes:
        summary = outcome.summary
        assert summary.requests == 16 and summary.errors == 0
        assert sum(summary.requests_per_replica.values()) == 16
        assert len(summary.requests_per_replica) <= 2
        assert all(r.output_tokens == 4 and r.prompt_tokens > 256 for r in outcome.drive.results)
        assert 0.0 < summary.hit_rate <= 1.0
        assert summary.oracle_hit_rate is not None and 0.0 < summary.oracle_hit_rate < 1.0
    assert outcomes[0].summary.oracle_hit_rate == outcomes[1].summary.oracle_hit_rate


@pytest.mark.skipif(not redis_installed(), reason="redis-server is not installed (apt-get install redis-server)")
def test_several_instances_sharing_state_answer_every_request_and_report_its_cost(
        capsys: pytest.CaptureFixture[str]) -> None:
    (outcome,) = run_policies(tiny_scenario(), ["prefix_aware"], Traffic(request_rate=None, max_concurrency=4),
                              instances=Instances(2, shared=True))
    assert outcome.summary.label == "prefix_aware x2 shared"
    assert outcome.summary.requests == 16 and outcome.summary.errors == 0
    assert "bytes published per routed request" in capsys.readouterr().err


def test_multiturn_rounds_carry_the_real_answers() -> None:
    (outcome,) = run_policies(tiny_scenario(Kind.MULTITURN), ["prefix_aware"],
                              Traffic(request_rate=None, max_concurrency=8))
    assert outcome.summary.requests == 9 and outcome.summary.errors == 0
    last_rounds = [s for s in outcome.drive.sent if len(s.messages) == 6]  # system + 2 x (user, answer) + user
    assert len(last_rounds) == 3
    assert all(s.messages[2]["role"] == "assistant" and s.messages[2]["content"] for s in last_rounds)
    later = [r for r in outcome.drive.results if r.turn > 0]
    assert all(r.cached_tokens > 0 for r in later)


def test_an_idle_session_sends_its_next_turn_only_after_its_pause() -> None:
    scenario = tiny_scenario(Kind.MULTITURN)
    workload = replace(scenario.workload, idle_share=1.0, idle_s=30.0, session_keys=SessionKeys.PROMPT_CACHE_KEY)
    (outcome,) = run_policies(replace(scenario, workload=workload), ["prefix_aware"],
                              Traffic(request_rate=None, max_concurrency=8))
    assert outcome.summary.requests == 9 and outcome.summary.errors == 0
    by_turn = {(r.conversation, r.turn): r for r in outcome.drive.results}
    for conversation in range(3):  # 30 simulated seconds at time-scale 0.01: 0.3 s of wall clock
        before, after = by_turn[conversation, 0], by_turn[conversation, 1]
        assert after.start_s - (before.start_s + before.e2e_s) >= 0.3


@pytest.mark.peer
@pytest.mark.skipif(not sglang_router_installed(), reason="sglang-router not installed")
def test_peer_runs_on_the_same_kind_of_fleet() -> None:
    scenario = tiny_scenario()
    scenario = replace(scenario, workload=replace(scenario.workload, num_prompts=8))
    outcomes = run_policies(scenario, [], Traffic(request_rate=None, max_concurrency=4), peers=["sglang-router"])
    assert [o.summary.label for o in outcomes] == ["sglang-router"]
    assert outcomes[0].summary.errors == 0 and sum(outcomes[0].summary.requests_per_replica.values()) == 8


def test_cli_run_writes_results_report_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "shared-prefix", "--policies", "round_robin", "--replicas", "2", "--num-prompts", "12",
                 "--scale", "0.05", "--time-scale", "0.01", "--request-rate", "200", "--out", str(tmp_path)])
    assert code == 0
    assert "round_robin" in capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["runs"]) == 1 and len(results["runs"][0]["requests"]) == 12
    assert "| round_robin |" in (tmp_path / "report.md").read_text()
    for plot in ("ttft_cdf.png", "hit_rate.png", "requests_per_replica.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_target_mode_drives_a_running_endpoint_and_reads_its_cached_tokens() -> None:
    from loadtest.runner import run_target
    from simulator.fleet import running_fleet

    with running_fleet() as fleet:
        replica = fleet.start_replica(args=["--model", "served-model", "--time-scale", "0"])
        outcome = run_target(tiny_scenario(), replica.url, Traffic(request_rate=None, max_concurrency=2),
                             oracle_capacity_tokens=100_000)
    assert outcome.summary.requests == 16 and outcome.summary.errors == 0
    assert outcome.summary.hit_rate > 0.5 and outcome.summary.oracle_hit_rate is not None


def test_mixed_models_route_embeddings_to_the_embedding_pool() -> None:
    scenario = tiny_scenario(Kind.MIXED_MODELS)
    scenario = replace(scenario, workload=replace(scenario.workload, embedding_share=0.25, embedding_tokens=16),
                       fleet=replace(scenario.fleet, embedding_replicas=1))
    (outcome,) = run_policies(scenario, ["prefix_aware"], Traffic(request_rate=None, max_concurrency=4))
    assert outcome.summary.errors == 0
    embeddings = [r for r in outcome.drive.results if r.kind.value == "embedding"]
    assert len(embeddings) == 4 and all(r.prompt_tokens > 0 for r in embeddings)
    assert len({r.replica for r in embeddings}) == 1
    assert not {r.replica for r in embeddings} & set(outcome.summary.requests_per_replica)


def test_a_clean_run_removes_its_logs_and_a_failed_one_keeps_them() -> None:
    from simulator.fleet import running_fleet

    with running_fleet() as fleet:
        clean = Path(fleet.start_replica(args=["--time-scale", "0"]).log_path)
        assert clean.exists()
    assert not clean.exists()

    with pytest.raises(RuntimeError), running_fleet() as fleet:
        failed = Path(fleet.start_replica(args=["--time-scale", "0"]).log_path)
        raise RuntimeError("the run failed")
    assert failed.exists()
    failed.unlink()


def _children(pid: int) -> set[int]:
    """Processes whose parent is `pid`, from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_sigterm_stops_the_fleet_a_run_started() -> None:
    argv = [sys.executable, "-m", "loadtest", "run", "unique", "--num-prompts", "2000", "--policies", "round_robin",
            "--time-scale", "1", "--request-rate", "2"]
    runner = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(_children(runner.pid)) < 2 and time.monotonic() < deadline:  # replicas and gateway up
            time.sleep(0.2)
        children = _children(runner.pid)
        assert len(children) >= 2
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=30) == 128 + signal.SIGTERM
        assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]  # stopped and reaped
    finally:
        runner.kill()
        runner.wait()
