"""Only the gateway reaches drafters, verifiers and session data, with real processes (``racer serve``)
and a real ``redis-server`` with a password.

Each attack is made by a client that can open a connection to every port (as any pod could in a
cluster without network policies) but holds no credential: it is refused, and the victim's next
turn is the one plain greedy decoding gives, from the state the attack meant to destroy.
"""

from __future__ import annotations

import queue
import signal

import grpc
import pytest

from common import identity
from common.health import status
from common.settings import HEALTH_SERVICES
from common.v1 import drafter_pb2 as dpb
from common.v1 import drafter_pb2_grpc as dgrpc
from common.v1 import verifier_pb2 as vpb
from common.v1 import verifier_pb2_grpc as vgrpc
from gateway.auth import ApiKeys
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.procs import Proc, RedisProc, reap
from tests.support.stack import prompt, start_gateway, wait_until

UNAUTH = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("identity")
    model_dir = tmp / "model"
    tiny_llama.save_pretrained(model_dir)
    keys = tmp / "api-keys.txt"
    keys.write_text("key-victim victim\nkey-mallory mallory\n")
    rd = RedisProc(tmp / "redis", password="redis-secret-for-tests").start()
    verifier = Proc("verifier", {"RACER_MODEL": str(model_dir), "RACER_THREADS": "1", "RACER_BACKEND": "llama"}, tmp)
    drafter = Proc("drafter", {"RACER_SNAPSHOT_URL": rd.url, "RACER_PRIOR": "none"}, tmp)
    gw_env = {
        "RACER_MODEL": "none",
        "RACER_SESSION_URL": rd.url,
        "RACER_DRAFTERS": drafter.target,
        "RACER_VERIFIERS": verifier.target,
        "RACER_API_KEYS": str(keys),
        "RACER_API_KEYS_RELOAD_SECONDS": "0.2",
    }
    gateway = Proc("gateway", gw_env, tmp)
    hup = Proc("gateway", dict(gw_env, RACER_API_KEYS_RELOAD_SECONDS="0"), tmp, "gateway-sighup")
    procs = [verifier, drafter, gateway, hup]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_healthy(120)
        yield dict(redis=rd, verifier=verifier, drafter=drafter, gateway=gateway, hup=hup, keys=keys)
    finally:
        reap([*procs, rd])


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def _held_open(method, first, metadata=()):
    """Opens a bidi stream, sends ``first`` and keeps the stream open; the first response (or error)."""
    q: queue.Queue = queue.Queue()
    q.put(first)
    responses = method(iter(q.get, None), timeout=30, metadata=metadata)
    try:
        return next(responses)
    finally:
        q.put(None)
        responses.cancel()


def test_without_the_internal_token_backends_refuse_every_call_and_the_victims_turn_is_unchanged(cluster, tiny_llama):
    gw, drafter, verifier = cluster["gateway"], cluster["drafter"], cluster["verifier"]
    p1 = prompt(1, 16)
    with Client(gw.target, "key-victim", timeout=60) as c:
        ids1, _, last = c.complete(p1, max_new_tokens=24, budget=8)
    sid = last.session_id
    assert ids1 == hf_greedy(tiny_llama, p1, 24)
    with Client(gw.target, "key-victim", timeout=10) as c:
        info = c.get_session(sid)
    assert info.drafter == "" and info.verifier == "", "the gateway named a backend address to a client"

    refused = {
        m: verifier.metric("racer_internal_auth_failures_total", method=m) for m in ("/racer.v1.Verifier/Stats",)
    }
    for token in (None, "x" * 43):  # no token, then a wrong one of the right shape
        md = identity.metadata((token,)) if token else ()
        with grpc.insecure_channel(verifier.target) as vch, grpc.insecure_channel(drafter.target) as dch:
            v, d = vgrpc.VerifierStub(vch), dgrpc.DrafterStub(dch)
            assert _code(lambda: v.Stats(vpb.VerifierStatsRequest(), timeout=10, metadata=md)) == UNAUTH
            assert _code(lambda: d.Stats(dpb.DrafterStatsRequest(), timeout=10, metadata=md)) == UNAUTH
            drop = dpb.DropRequest(session_id=sid, tenant="victim")
            assert _code(lambda: d.Drop(drop, timeout=10, metadata=md)) == UNAUTH
            vdrop = vpb.VerifierDropRequest(session_id=sid, tenant="victim")
            assert _code(lambda: v.Drop(vdrop, timeout=10, metadata=md)) == UNAUTH
            # a stream on the victim's (tenant, session id) would have made the victim's turn ABORTED
            vopen = vpb.VerifyRequest(open=vpb.VerifierOpen(session_id=sid, tenant="victim", history=p1))
            assert _code(lambda: _held_open(v.Session, vopen, md)) == UNAUTH
            dopen = dpb.DraftRequest(open=dpb.DrafterOpen(session_id=sid, tenant="victim", history=p1))
            assert _code(lambda: _held_open(d.Session, dopen, md)) == UNAUTH
    assert verifier.metric("racer_internal_auth_failures_total", method="/racer.v1.Verifier/Stats") == (
        refused["/racer.v1.Verifier/Stats"] + 2
    )
    # probes carry no credential and still learn whether the service serves
    assert status(verifier.target, HEALTH_SERVICES["verifier"]) == "SERVING"
    assert status(drafter.target, HEALTH_SERVICES["drafter"]) == "SERVING"

    # the victim's state is intact: the drafter still holds the session in memory, the verifier its cache
    held = {s.session_id: s for s in verifier.sessions()}
    assert held[sid].cache_tokens >= len(p1 + ids1) - 1
    reused = verifier.metric("racer_verifier_reused_tokens_total")
    from_memory = drafter.metric("racer_drafter_restores_total", source="memory")
    p2 = prompt(2, 5)
    with Client(gw.target, "key-victim", timeout=60) as c:
        ids2, _, _ = c.complete(p2, session_id=sid, max_new_tokens=20, budget=8)
    assert ids2 == hf_greedy(tiny_llama, p1 + ids1 + p2, 20)
    assert verifier.metric("racer_verifier_reused_tokens_total") - reused >= len(p1 + ids1) - 1
    assert drafter.metric("racer_drafter_restores_total", source="memory") == from_memory + 1

    # an operator with the token sees it (tenant and all): the token is what separates the two
    assert (sid, "victim") in {(s.session_id, s.tenant) for s in drafter.sessions()}


