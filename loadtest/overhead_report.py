"""The table of `python -m loadtest overhead`: one row per front, ratios against sglang-router, and the
issue #24 targets checked for each gateway front."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loadtest.fronts import DIRECT, GATEWAY_ARGS, SGLANG_ROUTER
from loadtest.overhead import C1, C16, C64, STREAM, FrontResult, Point

COLUMNS = ("front", "req/s c16", "req/s c64", "c1 p50 / p99 ms", "added p50 ms", "CPU us/req c16 / c64",
           "RSS MB start → end", "KiB per idle conn", "stream chunks/s", "stream p50 ms", "CPU us/chunk",
           "reads/events (most per read)", "other cores", "errors")


@dataclass(frozen=True)
class Targets:
    """Issue #24's targets, relative to sglang-router."""

    requests_ratio: float = 0.4        # req/s at c16 and at c64
    added_p50_ms: float = 0.3          # added p50 at c1, at most this much above sglang-router's
    stream_ratio: float = 0.5          # chunks/s at 64 streams


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return value / reference


def _rate(value: float | None, reference: float | None) -> str:
    if value is None:
        return "-"
    ratio = _ratio(value, reference)
    return f"{value:,.0f}" + ("" if ratio is None else f" ({ratio:.2f}×)")


def _cpu(point: Point | None) -> str:
    return "-" if point is None or point.cpu_us_per_request is None else f"{point.cpu_us_per_request:,.0f}"


def _other_cores(points: Iterable[Point]) -> str:
    """The median CPU other programs took during the front's points: a high value flags a disturbed row."""
    values = [p.other_cores for p in points if p.other_cores is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def added_p50_ms(result: FrontResult, direct: FrontResult | None) -> float | None:
    if direct is None or C1 not in result.points or C1 not in direct.points:
        return None
    return result.points[C1].p50_ms - direct.points[C1].p50_ms


def chunks_per_s(result: FrontResult, chunks: int) -> float | None:
    point = result.points.get(STREAM)
    return None if point is None else point.ok_per_s * chunks


def _find(results: Sequence[FrontResult], name: str) -> FrontResult | None:
    return next((r for r in results if r.name == name and r.points), None)


def _added(result: FrontResult, direct: FrontResult | None, peer: FrontResult | None) -> str:
    added = added_p50_ms(result, direct)
    if added is None or result.name == DIRECT:
        return "-"
    peer_added = None if peer is None or peer is result else added_p50_ms(peer, direct)
    return f"{added:+.2f}" + ("" if peer_added is None else f" ({added - peer_added:+.2f} vs sglr)")


def _row(result: FrontResult, direct: FrontResult | None, peer: FrontResult | None, chunks: int) -> list[str]:
    points, ref = result.points, (peer.points if peer is not None and peer is not result else {})
    c1, stream = points.get(C1), points.get(STREAM)
    rss = "-" if result.rss_start_mb is None or result.rss_end_mb is None else \
        f"{result.rss_start_mb:.0f} → {result.rss_end_mb:.0f}"
    cpu_chunk = "-" if stream is None or stream.cpu_us_per_request is None else \
        f"{stream.cpu_us_per_request / chunks:,.1f}"
    reads = "-" if result.stream_reads is None else \
        f"{result.stream_reads.reads}/{result.stream_reads.events} (≤{result.stream_reads.max_events_per_read})"
    peer_chunks = None if peer is None or peer is result else chunks_per_s(peer, chunks)
    return [
        result.name,
        *(_rate(points[c].ok_per_s if c in points else None, ref[c].ok_per_s if c in ref else None)
          for c in (C16, C64)),
        "-" if c1 is None else f"{c1.p50_ms:.2f} / {c1.p99_ms:.2f}",
        _added(result, direct, peer),
        f"{_cpu(points.get(C16))} / {_cpu(points.get(C64))}",
        rss,
        "-" if result.kib_per_connection is None else f"{result.kib_per_connection:.1f}",
        _rate(chunks_per_s(result, chunks), peer_chunks),
        "-" if stream is None else f"{stream.p50_ms:.1f}",
        cpu_chunk,
        reads,
        _other_cores(points.values()),
        str(sum(p.errors for p in points.values())),
    ]


def overhead_rows(results: Sequence[FrontResult], chunks: int) -> list[list[str]]:
    direct, peer = _find(results, DIRECT), _find(results, SGLANG_ROUTER)
    return [_row(result, direct, peer, chunks) for result in results]


def target_lines(results: Sequence[FrontResult], chunks: int, targets: Targets = Targets()) -> list[str]:
    """One line per gateway front: each issue #24 target with the measured value and whether it holds."""
    direct, peer = _find(results, DIRECT), _find(results, SGLANG_ROUTER)
    if peer is None:
        return ["targets (issue #24): not checked, sglang-router was not measured"]
    lines = []
    for result in results:
        if result.name not in GATEWAY_ARGS or not result.points:
            continue
        checks = []
        for c in (C16, C64):
            ratio = _ratio(result.points[c].ok_per_s, peer.points[c].ok_per_s)
            checks.append(_check(f"req/s {c}", ratio, targets.requests_ratio, "×", at_least=True))
        added, peer_added = added_p50_ms(result, direct), added_p50_ms(peer, direct)
        more = None if added is None or peer_added is None else added - peer_added
        checks.append(_check("added p50 over sglr's", more, targets.added_p50_ms, " ms", at_least=False))
        ratio = _ratio(chunks_per_s(result, chunks), chunks_per_s(peer, chunks))
        checks.append(_check("chunks/s", ratio, targets.stream_ratio, "×", at_least=True))
        lines.append(f"{result.name}: " + "; ".join(checks))
    return lines


def _check(name: str, value: float | None, target: float, unit: str, *, at_least: bool) -> str:
    if value is None:
        return f"{name} -"
    held = value >= target if at_least else value <= target
    bound = f"{'≥' if at_least else '≤'} {target:g}{unit}"
    return f"{name} {value:.2f}{unit} ({bound}: {'met' if held else 'MISSED'})"
