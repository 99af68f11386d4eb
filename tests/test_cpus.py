"""`--workers auto`: the CPUs the process may use, capped by its cgroup's CPU quota (a container's CPU limit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.config import build_config
from gateway.cpus import cgroup_cpu_limit, usable_cpus


def v2_mount(point: Path, root: str = "/") -> str:
    return f"35 24 0:30 {root} {point} rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"


def v1_cpu_mount(point: Path, root: str = "/") -> str:
    return f"32 31 0:29 {root} {point} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"


def write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, content in (line.split("=", 1) for line in text.split(";")):
        (path / name).write_text(content + "\n")


def test_a_v2_quota_in_the_process_cgroup_is_its_cpu_limit(tmp_path: Path) -> None:
    write(tmp_path / "kubepods" / "pod1" / "ctr", "cpu.max=150000 100000")
    write(tmp_path / "kubepods" / "pod1", "cpu.max=max 100000")
    assert cgroup_cpu_limit(v2_mount(tmp_path), "0::/kubepods/pod1/ctr\n") == 1.5


def test_the_lowest_quota_up_the_tree_wins(tmp_path: Path) -> None:
    write(tmp_path / "pod" / "ctr", "cpu.max=400000 100000")
    write(tmp_path / "pod", "cpu.max=200000 100000")
    write(tmp_path, "cpu.max=max 100000")
    assert cgroup_cpu_limit(v2_mount(tmp_path), "0::/pod/ctr\n") == 2.0


def test_a_v1_cfs_quota_is_read_from_the_cpu_hierarchy(tmp_path: Path) -> None:
    write(tmp_path / "docker" / "abc", "cpu.cfs_quota_us=50000;cpu.cfs_period_us=100000")
    cgroups = "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n"
    assert cgroup_cpu_limit(v1_cpu_mount(tmp_path), cgroups) == 0.5


def test_a_container_reads_the_root_of_its_own_cgroup_namespace(tmp_path: Path) -> None:
    write(tmp_path, "cpu.max=300000 100000")
    assert cgroup_cpu_limit(v2_mount(tmp_path), "0::/\n") == 3.0
    # A cgroup path outside the mount's root (a host path seen through a namespaced mount): the mount itself.
    assert cgroup_cpu_limit(v2_mount(tmp_path, root="/docker/abc"), "0::/elsewhere\n") == 3.0
    assert cgroup_cpu_limit(v2_mount(tmp_path, root="/docker/abc"), "0::/docker/abcdef\n") == 3.0
    write(tmp_path / "sub", "cpu.max=100000 100000")
    assert cgroup_cpu_limit(v2_mount(tmp_path, root="/docker/abc"), "0::/docker/abc/sub\n") == 1.0


@pytest.mark.parametrize("files", ["cpu.max=max 100000", "cpu.max=", "cpu.max=garbage"])
def test_no_v2_quota_is_no_limit(tmp_path: Path, files: str) -> None:
    write(tmp_path, files)
    assert cgroup_cpu_limit(v2_mount(tmp_path), "0::/\n") is None


def test_no_v1_quota_and_no_cgroup_files_are_no_limit(tmp_path: Path) -> None:
    write(tmp_path, "cpu.cfs_quota_us=-1;cpu.cfs_period_us=100000")
    assert cgroup_cpu_limit(v1_cpu_mount(tmp_path), "4:cpu,cpuacct:/\n") is None
    assert cgroup_cpu_limit(v2_mount(tmp_path / "missing"), "0::/\n") is None
    assert cgroup_cpu_limit("", "") is None


def test_a_v1_mount_of_other_controllers_is_not_read(tmp_path: Path) -> None:
    write(tmp_path, "cpu.cfs_quota_us=50000;cpu.cfs_period_us=100000")
    memory = f"35 31 0:31 / {tmp_path} rw,relatime - cgroup cgroup rw,memory\n"
    assert cgroup_cpu_limit(memory, "5:memory:/\n") is None


def test_workers_auto_is_the_usable_cpus() -> None:
    cpus = usable_cpus()
    assert 1 <= cpus <= (os.cpu_count() or 1)
    assert build_config({"backends": [{"url": "http://127.0.0.1:9"}], "workers": "auto"}, {}).workers == cpus


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")
@pytest.mark.parametrize(("limit", "expected"), [(0.5, 1), (1.5, 2), (None, None), (10_000.0, None)])
def test_the_quota_caps_the_affinity_set_rounded_up(monkeypatch: pytest.MonkeyPatch, limit: float | None,
                                                    expected: int | None) -> None:
    monkeypatch.setattr("gateway.cpus.cgroup_cpu_limit", lambda mountinfo, cgroups: limit)
    allowed = len(os.sched_getaffinity(0))
    assert usable_cpus() == (min(expected, allowed) if expected is not None else allowed)