def test_redis_refuses_clients_without_the_password_and_the_stack_uses_it(cluster):
    rd = cluster["redis"]

    def ask(*commands: bytes) -> bytes:  # raw RESP: what any client that reaches the port can send
        with rd.raw_connection() as s:
            for c in commands:
                s.sendall(c)
            return s.recv(4096)

    assert ask(b"*2\r\n$3\r\nGET\r\n$1\r\nx\r\n").startswith(b"-NOAUTH")
    assert ask(b"*2\r\n$4\r\nAUTH\r\n$5\r\nwrong\r\n").startswith(b"-WRONGPASS")
    assert rd.client().ping()  # with the password
    with Client(cluster["gateway"].target, "key-victim", timeout=60) as c:
        _, _, last = c.complete(prompt(3), max_new_tokens=8, budget=4)
    keys = {k.decode() for k in rd.client().keys("*")}
    assert any(last.session_id in k for k in keys), "the gateway saved the session record in the password Redis"


def test_a_backend_without_a_way_to_authenticate_callers_refuses_to_start(tmp_path):
    p = Proc("drafter", {"RACER_INTERNAL_TOKEN": "", "RACER_PRIOR": "none"}, tmp_path, "drafter-open").start()
    try:
        assert p.wait_exit(60) != 0
        assert "no peer authentication" in p.log_text()
    finally:
        reap([p])


def test_api_keys_are_held_as_digests_and_reloaded_on_change_and_on_sighup(cluster):
    gw, hup, path = cluster["gateway"], cluster["hup"], cluster["keys"]
    keys = ApiKeys(str(path))
    assert keys.tenant("key-victim") == "victim" and keys.tenant("key-vict") is None
    assert "key-victim" not in repr(vars(keys)), "a raw key is kept in memory"

    def works(target: str, key: str) -> bool:
        with Client(target, key, timeout=30) as c:
            try:
                c.list_sessions()
                return True
            except grpc.RpcError as e:
                assert e.code() == UNAUTH, e
                return False

    assert works(gw.target, "key-mallory") and works(hup.target, "key-mallory")
    assert not works(gw.target, "key-newco")
    original = path.read_text()
    try:
        path.write_text("key-victim victim\nkey-newco newco\n")  # mallory's key revoked, newco's added
        wait_until(lambda: works(gw.target, "key-newco"), timeout=30, what="the changed key file read again")
        assert not works(gw.target, "key-mallory") and works(gw.target, "key-victim")
        # the gateway that does not poll reads it on SIGHUP
        assert works(hup.target, "key-mallory") and not works(hup.target, "key-newco")
        hup.signal(signal.SIGHUP)
        wait_until(lambda: works(hup.target, "key-newco"), timeout=30, what="the key file read again on SIGHUP")
        assert not works(hup.target, "key-mallory")
        # a broken file keeps the keys already loaded
        path.write_text("this line is not a key and a tenant\n")
        hup.signal(signal.SIGHUP)
        wait_until(lambda: "API key file not reloaded" in hup.log_text(), timeout=30, what="the bad file logged")
        assert works(hup.target, "key-newco")
    finally:
        path.write_text(original)


def test_a_gateway_with_the_wrong_token_fails_the_turn_clearly_and_says_why_in_its_log(
    cluster, loop_thread, tiny_llama, caplog
):
    srv, _ = start_gateway(
        loop_thread,
        tiny_llama.config.vocab_size,
        drafters=cluster["drafter"].target,
        verifiers=cluster["verifier"].target,
        internal_token="not-the-cluster-token-0123456789",
        reconnect_seconds=0.3,
    )
    verifier = cluster["verifier"]
    before = verifier.metric("racer_internal_auth_failures_total", method="/racer.v1.Verifier/Session")
    try:
        with Client(f"127.0.0.1:{srv.port}", timeout=30) as c, pytest.raises(grpc.RpcError) as e:
            c.complete(prompt(4), max_new_tokens=4)
        assert e.value.code() == grpc.StatusCode.INTERNAL  # the deployment's fault, not the caller's key
        assert "could not authenticate to its backends" in e.value.details()
        assert "refused the gateway's credential" in caplog.text
        assert verifier.metric("racer_internal_auth_failures_total", method="/racer.v1.Verifier/Session") > before
    finally:
        loop_thread.run(srv.stop(0))
