"""Routing moves a session only when its drafter goes away."""

from __future__ import annotations

import asyncio

from gateway.routing import Endpoints, parse_spec, rendezvous


def test_rendezvous_moves_only_the_sessions_of_a_removed_endpoint():
    eps = [f"10.0.0.{i}:50061" for i in range(1, 6)]
    keys = [f"session-{i}" for i in range(500)]
    before = {k: rendezvous(k, eps)[0] for k in keys}
    counts = {e: sum(1 for v in before.values() if v == e) for e in eps}
    assert min(counts.values()) > 500 / 5 * 0.6, counts  # spread, roughly even
    gone = eps[2]
    after = {k: rendezvous(k, [e for e in eps if e != gone])[0] for k in keys}
    for k in keys:
        if before[k] != gone:
            assert after[k] == before[k]
        else:
            assert after[k] == rendezvous(k, eps)[1]  # the next in its own ranking


def test_dns_endpoints_follow_a_changing_resolver():
    answers = [
        ["10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"],
        ["10.0.0.1:50061", "10.0.0.3:50061"],  # pod .2 went away
        ["10.0.0.1:50061", "10.0.0.3:50061", "10.0.0.4:50061"],
    ]  # pod .4 came
    calls = []

    def resolver(host, port):
        calls.append((host, port))
        return answers[min(len(calls) - 1, len(answers) - 1)]

    async def go():
        ep = Endpoints("dns:///racer-drafter.racer.svc.cluster.local:50061", resolve_every=0, resolver=resolver)
        keys = [f"s{i}" for i in range(300)]
        seen = []
        for _ in answers:
            await ep.refresh()
            seen.append({k: ep.ranked(k)[0] for k in keys})
        await ep.close()
        return keys, seen

    keys, (first, second, third) = asyncio.run(go())
    assert calls[0] == ("racer-drafter.racer.svc.cluster.local", 50061)
    moved = [k for k in keys if first[k] != second[k]]
    assert moved and all(first[k] == "10.0.0.2:50061" for k in moved)
    assert all(v != "10.0.0.2:50061" for v in second.values())
    # a new pod takes some sessions; every session that moves, moves to it
    moved = [k for k in keys if second[k] != third[k]]
    assert moved and all(third[k] == "10.0.0.4:50061" for k in moved)


def test_endpoint_specs():
    assert parse_spec("dns:///a.b:1") == ("a.b", 1, [])
    assert parse_spec("h1:1, h2:2") == (None, None, ["h1:1", "h2:2"])
    for bad in ("", "dns:///nohostport", "dns:///h:x"):
        try:
            parse_spec(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")
