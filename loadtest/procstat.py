"""CPU time and resident memory of a process and its descendants, read from /proc (Linux).

CPU time per request is the overhead figure that survives a shared, noisy machine: requests/s falls when other
programs take the cores, but the CPU seconds a front spends on each request barely move.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessStat:
    """The fields of /proc/PID/stat that we use; times in clock ticks, RSS in pages."""

    pid: int
    ppid: int
    cpu_ticks: int   # utime + stime, plus cutime + cstime: children it has reaped count as its own
    rss_pages: int


def parse_stat(text: str) -> ProcessStat:
    """One /proc/PID/stat line. The command name (field 2) is in parentheses and may itself hold spaces or
    parentheses, so the fields are counted from the last ')'."""
    pid = int(text[:text.index(" ")])
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): field n of proc(5) is fields[n - 3].
    utime, stime, cutime, cstime = (int(fields[n - 3]) for n in (14, 15, 16, 17))
    return ProcessStat(pid=pid, ppid=int(fields[4 - 3]), cpu_ticks=utime + stime + cutime + cstime,
                       rss_pages=int(fields[24 - 3]))


def read_all(proc: Path = PROC) -> dict[int, ProcessStat]:
    """Every process's stat; those that exit while we read are left out."""
    stats: dict[int, ProcessStat] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stats[int(entry.name)] = parse_stat((entry / "stat").read_text(encoding="utf-8", errors="replace"))
        except (OSError, ValueError, IndexError):
            continue
    return stats


def tree(root: int, stats: Mapping[int, ProcessStat]) -> list[ProcessStat]:
    """`root` and all its descendants (a gateway's worker processes, a router's helper processes)."""
    children: dict[int, list[int]] = {}
    for stat in stats.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        if pid in stats:
            found.append(stats[pid])
            pending.extend(children.get(pid, ()))
    return found


@dataclass(frozen=True)
class Usage:
    """A process tree's CPU seconds so far and its resident memory now."""

    cpu_s: float
    rss_bytes: int


def usage(root: int, proc: Path = PROC) -> Usage:
    return summed(tree(root, read_all(proc)))


def summed(stats: Iterable[ProcessStat]) -> Usage:
    stats = list(stats)
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    page_bytes = os.sysconf("SC_PAGE_SIZE")
    return Usage(cpu_s=sum(s.cpu_ticks for s in stats) / ticks_per_s,
                 rss_bytes=sum(s.rss_pages for s in stats) * page_bytes)


def parse_machine_busy_ticks(text: str) -> int:
    """Busy clock ticks of all CPUs from /proc/stat's first line: user, nice, system, irq, softirq and steal
    (idle and iowait left out; guest time is already inside user)."""
    fields = text.splitlines()[0].split()
    assert fields[0] == "cpu", fields[0]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in (fields[1:9] + ["0"] * 8)[:8])
    return user + nice + system + irq + softirq + steal


def machine_busy_s(proc: Path = PROC) -> float:
    """CPU seconds the whole machine has spent busy so far, over all cores."""
    return parse_machine_busy_ticks((proc / "stat").read_text(encoding="utf-8")) / os.sysconf("SC_CLK_TCK")
