"""A service that cannot start says why in one line (``racer serve KIND: REASON``), and the commands
that start services report which one exited and why in one line, without a traceback
(racer/exits.py, ``racer.launch.serve``, ``racer.stack``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from racer import exits, launch
from racer.exits import ServiceFailed

HF_REFUSES = (
    "model_type='mistral' runs on the hf backend, which verifies in float32 only (got bfloat16): use --dtype float32"
)


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACER_")}
    return env | {"OMP_NUM_THREADS": "1", "RACER_THREADS": "1"} | settings


@pytest.fixture(scope="module")
def sliding_window_model(tmp_path_factory):
    """A model only the hf backend verifies (a sliding window), with a tokenizer."""
    from racer.bench.tiny import make
    from tests.support.tinytok import make_char_tokenizer

    path = tmp_path_factory.mktemp("mistral-swa")
    make("mistral-swa").save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return path


# -- the reason, from what a service wrote --------------------------------------------------------------


def test_the_reason_is_the_line_a_service_ends_with_when_it_cannot_start():
    log = "\n".join(
        [
            json.dumps({"level": "INFO", "msg": "model", "dtype": "bfloat16"}),
            json.dumps({"level": "ERROR", "msg": "start-up failed", "exc": "Traceback ...\nRuntimeError: boom"}),
            "racer serve verifier: RuntimeError: boom",
            "",
        ]
    )
    assert exits.reason(log, 1) == "RuntimeError: boom"
    assert exits.reason("racer: RACER_PORT='abc': expected an integer\n", 2) == "RACER_PORT='abc': expected an integer"


def test_without_that_line_the_reason_is_the_last_error_logged_or_a_tracebacks_last_line_or_the_exit():
    error = json.dumps(
        {"level": "ERROR", "msg": "forward failed", "exc": "Traceback (most recent call last):\n  ...\nKeyError: 'x'"}
    )
    info = json.dumps({"level": "INFO", "msg": "drained"})
    assert exits.reason(f"{error}\n{info}\n", 1) == "forward failed: KeyError: 'x'"
    trace = (
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nOSError: [Errno 98] Address in use\n'
    )
    assert exits.reason(trace, 1) == "OSError: [Errno 98] Address in use"
    assert exits.reason("", -9) == "killed by SIGKILL, no reason in its output"
    assert exits.reason("Loading weights: 100%\n", 3) == "exit status 3, no reason in its output"


def test_a_start_up_refusal_is_one_line_and_anything_else_is_logged_first(capsys, caplog):
    assert launch._not_started("verifier", ValueError(HF_REFUSES)) == 2
    assert capsys.readouterr().err == f"racer serve verifier: {HF_REFUSES}\n"
    assert not caplog.records
    assert launch._not_started("gateway", RuntimeError("no port\nmore detail")) == 1
    assert capsys.readouterr().err == "racer serve gateway: RuntimeError: no port\n"
    assert [r.getMessage() for r in caplog.records] == ["start-up failed"] and caplog.records[0].exc_info


def test_a_process_service_that_exits_is_a_service_failed_with_the_reason_of_its_log():
    """``racer soak`` and the benchmarks' process stacks wait through ``exits.wait_healthy``."""

    class Exited:
        name, log = "verifier0", "/tmp/verifier0.log"
        proc = SimpleNamespace(poll=lambda: 2)

        def wait_healthy(self, timeout):
            raise RuntimeError("verifier0 exited before it served:\n...the whole log tail...")

        def alive(self):
            return False

        def log_text(self):
            return f"Loading weights: 100%\nracer serve verifier: {HF_REFUSES}\n"

    with pytest.raises(ServiceFailed) as e:
        exits.wait_healthy(Exited())
    assert str(e.value) == f"verifier0 exited before it served: {HF_REFUSES}"
    assert "\n" not in str(e.value)


def test_the_stack_shows_a_services_output_but_holds_its_last_line_for_its_own(capsys):
    from racer.stack import _Output

    code = (
        "import sys; print('a warning', file=sys.stderr); "
        "print('racer serve verifier: no such model', file=sys.stderr); sys.exit(2)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    out = _Output(proc.stderr)
    proc.wait(60)
    failed = out.failed("verifier", proc)
    assert str(failed) == "verifier exited before it served: no such model"
    assert capsys.readouterr().err == "a warning\n"  # shown as it came; the reason only in the exception


# -- real processes: a verifier that refuses its start fails in seconds ----------------------------------


def test_a_service_that_cannot_start_ends_with_one_line_saying_why(tmp_path):
    missing = tmp_path / "nothing-here"
    proc = subprocess.run(
        [sys.executable, "-m", "racer.cli", "serve", "verifier"],
        env=_env(RACER_MODEL=str(missing), RACER_INTERNAL_TOKEN="t" * 32, RACER_HOST=f"unix:{tmp_path}/v.sock"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last == f"racer serve verifier: {missing}: no such model file or directory"


def test_a_stack_whose_verifier_cannot_start_says_which_and_why_in_one_line(sliding_window_model):
    argv = ["stack", "Hi", "--model", str(sliding_window_model), "--dtype", "bfloat16"]
    argv += ["--any-ports", "--http-port", "0", "--no-pin", "--max-new-tokens", "4"]
    proc = subprocess.run(
        [sys.executable, "-m", "racer.cli", *argv], env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if "float32 only" in line] == [
        f"racer: verifier exited before it served: {HF_REFUSES}"
    ]
    assert proc.stdout == ""


# -- a fixed port another process serves --------------------------------------------------------------

# A service as ``racer stack`` starts it, imitated: it writes its ports file once it "listens", or,
# when it cannot bind, exits with the one line a real one ends with (nothing listens here: the
# addresses are served by a foreign server, as another stack's services would be).
_FAKE_SERVICE = """
import json, os, sys, time
from racer.exits import fatal_line
service, target = sys.argv[1], sys.argv[2]
if service == "gateway":
    print(fatal_line(service, f"RuntimeError: {service}: cannot bind {target}"), file=sys.stderr, flush=True)
    sys.exit(1)
with open(os.environ["RACER_PORTS_FILE"], "w") as f:
    json.dump({"grpc": target, "metrics": 0, "http": 0}, f)
time.sleep(600)
"""


def test_a_stack_whose_fixed_port_another_server_serves_stops_instead_of_using_that_server(tmp_path, monkeypatch):
    """Another stack's gateway answers SERVING at this stack's fixed gateway address; this stack's
    gateway cannot bind it and exits. The stack must say so, not report itself up (its clients would
    then talk to the other stack)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from common.settings import HEALTH_SERVICES
    from racer import stack

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    for name in HEALTH_SERVICES.values():
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    target = f"127.0.0.1:{port}"
    targets = {s: target for s in ("verifier", "drafter", "gateway")}
    envs = {
        s: _env(RACER_PORTS_FILE=str(tmp_path / f"{s}.json"), RACER_METRICS_PORT="0", PYTHONPATH=os.getcwd())
        for s in targets
    }

    def spawn(service, env):
        proc = subprocess.Popen([sys.executable, "-c", _FAKE_SERVICE, service, target], env=env, stderr=subprocess.PIPE)
        proc.output = stack._Output(proc.stderr)
        return proc

    monkeypatch.setattr(stack, "_spawn", spawn)
    procs: dict[str, subprocess.Popen] = {}
    try:
        with pytest.raises(ServiceFailed) as e:
            stack.start_healthy(procs, envs, targets)
        assert e.value.service == "gateway"
        assert f"cannot bind {target}" in str(e.value)
    finally:
        stack.stop(procs.items())
        server.stop(None)
