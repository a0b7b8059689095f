"""TLS for the gRPC ports: server credentials from the common settings, and channel credentials
for the gateway's channels to drafters and verifiers, the clients and ``racer health``.

Each service serves TLS only when it has a certificate and key (``--tls-cert``/``--tls-key``); with
``--tls-client-ca`` it also requires client certificates signed by that CA (mutual TLS). The gateway
talks TLS to drafters and verifiers when ``--tls-ca`` names the CA that signed their certificates,
presenting ``--tls-client-cert`` when they require one.
"""

from __future__ import annotations

from pathlib import Path

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {path!r}: {e.strerror or e}") from None


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials | None:
    """None (plaintext) when no certificate is configured."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    ca = _read(client_ca, "--tls-client-ca") if client_ca else None
    return grpc.ssl_server_credentials(
        [(_read(key, "--tls-key"), _read(cert, "--tls-cert"))], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(
    ca: str, cert: str = "", key: str = "", *, system_roots: bool = False
) -> grpc.ChannelCredentials | None:
    """TLS to a server whose certificate ``ca`` signed; without a CA, plaintext (None), or with
    ``system_roots`` the system's CAs (a client of a gateway behind a public certificate). ``cert``
    and ``key`` are this side's certificate, for servers that require one (mutual TLS)."""
    if not ca and not system_roots:
        if cert or key:
            raise ValueError("a client certificate needs --tls-ca")
        return None
    if bool(cert) != bool(key):
        raise ValueError("a client certificate and its key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "--tls-ca") if ca else None,
        private_key=_read(key, "client key") if key else None,
        certificate_chain=_read(cert, "client certificate") if cert else None,
    )
