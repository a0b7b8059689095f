"""Traces: off without an endpoint; with one, a turn is one trace across gateway, drafter and
verifier, with its phases as spans. Each case runs in a process of its own (a process installs one
tracer provider, and the rest of the suite runs without)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from common.tracing import ROUNDS_PER_SPAN
from tests.support.engine import hf_greedy
from tests.support.stack import prompt

ROOT = Path(__file__).resolve().parents[2]


def _python(code_or_module: list[str], **env) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "RACER_OTLP_ENDPOINT"}
    out = subprocess.run(
        [sys.executable, *code_or_module],
        cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


CHECK = """
import json, sys
from opentelemetry import trace
from common import tracing
provider = tracing.setup("gateway", "")
print(json.dumps({
    "provider": provider is not None,
    "enabled": tracing.enabled(),
    "api": type(trace.get_tracer_provider()).__name__,
    "server": len(tracing.server_interceptors()),
    "client": len(tracing.client_interceptors()),
    "sdk_imported": "opentelemetry.sdk.trace" in sys.modules,
}))
"""


def test_without_an_endpoint_nothing_is_installed():
    got = json.loads(_python(["-c", CHECK]))
    assert got == {
        "provider": False,
        "enabled": False,
        "api": "ProxyTracerProvider",
        "server": 0,
        "client": 0,
        "sdk_imported": False,
    }


def test_the_standard_otel_endpoint_variable_turns_it_on():
    got = json.loads(_python(["-c", CHECK], OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4317"))
    assert got["provider"] and got["enabled"] and got["api"] == "TracerProvider"
    assert got["server"] == 1 and got["client"] == 4  # the aio server interceptor; one per call type


def test_a_turn_is_one_trace_across_the_services_with_a_span_per_phase(tiny_llama):
    run = json.loads(_python(["-m", "tests.support.traced"]))
    turns, spans = run["turns"], run["spans"]
    # Tracing does not change the output: plain greedy, the second turn on the whole history.
    history = prompt(0)
    assert turns[0]["ids"] == hf_greedy(tiny_llama, history, 40)
    history += turns[0]["ids"] + prompt(1)
    assert turns[1]["ids"] == hf_greedy(tiny_llama, history, 40)

    traces: dict[str, list[dict]] = {}
    for s in spans:
        traces.setdefault(s["trace_id"], []).append(s)
    assert len(traces) == 4, "one trace per turn (three), and one for the failed call"
    # A failed call keeps its status and message, and its span carries the status (NOT_FOUND is the
    # caller's error: by OpenTelemetry's conventions a server span does not turn ERROR for it).
    assert run["error"]["code"] == "NOT_FOUND" and "no-such-session" in run["error"]["details"]
    (failed,) = [t for t in traces.values() if not any(s["name"] == "prefill" for s in t)]
    (root,) = failed
    assert root["name"] == "/racer.v1.Generation/Generate" and root["attributes"]["rpc.grpc.status_code"] == 5
    traces = {k: t for k, t in traces.items() if t is not failed}

    # A turn started outside a traced RPC (the HTTP API's way) is one trace under a span of its own.
    (direct,) = [t for t in traces.values() if any(s["name"] == "turn" for s in t)]
    (root,) = [s for s in direct if s["parent_id"] is None]
    assert root["name"] == "turn" and root["attributes"]["racer.tenant"] == "local"
    assert all(s["parent_id"] in {x["span_id"] for x in direct} for s in direct if s is not root)
    names = Counter(s["name"] for s in direct)
    assert names["prefill"] == names["save"] == names["drafter.open"] == names["verifier.prefill"] == 1
    rounds = [s["attributes"] for s in direct if s["name"] == "rounds"]
    assert sum(a["racer.rounds"] for a in rounds) == run["direct"]["rounds"]
    assert sum(a["racer.drafted_tokens"] for a in rounds) == run["direct"]["drafted"]
    traces = {k: t for k, t in traces.items() if t is not direct}
    for turn, trace in zip(turns, sorted(traces.values(), key=lambda t: min(s["start"] for s in t))):
        by_id = {s["span_id"]: s for s in trace}
        (root,) = [s for s in trace if s["parent_id"] is None]
        assert root["name"] == "/racer.v1.Generation/Generate" and root["kind"] == "SERVER"
        assert root["attributes"]["racer.tenant"] == "local" and root["attributes"]["racer.session_id"]
        assert all(s["parent_id"] in by_id for s in trace if s is not root), "every parent is in the trace"

        def parent(s):
            return by_id[s["parent_id"]]

        names = Counter((s["scope"], s["name"]) for s in trace)
        assert names[("racer.gateway", "prefill")] == names[("racer.gateway", "save")] == 1
        assert names[("racer.drafter", "drafter.open")] == names[("racer.verifier", "verifier.prefill")] == 1
        (prefill,) = [s for s in trace if s["name"] == "prefill"]
        (save,) = [s for s in trace if s["name"] == "save"]
        rounds = sorted((s for s in trace if s["name"] == "rounds"), key=lambda s: s["start"])
        for phase in [prefill, save, *rounds]:
            assert parent(phase) is root and root["start"] <= phase["start"] <= phase["end"] <= root["end"]
        assert prefill["end"] <= rounds[0]["start"] and rounds[-1]["end"] <= save["start"]

        # gateway prefill -> client stream -> the backend's server stream -> its own phase span
        for service, phase in (("Drafter", "drafter.open"), ("Verifier", "verifier.prefill")):
            (inner,) = [s for s in trace if s["name"] == phase]
            server = parent(inner)
            assert (server["name"], server["kind"]) == (f"/racer.v1.{service}/Session", "SERVER")
            client = parent(server)
            assert (client["name"], client["kind"]) == (f"/racer.v1.{service}/Session", "CLIENT")
            assert parent(client) is prefill

        # The round spans add up to the turn's speculation stats.
        a = [s["attributes"] for s in rounds]
        assert len(rounds) == math.ceil(turn["rounds"] / ROUNDS_PER_SPAN)
        assert all(x["racer.rounds"] == ROUNDS_PER_SPAN for x in a[:-1]) and 1 <= a[-1]["racer.rounds"]
        assert sum(x["racer.rounds"] for x in a) == turn["rounds"]
        assert sum(x["racer.drafted_tokens"] for x in a) == turn["drafted"]
        assert sum(x["racer.accepted_tokens"] for x in a) == turn["accepted"]
        assert all(x["racer.verify_ms"] > 0 and x["racer.draft_ms"] > 0 for x in a)

    first, second = sorted(traces.values(), key=lambda t: min(s["start"] for s in t))
    attrs = {(s["name"], i): s["attributes"] for i, t in enumerate((first, second)) for s in t}
    assert [attrs["prefill", i]["racer.history_tokens"] for i in (0, 1)] == [12, 12 + 40 + 12]
    assert attrs["drafter.open", 0]["racer.restored_from"] == "new"
    assert attrs["drafter.open", 1]["racer.restored_from"] == "memory"
    assert attrs["verifier.prefill", 0]["racer.reused_tokens"] == 0
    assert attrs["verifier.prefill", 1]["racer.reused_tokens"] > 0, "the second turn reused the KV cache"
