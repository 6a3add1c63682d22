"""Issue 55 item 5: fewer torch threads where other processes keep this process's CPUs busy (no timing thresholds)."""
import os
import subprocess
import sys

import pytest

from graphinfer.platforms import cpu


@pytest.mark.parametrize("busy, expect", [(0.0, 4), (0.4, 4), (0.6, 3), (1.0, 3), (2.2, 2), (8.0, 1)])
def test_busy_cpus_take_threads_away(monkeypatch, busy, expect):
    monkeypatch.setenv("GRAPHINFER_CPU_BUSY_THREADS", "1")
    monkeypatch.setattr(cpu, "physical_cores", lambda: 4)
    monkeypatch.setattr(cpu, "allowed_cpus", lambda: set(range(4)))
    monkeypatch.setattr(cpu, "busy_cpus", lambda sample_s=0.2: busy)
    assert cpu.default_num_threads.__wrapped__() == expect


def test_smt_siblings_count_half_and_opt_out(monkeypatch):
    monkeypatch.setattr(cpu, "physical_cores", lambda: 2)
    monkeypatch.setattr(cpu, "allowed_cpus", lambda: set(range(4)))  # 2 cores x 2 SMT threads
    monkeypatch.setattr(cpu, "busy_cpus", lambda sample_s=0.2: 2.0)  # two logical CPUs busy: one core
    monkeypatch.setenv("GRAPHINFER_CPU_BUSY_THREADS", "1")
    assert cpu.default_num_threads.__wrapped__() == 1
    assert cpu.default_num_threads.__wrapped__(2) == 1  # tensor parallel: its share, no sampling
    monkeypatch.setenv("GRAPHINFER_CPU_BUSY_THREADS", "0")
    assert cpu.default_num_threads.__wrapped__() == 2


def test_busy_cpus_sees_a_hog():
    """A CPU-bound child process shows as about one busy CPU (>= 0.5: the sample is 0.2 s)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        cpu.busy_cpus(0.2)  # let it start
        assert cpu.busy_cpus(0.3) >= 0.5
    finally:
        hog.kill()
        hog.wait()
