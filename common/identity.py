"""Who may call a drafter or a verifier: only the gateways.

Drafters and verifiers hold every tenant's text and take the tenant and session id from the
caller, so they must not answer whoever can open a connection. Two ways to prove a caller is a
gateway, either enough on its own:

* **Mutual TLS** (``--tls-client-ca``): the TLS handshake refuses a client without a certificate
  signed by the cluster CA; nothing reaches a handler.
* **Internal token** (``--internal-token`` / ``--internal-token-file``, a Secret): every call carries
  it as ``racer-internal-token`` metadata, checked in constant time by ``PeerAuthInterceptor`` on
  every method but ``grpc.health.v1`` (probes carry no credentials and learn only SERVING or not).
  Several comma-separated tokens are all accepted and the gateway sends the first: a rotation adds
  the new token second everywhere, then first, then drops the old one, without a refused call.

A drafter or verifier with neither refuses to start unless ``--allow-unauthenticated`` says that
the network alone is trusted (``common.identity.require_peer_auth``).
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc
from prometheus_client import Counter

from .errors import Abort, Status

HEADER = "racer-internal-token"
_OPEN = ("/grpc.health.v1.Health/",)  # methods that need no credential: the probes'

REFUSED = Counter(
    "racer_internal_auth_failures",
    "calls to a drafter or verifier refused for a missing or wrong internal token",
    ["method"],
)


def load_tokens(token: str = "", path: str = "") -> tuple[str, ...]:
    """The accepted tokens (the first is the one to send): ``token`` and the file at ``path``, each a
    comma-separated list. A token shorter than 16 characters is refused: it could be guessed."""
    raw = token
    if path:
        try:
            raw = ",".join(x for x in (raw, Path(path).read_text()) if x)
        except OSError as e:
            raise ValueError(f"--internal-token-file {path!r}: {e.strerror or e}") from None
    tokens = tuple(t.strip() for t in raw.replace("\n", ",").split(",") if t.strip())
    for t in tokens:
        if len(t) < 16:
            raise ValueError("an internal token needs at least 16 characters (e.g. `openssl rand -hex 32`)")
        if not t.isascii() or not t.isprintable() or " " in t:
            raise ValueError("an internal token is printable ASCII without spaces")
    return tokens


def metadata(tokens: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """What a gateway sends with every call to a drafter or verifier (nothing without a token)."""
    return ((HEADER, tokens[0]),) if tokens else ()


def require_peer_auth(kind: str, tokens: tuple[str, ...], client_ca: str, allow_unauthenticated: bool) -> None:
    """A drafter or verifier starts only when its callers must prove who they are, or when the
    operator said explicitly that anyone who reaches the port may read and drop every session."""
    if not tokens and not client_ca and not allow_unauthenticated:
        raise ValueError(
            f"{kind}: no peer authentication: set --internal-token-file (RACER_INTERNAL_TOKEN_FILE) or "
            "RACER_INTERNAL_TOKEN to the gateways' shared token, or --tls-client-ca for mutual TLS; "
            "--allow-unauthenticated 1 serves anyone who can reach the port"
        )


def _valid(presented: str, tokens: tuple[str, ...]) -> bool:
    ok = False
    for t in tokens:  # every token compared, whatever matched: the time says nothing about which
        ok |= hmac.compare_digest(presented.encode(), t.encode())
    return ok


class PeerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without one of ``tokens`` in its ``racer-internal-token`` metadata with
    UNAUTHENTICATED, before the handler (and so before any session is touched or opened)."""

    def __init__(self, tokens: tuple[str, ...]):
        if not tokens:
            raise ValueError("PeerAuthInterceptor needs a token")
        self.tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(_OPEN):
            return handler
        presented = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == HEADER and isinstance(value, str):
                presented = value
        if _valid(presented, self.tokens):
            return handler
        REFUSED.labels(method).inc()
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))

        async def refuse(request, context):
            raise Abort(Status.UNAUTHENTICATED, f"{'missing' if not presented else 'wrong'} internal token ({HEADER})")

        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(
            refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
