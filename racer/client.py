"""Python client of the gateway's ``Generation`` API, for internal users.

with Client("localhost:50051", api_key="...") as c:
    for chunk in c.generate("Name three primary colors.", max_new_tokens=64):
        print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import os
import sys
from typing import Iterator

import grpc

from common.settings import PORTS
from common.tls import channel_credentials
from common.v1 import generation_pb2 as pb
from common.v1 import generation_pb2_grpc as pb_grpc


class Client:
    def __init__(
        self,
        target: str = f"localhost:{PORTS['gateway'][0]}",
        api_key: str | None = None,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self.channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout = timeout

    def generate(
        self,
        prompt: str | list[int] | list[dict] | None = None,
        *,
        session_id: str = "",
        max_new_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: tuple[str, ...] = (),
        stop_ids: tuple[int, ...] = (),
        mode: str = "",
        budget: int = 0,
        system: str = "",
        share: bool | None = None,
        request: pb.GenerateRequest | None = None,
    ) -> Iterator[pb.GenerateResponse]:
        """Streams responses; the last one has ``finish_reason``, ``usage`` and ``stats``.

        ``prompt``: text (one user message), token ids, or chat messages ``[{"role", "content"}]``.
        """
        if request is None:
            request = pb.GenerateRequest(
                session_id=session_id,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                stop=list(stop),
                stop_ids=list(stop_ids),
                system=system,
                speculation=pb.Speculation(mode=mode, budget=budget),
            )
            if seed is not None:
                request.seed = seed
            if share is not None:  # unset: the turn is added to the tenant corpus
                request.share = share
            if isinstance(prompt, str):
                request.prompt = prompt
            elif prompt and isinstance(prompt[0], dict):
                request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
            elif prompt is not None:
                request.prompt_ids.ids.extend(prompt)
        return self.stub.Generate(request, metadata=self.metadata, timeout=self.timeout)

    def complete(self, prompt, **kw) -> tuple[list[int], str, pb.GenerateResponse]:
        """The whole answer: (token ids, text, last response)."""
        ids: list[int] = []
        text = []
        last = None
        for r in self.generate(prompt, **kw):
            ids.extend(r.token_ids)
            text.append(r.text)
            last = r
        return ids, "".join(text), last

    def close_session(self, session_id: str) -> pb.SessionInfo:
        return self.stub.CloseSession(
            pb.SessionRef(session_id=session_id), metadata=self.metadata, timeout=self.timeout
        )

    def get_session(self, session_id: str) -> pb.SessionInfo:
        return self.stub.GetSession(pb.SessionRef(session_id=session_id), metadata=self.metadata, timeout=self.timeout)

    def list_sessions(self) -> list[pb.SessionInfo]:
        return list(
            self.stub.ListSessions(pb.ListSessionsRequest(), metadata=self.metadata, timeout=self.timeout).sessions
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_stats(last: pb.GenerateResponse) -> str:
    s, u = last.stats, last.usage
    return (
        f"[{last.finish_reason}] tokens={u.completion_tokens} rounds={s.rounds} MAT={s.mat:.2f} "
        f"drafted={s.drafted} accepted={s.accepted} tok/s={s.tokens_per_second:.1f} prefill={s.prefill_ms:.0f}ms "
        f"draft={s.draft_ms:.0f}ms verify={s.verify_ms:.0f}ms total={s.total_ms:.0f}ms session={last.session_id}"
    )


def main(args) -> int:
    """``racer client generate|chat|sessions|close``."""
    creds = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key, system_roots=bool(args.tls_cert))
    with Client(args.target, args.api_key or os.environ.get("RACER_API_KEY"), credentials=creds) as c:
        try:
            if args.action == "sessions":
                for s in c.list_sessions():
                    print(f"{s.session_id}\tturns={s.turns}\ttokens={s.tokens}")
                return 0
            if args.action == "close":
                s = c.close_session(args.session)
                print(f"closed {s.session_id} after {s.turns} turns")
                return 0
            session = args.session or ""
            turns = [args.prompt] if args.action == "generate" else None
            while True:
                text = turns.pop(0) if turns else _read_turn()
                if text is None:
                    return 0
                last = None
                for r in c.generate(
                    text,
                    session_id=session,
                    max_new_tokens=args.max_new_tokens,
                    mode=args.mode,
                    budget=args.budget,
                    temperature=args.temperature,
                    seed=args.seed,
                    system=args.system if not session else "",
                ):
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
                    last = r
                sys.stdout.write("\n")
                print(format_stats(last), file=sys.stderr)
                session = last.session_id
                if args.action == "generate":
                    return 0
        except grpc.RpcError as e:
            print(f"racer: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1


def _read_turn():
    try:
        line = input("> ")
    except EOFError:
        return None
    return line if line.strip() else _read_turn()
