"""The pipeline over TLS: certificates made here, mutual TLS between the gateway and its drafters and
verifiers and between verifiers (KV transfers), TLS (with client certificates) from the client to the
gateway."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest

from common.tls import channel_credentials
from common.v1 import drafter_pb2, drafter_pb2_grpc
from racer.client import Client
from tests.support.engine import hf_greedy
from tests.support.stack import prompt, start_drafter, start_gateway, start_stack

# The only name the "peer" certificate carries (not the address verifiers are dialled at).
PEER_NAME = "racer-verifier.test"


def _cert(name: str, issuer=None, ca: bool = False, names: tuple[str, ...] = ()):
    """A certificate of ``issuer`` (self-signed without one) for server and client auth, naming
    localhost and 127.0.0.1, or ``names`` alone."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_cert, signer_key = issuer if issuer else (None, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(signer_cert.subject if signer_cert else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        sans = [x509.DNSName(n) for n in names] or [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        b = b.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return b.sign(signer_key, hashes.SHA256()), key


def _write(path, cert, key):
    from cryptography.hazmat.primitives import serialization

    (path.parent / f"{path.name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (path.parent / f"{path.name}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(path.parent / f"{path.name}.crt"), str(path.parent / f"{path.name}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = _cert("racer test CA", ca=True)
    rogue = _cert("someone else's CA", ca=True)
    out = {"ca": _write(d / "ca", *ca)[0], "rogue_ca": _write(d / "rogue", *rogue)[0]}
    for name, issuer in (("server", ca), ("gateway-client", ca), ("user", ca), ("rogue-client", rogue)):
        out[name] = _write(d / name, *_cert(name, issuer))
    out["peer"] = _write(d / "peer", *_cert("peer", ca, names=(PEER_NAME,)))
    return out


@pytest.fixture(scope="module")
def tls_stack(loop_thread, tiny_llama, pki):
    cert, key = pki["server"]
    gcert, gkey = pki["gateway-client"]
    st = start_stack(
        loop_thread,
        tiny_llama,
        drafters=2,
        # drafters, verifier: mutual TLS and nothing else (a client certificate of the CA is enough)
        backend=dict(tls_cert=cert, tls_key=key, tls_client_ca=pki["ca"], internal_token=""),
        tls_cert=cert,
        tls_key=key,
        tls_client_ca=pki["ca"],  # the gateway's own port: clients need a certificate
        tls_ca=pki["ca"],
        tls_client_cert=gcert,
        tls_client_key=gkey,
        reconnect_seconds=0.5,
    )
    yield st
    st.stop()


def test_pipeline_over_mutual_tls_is_lossless(tls_stack, tiny_llama, pki):
    creds = channel_credentials(pki["ca"], *pki["user"])
    with Client(tls_stack.gateway, timeout=60, credentials=creds) as c:
        p = prompt(1)
        ids, _, last = c.complete(p, max_new_tokens=30, budget=8)
        assert ids == hf_greedy(tiny_llama, p, 30)
        p2 = prompt(2, 4)
        ids2, _, _ = c.complete(p2, session_id=last.session_id, max_new_tokens=20)
        assert ids2 == hf_greedy(tiny_llama, p + ids + p2, 20)


def test_without_the_right_certificates_nothing_connects(tls_stack, pki):
    def refused(target, creds, call):
        ch = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
        with ch, pytest.raises(grpc.RpcError) as e:
            call(ch)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    stats = lambda ch: drafter_pb2_grpc.DrafterStub(ch).Stats(drafter_pb2.DrafterStatsRequest(), timeout=5)  # noqa: E731
    drafter = tls_stack.drafter_target(0)
    refused(drafter, None, stats)  # plaintext
    refused(drafter, channel_credentials(pki["ca"]), stats)  # TLS without a client certificate
    refused(drafter, channel_credentials(pki["ca"], *pki["rogue-client"]), stats)  # a certificate from another CA
    refused(drafter, channel_credentials(pki["rogue_ca"], *pki["user"]), stats)  # the server is not who we trust
    with grpc.secure_channel(drafter, channel_credentials(pki["ca"], *pki["user"])) as ch:
        stats(ch)  # the client with a certificate from the trusted CA gets through
    for creds in (None, channel_credentials(pki["ca"])):
        with Client(tls_stack.gateway, timeout=10, credentials=creds) as c, pytest.raises(grpc.RpcError) as e:
            c.complete([5, 6], max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_gateway_without_a_client_certificate_cannot_use_mtls_backends(loop_thread, tiny_llama, tls_stack, pki):
    srv, _ = start_gateway(
        loop_thread,
        96,
        tls_ca=pki["ca"],
        reconnect_seconds=0.3,
        drafters=tls_stack.drafter_target(0),
        verifiers=tls_stack.verifier_target(0),
    )
    try:
        with Client(f"127.0.0.1:{srv.port}", timeout=60) as c, pytest.raises(grpc.RpcError) as e:
            c.complete([5, 6], max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # the wait for a reachable verifier was bounded by reconnect_seconds, not the client's deadline
        assert "no verifier reachable for 0.3 s" in e.value.details(), e.value.details()
    finally:
        loop_thread.run(srv.stop(0))


def test_verifiers_fetch_prefix_blocks_from_each_other_over_mutual_tls(loop_thread, tiny_llama, pki):
    """Verifiers that require client certificates of the CA (and no internal token), each with a
    certificate naming only ``PEER_NAME``, reached at 127.0.0.1. A receiver with the verifier's TLS
    settings for its calls to other verifiers (the CA, its client certificate, the name) fetches a
    tenant's prefix blocks from their holder; one without a client certificate is refused by the
    holder's handshake (``source``) and prefills. The output is transformers' greedy output both ways."""
    from racer.bench.tiny import make_tiny_llama
    from tests.services.test_prefix_fetch import BLOCK, SYSTEM, N, _cache, _delta, _start_verifier, _turn
    from verifier import native

    cert, key = pki["peer"]
    serve = dict(tls_cert=cert, tls_key=key, tls_client_ca=pki["ca"], internal_token="")
    dial = dict(tls_ca=pki["ca"], tls_server_name=PEER_NAME)
    # The tiny model's weights on a model of their own, its kernel plan forced rather than measured:
    # the three verifiers' fingerprints agree whatever a measurement on a busy machine would choose.
    # The native library is loaded first (a measured plan would load it), so all three name it.
    native.library()
    model = make_tiny_llama()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RACER_KERNELS", "linear")
        started = [
            _start_verifier(loop_thread, model, **serve),  # the holder
            _start_verifier(loop_thread, model, **serve, **dial, tls_client_cert=cert, tls_client_key=key),
            _start_verifier(loop_thread, model, **serve, **dial),  # no client certificate
        ]
    (holder, _), (receiver, _), (bare, _) = started
    user = channel_credentials(pki["ca"], *pki["user"])

    def channel(target: str) -> grpc.Channel:  # the test's own calls: a client certificate of the CA
        return grpc.secure_channel(target, user, options=[("grpc.ssl_target_name_override", PEER_NAME)])

    try:
        history = SYSTEM + prompt(6, 7)
        expected = hf_greedy(tiny_llama, history, N)
        _cache(holder.address, "erin", "tls-a", history, channel)
        with _delta() as d:
            out, opened = _turn(receiver.address, "erin", "tls-b", history, (holder.address, 4), N, channel)
        assert out == expected
        assert d["fetched"] == 4 and d["served"] == 4 and opened.fetched_tokens == 4 * BLOCK
        assert d["source"] == 0

        with _delta() as d:
            out, opened = _turn(bare.address, "erin", "tls-c", history, (holder.address, 4), N, channel)
        assert out == expected
        assert d["source"] == 1 and d["fetched"] == 0 and d["served"] == 0
        assert opened.fetched_tokens == 0 and opened.prefix_tokens == 0  # prefilled all of it
    finally:
        for srv, core in started:
            loop_thread.run(srv.stop(0))
            core.close()


def test_tls_settings_that_cannot_work_are_refused_at_start(pki):
    from common.tls import channel_credentials, server_credentials

    cert, key = pki["server"]
    assert server_credentials("", "") is None and channel_credentials("") is None
    for bad in (
        lambda: server_credentials(cert, ""),
        lambda: server_credentials("", "", pki["ca"]),
        lambda: channel_credentials("", cert, key),
        lambda: channel_credentials(pki["ca"], cert, ""),
        lambda: server_credentials("/nonexistent.crt", key),
    ):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize(
    "service, settings, says",
    [
        ("verifier", dict(tls_client_cert="server.crt", tls_client_key="server.key"), "needs --tls-ca"),
        ("verifier", dict(tls_ca="ca", tls_client_cert="server.crt"), "its key go together"),
        ("verifier", dict(tls_server_name=PEER_NAME), "--tls-server-name needs --tls-ca"),
        ("verifier", dict(tls_ca="/nonexistent.crt"), "--tls-ca '/nonexistent.crt'"),
        ("gateway", dict(tls_server_name=PEER_NAME), "--tls-server-name needs --tls-ca"),
    ],
)
def test_client_tls_settings_that_cannot_work_stop_the_start_with_one_line(pki, service, settings, says):
    """A verifier's settings for its calls to other verifiers, as the gateway's for its calls to
    drafters and verifiers: refused before the model or tokenizer loads."""
    import asyncio

    from racer import launch

    files = {"ca": pki["ca"], "server.crt": pki["server"][0], "server.key": pki["server"][1]}
    settings = {k: files.get(v, v) for k, v in settings.items()}
    if service == "verifier":
        start = launch.start_verifier(launch.defaults("verifier", port=0, internal_token="t" * 32, **settings))
    else:
        start = launch.start_gateway(launch.defaults("gateway", port=0, model="none", **settings))
    with pytest.raises(ValueError) as e:
        asyncio.run(start)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_probes_without_a_certificate_pass_on_the_health_port_of_a_mutual_tls_backend(loop_thread, pki):
    """What the kubelet does in k8s/overlays/mtls: a plaintext gRPC health check without a
    certificate. It fails on the gRPC port (mutual TLS) and passes on the health-only port."""
    from common.health import status

    cert, key = pki["server"]
    srv, _ = start_drafter(loop_thread, tls_cert=cert, tls_key=key, tls_client_ca=pki["ca"], health_port=-1)
    health_port = srv.health_port
    try:
        assert status(f"127.0.0.1:{srv.port}", "racer.v1.Drafter") == "UNAVAILABLE"
        assert status(f"127.0.0.1:{health_port}", "racer.v1.Drafter") == "SERVING"
        assert status(f"127.0.0.1:{health_port}", "") == "SERVING"
    finally:
        loop_thread.run(srv.stop(0))


def test_the_stores_speak_tls_to_a_redis_that_requires_it_from_the_url_alone(pki, tmp_path):
    """k8s/overlays/mtls: Redis serves TLS only; drafters and gateways reach it through the
    rediss:// URL of the racer-redis Secret, naming the CA file. A client that does not trust the
    CA, or speaks plaintext, gets nothing."""
    import asyncio
    import shutil
    import socket
    import subprocess
    import threading

    import redis

    from common.store import open_store

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("no redis-server on PATH; run scripts/setup.sh")
    cert, key = pki["server"]
    # Redis serves TLS on a TCP port only, and cannot be given port 0: it gets a port the OS just
    # offered. Another program may bind that port first; redis-server then says so and exits, and
    # the next offer is tried (its log tells which happened, nothing is timed).
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", pki["ca"]]
            + ["--tls-auth-clients", "no", "--requirepass", "pw-0123456789"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        log = []
        for line in proc.stdout:  # until it is ready, or it could not listen (then it exits: EOF)
            log.append(line)
            if "Ready to accept connections" in line:
                break
        else:
            proc.wait(10)
            continue
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # its later lines, never read
        break
    else:
        pytest.fail("redis-server found no TLS port to listen on:\n" + "".join(log))

    async def round_trip(url: str) -> bytes | None:
        store = open_store(url)
        try:
            await store.set("k", b"v", 60)
            return await store.get("k")
        finally:
            await store.close()

    try:
        good = f"rediss://:pw-0123456789@localhost:{port}/0?ssl_ca_certs={pki['ca']}"
        assert asyncio.run(round_trip(good)) == b"v"
        for bad in (
            f"rediss://:pw-0123456789@localhost:{port}/0?ssl_ca_certs={pki['rogue_ca']}",  # not our CA
            f"redis://:pw-0123456789@localhost:{port}/0",  # plaintext
            f"rediss://:wrong@localhost:{port}/0?ssl_ca_certs={pki['ca']}",  # the password still counts
        ):
            with pytest.raises(redis.exceptions.RedisError):  # connection, TLS or authentication error
                asyncio.run(round_trip(bad))
    finally:
        proc.terminate()
        proc.wait(10)
