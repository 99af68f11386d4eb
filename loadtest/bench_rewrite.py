"""Per-request cost of the prompt rewriter on a 32k-character chat prompt (a benchmark, not a test).

    python -m loadtest.bench_rewrite [--runs 2000] [--chars 32768]

Three cases: a prompt whose system message starts with an ID line and a billing header (rewritten), the
same prompt already rewritten (the common steady state: scanned, nothing to do), and a prompt with no IDs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from gateway.api.prompts import Endpoint
from gateway.rewrite import RewriteConfig, Rewriter

_PARAGRAPH = ("You are a careful assistant for the ACME support team. Answer in the customer's language, cite "
              "the knowledge-base article (e.g. KB-2291, v3.11.7) and never promise refunds above $500.00. ")


def _chat(chars: int, with_ids: bool) -> dict[str, Any]:
    head = ("x-anthropic-billing-header: cc_version=1.0.83.abc; cc_entrypoint=cli; cch=7f3a9c1e5b2d4f60;\n"
            "Request ID: 8f1c2d3e-4b5a-4c6d-9e8f-0a1b2c3d4e5f\nTimestamp: 2024-05-01T10:00:00.123Z\n"
            if with_ids else "")
    system = head + (_PARAGRAPH * (chars // len(_PARAGRAPH) + 1))[:chars - len(head)]
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": "Where is my order 4411?"}]}


def _measure(rewriter: Rewriter, body: dict[str, Any], runs: int) -> tuple[float, float, float, float]:
    """Mean and p99 in microseconds, wall clock and this thread's CPU time (steadier on a busy machine)."""
    wall, cpu = [], []
    for _ in range(runs):
        wall_start, cpu_start = time.perf_counter_ns(), time.thread_time_ns()
        rewriter.rewrite(Endpoint.CHAT, body, "m")
        cpu.append((time.thread_time_ns() - cpu_start) / 1000)
        wall.append((time.perf_counter_ns() - wall_start) / 1000)
    wall.sort()
    cpu.sort()
    p99 = int(0.99 * (runs - 1))
    return statistics.fmean(wall), wall[p99], statistics.fmean(cpu), cpu[p99]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--chars", type=int, default=32768)
    args = parser.parse_args()
    rewriter = Rewriter(RewriteConfig())
    with_ids = _chat(args.chars, with_ids=True)
    rewritten = rewriter.rewrite(Endpoint.CHAT, with_ids, "m").body
    assert rewritten is not None
    cases = {"ids at start (3 spans moved)": with_ids, "already rewritten": rewritten,
             "no ids": _chat(args.chars, with_ids=False)}
    print(f"prompt ~{args.chars} chars, window {RewriteConfig().window_chars}, {args.runs} runs")
    for name, body in cases.items():
        _measure(rewriter, body, min(200, args.runs))  # warm-up
        wall_mean, wall_p99, cpu_mean, cpu_p99 = _measure(rewriter, body, args.runs)
        print(f"  {name:30s} wall mean {wall_mean:7.1f} us  p99 {wall_p99:7.1f} us | "
              f"cpu mean {cpu_mean:7.1f} us  p99 {cpu_p99:7.1f} us")


if __name__ == "__main__":
    main()
