"""Which CPUs a process runs on (Linux CPU lists such as ``1`` or ``0,2-3``).

A verifier's forward is the round's critical path: sharing its core with the other services'
threads makes a few forwards much slower (on two cores: p95 of a two-node forward 54.7 ms against
49.9 ms on a core of its own). ``RACER_CPUS`` confines a service; ``racer stack`` gives the
verifier CPUs of its own for its rounds (``placement``), and every CPU for its prefills.
"""

from __future__ import annotations

import os


def parse(spec: str) -> set[int]:
    """``"0,2-3"`` -> {0, 2, 3}; ValueError with the offending part otherwise."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"CPU list {spec!r}: {part!r} is not a CPU number or range") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {spec!r}: {part!r} is not a CPU number or range")
        cpus.update(range(first, last + 1))
    return cpus


def format_list(cpus) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def available() -> list[int]:
    """The CPUs this process may run on (all of them where affinity is not supported)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def confine(spec: str) -> None:
    """Runs this thread, and the threads it starts later, on the CPUs of ``spec`` (empty: no change)."""
    if not spec:
        return
    cpus = parse(spec)
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"CPU list {spec!r}: this platform cannot confine a process to CPUs")
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # none of them online and allowed here (a container's cpuset)
        raise ValueError(f"CPU list {spec!r}: none of these CPUs is available ({e.strerror})") from None
    missing = cpus - os.sched_getaffinity(0)  # the kernel keeps the ones it can
    if missing:
        raise ValueError(f"CPU list {spec!r}: CPUs {format_list(missing)} are not available")


def split_for_verifier(cpus: list[int]) -> tuple[list[int], list[int]] | None:
    """(the verifier's CPUs, everyone else's): the upper half for the verifier; None under two CPUs."""
    if len(cpus) < 2:
        return None
    k = max(1, len(cpus) // 2)
    return cpus[-k:], cpus[:-k]


def placement(split: tuple[list[int], list[int]], service: str) -> dict[str, str]:
    """The environment that places ``service`` on a machine ``split_for_verifier`` split: the drafter
    and the gateway on the others' CPUs; the verifier on every CPU, with its rounds' forwards (at
    most a draft tree's rows) on as many threads as it has CPUs of its own (``RACER_ROUND_THREADS``)
    and its prefills on all of them: the other services wait for a prefill's answer, while they
    work between a round's forwards. Measured on two cores (``racer bench-llama-cpp``): 20% more
    tok/s than a verifier confined to its own core, which prefilled long prompts on one thread. A
    lone stream's rounds take every CPU too (``verifier.native.lone_stream``): its drafter and
    gateway wait for each forward.

    A verifier with one CPU of its own (two or three CPUs in all) runs its rounds on every CPU as
    well: a batch of several sessions' trees on one thread is a compute-bound forward on half the
    machine, while the gateway and the drafter keep a core busy about a quarter of the time (both
    sampled while 8 sessions streamed). On two cores (``racer bench-batch --sessions 4,8
    --max-new-tokens 64 --budget auto``, alternated, two runs each): 4 sessions batched made 204-220
    tok/s with their rounds on one thread against 255-262 on both, 8 sessions 229-230 against 285-290."""
    mine, others = split
    if service != "verifier":
        return {"RACER_CPUS": format_list(others)}
    rounds = str(len(mine)) if len(mine) > 1 else "0"  # 0: every thread (``verifier.native.round_threads``)
    return {"RACER_CPUS": format_list(mine + others), "RACER_ROUND_THREADS": rounds}
