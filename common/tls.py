"""TLS for the gRPC ports: server credentials from the common settings, the gateway's channel
credentials to drafters and verifiers, and the client's.

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
    return grpc.ssl_server_credentials([(_read(key, "--tls-key"), _read(cert, "--tls-cert"))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """None (plaintext) when no CA is configured; a client certificate is presented when given."""
    if not ca:
        if cert or key:
            raise ValueError("a client certificate for drafters and verifiers needs --tls-ca")
        return None
    if bool(cert) != bool(key):
        raise ValueError("--tls-client-cert and --tls-client-key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "--tls-ca"),
        private_key=_read(key, "--tls-client-key") if key else None,
        certificate_chain=_read(cert, "--tls-client-cert") if cert else None,
    )
