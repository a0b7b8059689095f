"""Local processes on addresses nobody can take between a choice and a bind (racer/procs.py)."""

from __future__ import annotations

import json
import signal

import pytest

from racer.procs import RedisServer
from tests.support.procs import DTYPE, Proc, reap, verifier_procs

DRAFTER = {"RACER_PRIOR": "none"}


def test_two_servers_started_at_once_listen_apart_on_the_ports_they_report(tmp_path):
    """Both bind port 0 (gRPC and metrics) at the same time; each reports what it got in its ports
    file and serves there."""
    procs = [Proc("drafter", DRAFTER, tmp_path, f"tcp{i}", unix=False) for i in range(2)]
    try:
        for p in procs:  # both start before either listens
            p.start()
        for p in procs:
            p.wait_healthy()
        ports = [p.ports() for p in procs]
        assert all(json.loads(p.ports_file.read_text()) == q for p, q in zip(procs, ports))
        grpc_ports = {q["port"] for q in ports}
        metrics_ports = {q["metrics"] for q in ports}
        assert len(grpc_ports) == 2 and len(metrics_ports) == 2 and not grpc_ports & metrics_ports
        assert 0 not in grpc_ports | metrics_ports
        assert [q["grpc"] for q in ports] == [f"127.0.0.1:{q['port']}" for q in ports]
        for p in procs:
            assert p.metric("process_start_time_seconds") > 0  # its metrics endpoint answers
            assert p.sessions() == []  # and its gRPC server, with the internal token
    finally:
        reap(procs)


def test_a_backend_restarted_listens_at_the_same_unix_socket_and_reports_new_metrics(tmp_path):
    p = Proc("drafter", DRAFTER, tmp_path, "unix")
    try:
        target = p.target  # known before it starts: what a gateway is given
        assert target.startswith("unix:")
        p.start().wait_healthy()
        first = p.ports()
        assert first["grpc"] == target and first["port"] == 0
        assert p.sessions() == []
        p.signal(signal.SIGKILL)  # its socket file stays behind, as after a crash
        p.wait_exit(30)
        p.start().wait_healthy()
        assert p.ports()["grpc"] == target
        assert p.sessions() == []  # served again at the same address
        assert p.metric("process_start_time_seconds") > 0
    finally:
        reap([p])


def test_two_redis_servers_at_once_and_a_restart_keeps_the_url_and_the_data(tmp_path):
    a = RedisServer(tmp_path / "a").start()
    b = RedisServer(tmp_path / "b", appendonly=False).start()
    try:
        assert a.url != b.url
        a.client().set("k", "a")
        b.client().set("k", "b")
        assert a.client().get("k") == b"a" and b.client().get("k") == b"b"
        url = a.url
        a.stop()
        a.start()  # from its append-only file, at the same address
        assert a.url == url and a.client().get("k") == b"a"
    finally:
        a.stop()
        b.stop()


def test_a_verifier_runs_the_dtype_the_test_set_and_a_verifier_running_another_fails_the_test(tmp_path, tiny_llama):
    """The harness gives a test's verifier its dtype whatever the test process's own RACER_* say
    (``Service`` passes none on) and whatever ``--dtype auto`` would pick on this CPU, then asks the
    verifier what it runs: a test whose verifier reports another dtype fails where it starts."""
    model = tmp_path / "model"
    tiny_llama.save_pretrained(model)
    (p,) = verifier_procs(1, model, tmp_path, {})
    try:
        p.start().wait_healthy()  # checks the reported setup
        setup = p.setup()
        assert (setup.dtype, setup.backend) == (DTYPE, "llama")
        assert setup.kernel_checks and all(c.ok for c in setup.kernel_checks)  # the start-up check ran
        assert p.metric("racer_verifier_kernel_refused") == 0 and p.metric("racer_verifier_kernel_check_seconds") > 0
        p.env["RACER_DTYPE"] = "bfloat16"  # what the test says, no longer what runs
        with pytest.raises(AssertionError, match="RACER_DTYPE=bfloat16, but the verifier reports 'float32'"):
            p.check_setup()
    finally:
        reap([p])
