"""`python -m loadtest cost`: every step's pipeline relays the benchmark's requests through the gateway as it is
now (a change to app.py that breaks a cut shows here), and the table and callgrind's totals read right. The
instruction count itself needs valgrind and runs only when it is installed."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from loadtest import __main__ as loadtest_main
from loadtest.cost import STEPS, WARMUP_REQUESTS, CostConfig, callgrind_total, cost_rows, run_cpu, run_instructions


def test_every_step_relays_the_benchmark_requests() -> None:
    costs = run_cpu(CostConfig(requests=48, rounds=1, system_tokens=40))
    assert list(costs) == list(STEPS)
    assert all(cost > 0 for cost in costs.values())


def test_rows_show_what_each_step_adds_to_the_one_before() -> None:
    rows = cost_rows({"relay": 200.0, "parse": 230.4, "full": 350.0})
    assert [row[0] for row in rows] == ["relay", "parse", "full"]
    assert [row[2:] for row in rows] == [["200", ""], ["230", "+30"], ["350", "+120"]]


def test_the_instruction_total_is_read_from_the_end_of_the_profile() -> None:
    profile = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nfn=(1) main\n5 10\nsummary: 0\ntotals: 123456\n"
    assert callgrind_total(profile) == 123456
    with pytest.raises(ValueError):
        callgrind_total("events: Ir\n")


def test_unknown_steps_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert loadtest_main.main(["cost", "--steps", "relay,teleport"]) == 2
    assert "unknown steps teleport" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (apt-get install valgrind)")
def test_instructions_are_counted_for_the_measured_requests_only() -> None:
    counts = run_instructions(CostConfig(requests=16, steps=("relay",)))
    # A bare relay with its client and backend in one process: about a million instructions a request here,
    # far below what start-up and the warm-up would add if they were counted.
    assert 1e5 < counts["relay"] < 1e7


def test_new_prompts_give_every_request_a_message_the_gateway_has_not_seen() -> None:
    config = CostConfig(requests=32, new_prompts=True, system_tokens=40)
    bodies = config.bodies()
    assert len(set(bodies)) == len(bodies) > WARMUP_REQUESTS + 32  # none repeats in a run
    assert run_cpu(replace(config, rounds=1, steps=("relay", "full")))["full"] > 0
    assert config.child_arguments()[-1] == "--new-prompts"
    assert CostConfig(requests=32).bodies() == CostConfig(requests=8000).bodies()  # by default the 300 repeat
