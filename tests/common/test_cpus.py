"""CPU confinement: RACER_CPUS puts every thread of a service on the CPUs given; bad lists are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import cpus
from tests.support.procs import ROOT, Proc

linux_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")


def test_cpu_lists_parse_and_format():
    assert cpus.parse("0,2-3") == {0, 2, 3}
    assert cpus.parse(" 1 ") == {1}
    assert cpus.format_list({3, 0, 2}) == "0,2,3"
    for bad in ("", "a", "3-1", "-1", "1,,2", "0-x"):
        with pytest.raises(ValueError, match="CPU list"):
            cpus.parse(bad)


def test_the_verifier_gets_the_upper_half():
    assert cpus.split_for_verifier([0]) is None
    assert cpus.split_for_verifier([0, 1]) == ([1], [0])
    assert cpus.split_for_verifier([0, 1, 2, 3, 4]) == ([3, 4], [0, 1, 2])


def test_the_verifiers_rounds_keep_its_cpus_count_and_its_prefills_take_every_cpu():
    split = cpus.split_for_verifier([0, 1, 2, 3, 4])
    assert cpus.placement(split, "verifier") == {"RACER_CPUS": "0,1,2,3,4", "RACER_ROUND_THREADS": "2"}
    assert cpus.placement(split, "drafter") == cpus.placement(split, "gateway") == {"RACER_CPUS": "0,1,2"}
    # one CPU of its own: a batch of trees on one thread would be a forward on half the machine
    two = cpus.split_for_verifier([0, 1])
    assert cpus.placement(two, "verifier") == {"RACER_CPUS": "0,1", "RACER_ROUND_THREADS": "0"}
    assert cpus.placement(two, "gateway") == {"RACER_CPUS": "0"}


def _threads_cpus(pid: int) -> dict[str, str]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        name = (task / "comm").read_text().strip()
        out[f"{task.name}:{name}"] = next(
            line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list")
        )
    return out


@linux_affinity
def test_a_confined_service_runs_every_thread_on_its_cpus(tmp_path):
    last = max(os.sched_getaffinity(0))
    p = Proc("drafter", {"RACER_PRIOR": "none", "RACER_CPUS": str(last)}, tmp_path).start()
    try:
        p.wait_healthy()
        threads = _threads_cpus(p.proc.pid)
        assert len(threads) > 1 and set(threads.values()) == {str(last)}, threads
    finally:
        p.kill()


@linux_affinity
def test_a_bad_cpu_list_stops_the_service_with_a_clear_message():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACER_")}
    for spec, words in (("1-", "not a CPU number or range"), (str(10_000), "none of these CPUs is available")):
        r = subprocess.run(
            [sys.executable, "-m", "racer.cli", "serve", "drafter", "--cpus", spec, "--prior", "none"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and "--cpus" in r.stderr and words in r.stderr, (r.returncode, r.stderr[-500:])
