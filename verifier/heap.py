"""The C heap under the verifier's tensors, accounted and given back when the verifier goes idle.

Tensors on the CPU come from ``malloc``. A tensor larger than glibc's mmap threshold is mapped on its
own and returns to the system when freed; smaller ones (a batch's activations, a short session's KV
cache, gRPC's and protobuf's buffers) come from malloc's arenas, one per thread that allocated
(the model thread, torch's OpenMP workers, gRPC's threads). Freed, they stay in the arena: the
process's resident size after a wave of sessions holds the wave's peak, not what is live.

``trim`` hands free arena pages back (``malloc_trim``: every arena, free pages inside them too),
and ``stats`` reads what the heap holds and how much of it is free (``mallinfo2``). The verifier
trims once it is idle after sessions ended (``racer.launch``), so memory after a wave returns to
what its live state needs; the gauges below show the split.

Elsewhere than glibc (musl, macOS) both are absent: ``stats`` is None and ``trim`` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

log = logging.getLogger("racer.verifier")

HEAP_BYTES = Gauge("racer_verifier_heap_bytes", "C heap (malloc arenas) held by the verifier process, in bytes")
HEAP_FREE_BYTES = Gauge(
    "racer_verifier_heap_free_bytes", "Of racer_verifier_heap_bytes, free chunks kept by malloc, in bytes"
)
HEAP_MAPPED_BYTES = Gauge("racer_verifier_heap_mapped_bytes", "Large allocations mapped on their own, in bytes")
TRIMS = Counter("racer_verifier_heap_trims", "Times free heap memory was handed back to the system")
TRIMMED_BYTES = Counter(
    "racer_verifier_heap_trimmed_bytes",
    "Resident bytes the trims handed back to the system (resident size before - after)",
)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):  # not glibc, or older than 2.33 (no mallinfo2)
        return None


_LIBC = _libc()


@dataclass(frozen=True)
class HeapStats:
    heap: int  # bytes in malloc's arenas (main arena's sbrk space and the others' mappings)
    free: int  # of which free chunks
    mapped: int  # bytes in allocations mapped on their own


def stats() -> HeapStats | None:
    if _LIBC is None:
        return None
    m = _LIBC.mallinfo2()
    return HeapStats(heap=m.arena, free=m.fordblks, mapped=m.hblkhd)


def export() -> HeapStats | None:
    """``stats`` into the gauges."""
    s = stats()
    if s is not None:
        HEAP_BYTES.set(s.heap)
        HEAP_FREE_BYTES.set(s.free)
        HEAP_MAPPED_BYTES.set(s.mapped)
    return s


def resident_bytes() -> int:
    """The process's resident set size, in bytes (Linux)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trim() -> int:
    """Hands free heap pages back to the system; the resident bytes that went (0 without glibc)."""
    if _LIBC is None:
        return 0
    t0 = time.perf_counter()
    before = resident_bytes()
    _LIBC.malloc_trim(0)
    returned = max(0, before - resident_bytes())
    export()
    TRIMS.inc()
    TRIMMED_BYTES.inc(returned)
    log.debug("heap trimmed", extra={"bytes": returned, "ms": round((time.perf_counter() - t0) * 1000, 2)})
    return returned
