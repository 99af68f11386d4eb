"""How many CPUs this process may use: the number of processes `--workers auto` starts.

`os.cpu_count()` is the host's count. A container sees every CPU of its host, while its CPU limit (a cgroup quota:
what Kubernetes sets from `resources.limits.cpu`, `docker run --cpus`) gives it only a few CPUs' worth of time. One
worker per host CPU there would be dozens of processes sharing two CPUs' worth, each with its own prefix index and
store connection. So the count is the process's affinity set (taskset, cpusets), capped by the quota of its cgroup
and of every cgroup above it, rounded up.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path


def usable_cpus() -> int:
    """The CPUs this process may run on, capped by its CPU quota (rounded up); at least 1."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux: neither affinity nor cgroups
        return os.cpu_count() or 1
    cpus = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit(_read(Path("/proc/self/mountinfo")), _read(Path("/proc/self/cgroup")))
    return max(1, cpus if limit is None else min(cpus, math.ceil(limit)))


def cgroup_cpu_limit(mountinfo: str, cgroups: str) -> float | None:
    """CPUs' worth of time the process's cgroups allow per period, the lowest quota from its own cgroup up to the
    root of the mount; None without a quota. cgroup v2: `cpu.max` ("200000 100000" is 2 CPUs, "max 100000" no
    limit); v1: `cpu.cfs_quota_us` over `cpu.cfs_period_us` (a quota of -1 is none)."""
    limits = [limit for directory, v2 in _cpu_cgroup_dirs(mountinfo, cgroups)
              if (limit := _v2_limit(directory) if v2 else _v1_limit(directory)) is not None]
    return min(limits, default=None)


def _cpu_cgroup_dirs(mountinfo: str, cgroups: str) -> Iterator[tuple[Path, bool]]:
    """The directories of the process's CPU cgroup and of its ancestors up to the mount, each with whether it is
    cgroup v2."""
    paths = _cgroup_paths(cgroups)
    for line in mountinfo.splitlines():
        fields, _, super_fields = line.partition(" - ")
        parts, super_parts = fields.split(), super_fields.split()
        if len(parts) < 5 or len(super_parts) < 3:
            continue
        root, mount_point, fs_type, options = parts[3], Path(parts[4]), super_parts[0], super_parts[2].split(",")
        v2 = fs_type == "cgroup2"
        if not (v2 or (fs_type == "cgroup" and "cpu" in options)) or v2 not in paths:
            continue
        directory = mount_point / _below(paths[v2], root)
        while True:
            yield directory, v2
            if directory == mount_point or mount_point not in directory.parents:
                break
            directory = directory.parent


def _cgroup_paths(cgroups: str) -> dict[bool, str]:
    """The process's cgroup path in the v2 hierarchy (key True) and in the v1 one with the cpu controller (False),
    from /proc/self/cgroup's `hierarchy:controllers:path` lines."""
    paths = {}
    for line in cgroups.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            paths[True] = path
        elif "cpu" in controllers.split(","):
            paths[False] = path
    return paths


def _below(path: str, root: str) -> str:
    """`path` relative to the mount's `root`. A container's cgroup namespace mounts its own cgroup as the root; a
    path outside that root (seen from another namespace) is taken as the root itself."""
    if root == "/":
        return path.lstrip("/")
    if path == root or path.startswith(root + "/"):
        return path[len(root):].lstrip("/")
    return ""


def _v2_limit(directory: Path) -> float | None:
    fields = _read(directory / "cpu.max").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _v1_limit(directory: Path) -> float | None:
    return _ratio(_read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us"))


def _ratio(quota: str, period: str) -> float | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
