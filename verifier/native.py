"""Hand-written kernels for a few rows, built for this CPU: projections (``native_linear.c``; over GGUF
blocks, ``native_quant.c``) and invariant tree attention (``native_attention.c``).

A verification step multiplies 1 to 64 rows with each weight. Every BLAS at hand packs the weight
first, so with a handful of rows it reads the weight more than once and runs well below both the
memory bandwidth and the FMA peak. The kernels here stream each weight row once per call. They are
compiled at first use with the system's C compiler (``$CC``, else ``cc``) for the CPU they run on
(``-march=native``) and cached under ``cache_root()/native``, keyed by the source, the compiler and
the CPU. They are candidates like any other (``verifier/kernels.py``): they run only where the
tuner measured them fastest, and without a compiler (or with ``RACER_NATIVE=off``) they are simply
not offered.

Threads come from the library's own pool (``native_pool.c``): a forward holds it, so its workers
spin between the forward's few hundred parallel loops and sleep as soon as it ends, where an
OpenMP team would either spin on into the time the other services need the cores or sleep and be
woken between loops. OpenMP is still linked (the AMX attention's tiles); loaded into a process that
already holds torch's OpenMP runtime, the library binds to that runtime, and were a second OpenMP
runtime loaded the kernels are refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from .paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_linear.c")
ATTENTION_SOURCE = Path(__file__).with_name("native_attention.c")
LAYER_SOURCE = Path(__file__).with_name("native_layer.c")  # a whole decoder on the ones above
PANEL_SOURCE = Path(__file__).with_name("native_panel.c")  # projections over weights stored as panels
QUANT_SOURCE = Path(__file__).with_name("native_quant.c")  # projections over GGUF blocks read in place
SELECT_SOURCE = Path(__file__).with_name("native_select.c")  # each row's top-k ids of the logits
POOL_SOURCE = Path(__file__).with_name("native_pool.c")  # the kernels' threads
HEADERS = tuple(Path(__file__).with_name(h) for h in ("native_vec.h", "native_pool.h"))  # included by the sources
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-Wno-psabi")

# ``RACER_NATIVE_ISA``: the instructions the library may use, at most what the CPU has, so that one
# machine builds and tests the code another CPU would run (CONTRIBUTING.md, "The ISA matrix"). Each
# level leaves out what the ones before it have: "native" everything this CPU has; "no-vnni" no
# AVX512-VNNI or AVX-VNNI (the block kernel's AVX2 integer path beside AVX-512 floats); "avx2" no
# AVX-512 and no AMX; "sse" no AVX at all (the generic C and vector-extension code).
ISA_LEVELS = {
    "native": (),
    "no-vnni": ("-mno-avx512vnni", "-mno-avxvnni"),
    "avx2": ("-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
    "sse": ("-mno-avx", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
}
# ``RACER_NATIVE_FAULT``: comma-separated faults compiled into the library (tests only: a kernel that
# gives wrong values, which the start-up check must refuse). "packed": the packed block kernel's
# integer sums with the wrong sign; "amx": the same on its AMX-INT8 tiles alone.
FAULTS = {"packed": "-DRACER_FAULT_PACKED", "amx": "-DRACER_FAULT_AMX"}
# ``RACER_NATIVE_EMULATE``: instructions the CPU lacks, written in C into the library (tests only: the
# code of a path this machine cannot run, run here). "amx-int8": the block kernel's AMX-INT8 tiles.
EMULATE = {"amx-int8": "-DRACER_AMX_EMULATE"}

# The reference build (``reference_build()``): the block kernel's C code, for the baseline of the
# architecture, with vectorization off, so the compiler cannot turn a reference loop into other
# arithmetic (GCC 12 once made a signed-byte loop into vpdpbusd's unsigned-by-signed products). The
# start-up check (verifier/native_check.py) compares the library's kernels with it; a block kernel
# that disagrees is served from it.
REFERENCE_SOURCES = ("native_quant.c", "native_pool.c")
# Its thread pool is its own (native_pool.c built again): its workers are named apart from the
# library's, as ``top -H`` and /proc show them.
REFERENCE_FLAGS = (
    "-O2",
    "-fno-tree-vectorize",
    "-fno-tree-slp-vectorize",
    "-fPIC",
    "-shared",
    "-pthread",
    '-DRACER_POOL_NAME="racer-pool-ref"',
)


def isa_level() -> str:
    """``RACER_NATIVE_ISA`` (default "native"); ValueError naming the levels for another value."""
    level = os.environ.get("RACER_NATIVE_ISA", "native").strip().lower() or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"RACER_NATIVE_ISA={level!r}: one of {', '.join(ISA_LEVELS)}")
    return level


def build_flags() -> tuple[str, ...]:
    """The library's compiler flags: ``FLAGS``, the ISA level's, the faults asked for."""
    faults = [f.strip() for f in os.environ.get("RACER_NATIVE_FAULT", "").split(",") if f.strip()]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"RACER_NATIVE_FAULT: unknown {unknown} (one of {', '.join(FAULTS)})")
    emulated = [e.strip() for e in os.environ.get("RACER_NATIVE_EMULATE", "").split(",") if e.strip()]
    if unknown := sorted(set(emulated) - set(EMULATE)):
        raise ValueError(f"RACER_NATIVE_EMULATE: unknown {unknown} (one of {', '.join(EMULATE)})")
    options = [FAULTS[f] for f in sorted(set(faults))] + [EMULATE[e] for e in sorted(set(emulated))]
    return (*FLAGS, *ISA_LEVELS[isa_level()], *options)


def _reference_flags() -> tuple[str, ...]:
    import platform

    baseline = ("-march=x86-64",) if platform.machine().lower() in ("x86_64", "amd64") else ()
    return (*REFERENCE_FLAGS, *baseline)


# name -> (weight rows, x rows) per tile, and the vector width (bits) the shape is meant for: a
# 256-bit build has 16 vector registers (4x3 and 6x2 tiles fit), a 512-bit one 32 (6x4 and 8x3 fit).
VARIANTS = {
    "native4x3": ((4, 3), 256),
    "native6x2": ((6, 2), 256),
    "native6x4": ((6, 4), 512),
    "native8x3": ((8, 3), 512),
    "native6x4bf": ((6, 4), 512),  # bfloat16 pairs multiplied by the CPU (AVX512-BF16), bfloat16 only
    "native8x3bf": ((8, 3), 512),
}
PAIRS = {"native6x4bf", "native8x3bf"}

WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.RLock()  # re-entrant: the start-up check calls the kernels while the library is being made
_state: dict = {}  # "lib": the loaded library or None, once tried; "why": why not; "ref", "ref_why": the reference's
_checks: dict = {}  # kernel -> native_check.Verdict, once the library is checked; "seconds": how long it took


def sources() -> tuple[Path, ...]:
    """The C sources the library is built from (the headers aside)."""
    return (SOURCE, ATTENTION_SOURCE, PANEL_SOURCE, QUANT_SOURCE, LAYER_SOURCE, SELECT_SOURCE, POOL_SOURCE)


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _openmp_runtimes() -> set[str]:
    """Files of OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if len(line.split()) >= 6}
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {os.path.realpath(p) for p in paths if os.path.basename(p).startswith(names)}


def _build(cc: str, out: Path, flags: tuple[str, ...], files: tuple[Path, ...]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):  # e.g. an image's baked cache: the next place, not an error
        raise PermissionError(f"{out.parent} is not writable")
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    cmd = [cc, *flags, *map(str, files), "-o", str(tmp)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    tmp.replace(out)  # atomic: another process building the same key reads a whole file or none


def _built(name: str, flags: tuple[str, ...], files: tuple[Path, ...], machine: str) -> tuple[ctypes.CDLL | None, str]:
    """The library ``name`` built from ``files`` with ``flags`` (cached under a key of the sources,
    the compiler, the flags and the CPU) and loaded, or None and why not."""
    if not sys.platform.startswith("linux"):
        return None, "built on Linux only"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (set CC or install gcc)"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cc} --version failed: {e}"
    texts = (f.read_text() for f in (*files, *HEADERS))
    digest = hashlib.sha256(b"\0".join(x.encode() for x in (*texts, version, " ".join(flags), machine))).hexdigest()
    why = ""
    for where in (cache_root() / "native", Path(tempfile.gettempdir()) / f"racer-native-{os.getuid()}"):
        path = where / f"{name}-{digest[:20]}.so"
        try:
            if not path.exists():
                _build(cc, path, flags, files)
            return ctypes.CDLL(str(path)), ""
        except subprocess.CalledProcessError as e:
            return None, f"compiling {name} failed: {e.stderr.strip()[-500:]}"
        except (OSError, subprocess.SubprocessError) as e:  # an unwritable cache: the next place
            why = f"{path}: {e}"
    return None, why


def _load(machine: str) -> ctypes.CDLL | None:
    before = _openmp_runtimes()
    lib, _state["why"] = _built("linear", build_flags(), sources(), machine)
    if lib is None:
        return None
    after = _openmp_runtimes()
    if before and len(after) > len(before):
        _state["why"] = f"a second OpenMP runtime was loaded beside torch's ({sorted(after)})"
        return None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The library's entry points, typed."""
    lib.racer_vector_bits.restype = ctypes.c_int
    lib.racer_bf16_pairs.restype = ctypes.c_int
    lib.racer_linear.restype = ctypes.c_int
    lib.racer_linear.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    lib.racer_linear.argtypes += [ctypes.c_int]
    lib.racer_attention_block.restype = ctypes.c_int
    lib.racer_attention.restype = ctypes.c_int
    lib.racer_attention.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 5
    lib.racer_attention.argtypes += [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_float, ctypes.c_int]
    lib.racer_attention_capped.restype = ctypes.c_int
    lib.racer_attention_capped.argtypes = lib.racer_attention.argtypes[:-1] + [ctypes.c_float, ctypes.c_int]
    lib.racer_attention_amx.restype = ctypes.c_int
    lib.racer_attention_tiles.restype = ctypes.c_int
    lib.racer_attention_tiles.argtypes = lib.racer_attention.argtypes[1:]
    lib.racer_flush.restype = None
    lib.racer_flush.argtypes = [ctypes.c_void_p, ctypes.c_long]
    lib.racer_panel_width.restype = ctypes.c_int
    lib.racer_linear_panel.restype = ctypes.c_int
    lib.racer_linear_panel.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    _declare_quant(lib)
    lib.racer_top_rows.restype = ctypes.c_int
    lib.racer_top_rows.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_int]
    lib.racer_pool_hold.restype = None
    lib.racer_pool_hold.argtypes = [ctypes.c_int]
    lib.racer_pool_workers.restype = ctypes.c_int
    lib.racer_decoder_quant_from.restype = None
    lib.racer_decoder_quant_from.argtypes = [ctypes.c_void_p]
    lib.racer_decoder.restype = ctypes.c_int
    lib.racer_decoder.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_long]
    lib.racer_decoder.argtypes += [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 6


def _declare_quant(lib: ctypes.CDLL) -> None:
    """The block kernel's entry points (``native_quant.c``), typed: the library's and the reference's."""
    lib.racer_quant_supported.restype = ctypes.c_int
    lib.racer_quant_supported.argtypes = [ctypes.c_int]
    lib.racer_quant_isa.restype = ctypes.c_int
    lib.racer_quant_stream_rows.restype = None
    lib.racer_quant_stream_rows.argtypes = [ctypes.c_long]
    lib.racer_quant_amx.restype = ctypes.c_int
    lib.racer_quant_amx_rows.restype = None
    lib.racer_quant_amx_rows.argtypes = [ctypes.c_long]
    lib.racer_quant.restype = ctypes.c_int
    lib.racer_quant.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.racer_quant_rows.restype = ctypes.c_int
    lib.racer_quant_rows.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_void_p]
    lib.racer_quant_pack.restype = ctypes.c_int
    lib.racer_quant_pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    lib.racer_quant_packed_size.restype = ctypes.c_long
    lib.racer_quant_packed_size.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long]
    lib.racer_quant_packed.restype = ctypes.c_int
    lib.racer_quant_packed.argtypes = lib.racer_quant.argtypes + [ctypes.c_int]
    lib.racer_stream_read.restype = ctypes.c_uint64
    lib.racer_stream_read.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]


def library(machine: str = "") -> ctypes.CDLL | None:
    """The built library, checked, or None (``why()`` says why). ``machine`` (the CPU's identity) is
    part of the build's key: a cache directory shared by several machines holds one build per CPU.
    Before anyone else calls a kernel, each is checked against its reference on this machine
    (``verifier/native_check.py``); the ones that disagree are refused (``checks()``)."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load(machine)
            if _state["lib"] is None:
                log.info("native kernels not available: %s", _state.get("why"))
            else:
                _check(_state["lib"])
        return _state["lib"]


def _check(lib: ctypes.CDLL) -> None:
    from . import native_check

    verdicts, seconds = native_check.run(sys.modules[__name__], lib, reference_build())
    _checks.update({v.kernel: v for v in verdicts}, seconds=seconds)
    ref = reference_build()
    if _refused_any("quant") and ref is not None:  # the decoder's block products from the reference too
        lib.racer_decoder_quant_from(ctypes.cast(ref.racer_quant_many, ctypes.c_void_p))
    bad = [v for v in verdicts if not v.ok]
    for v in bad:
        log.warning(
            "native kernel refused: %s disagrees with its reference here (%s); another path serves", v.kernel, v.detail
        )
    summary = {"kernels": len(verdicts), "refused": len(bad), "ms": round(seconds * 1e3, 1)}
    log.info("native kernels checked", extra=summary)


def loaded() -> ctypes.CDLL | None:
    """The library if it was built and loaded already (builds nothing)."""
    return _state.get("lib")


def checks() -> dict:
    """The start-up check's verdicts, kernel name -> ``native_check.Verdict`` (empty before the
    library is built or where it is not), and "seconds": what the check took."""
    return dict(_checks)


def refused(kernel: str) -> bool:
    """Whether the start-up check refused ``kernel`` (a ``native_check`` name, e.g. "quant Q8_0 packed")."""
    v = _checks.get(kernel)
    return v is not None and not v.ok


def _refused_any(prefix: str) -> bool:
    return any(k.startswith(prefix) and not v.ok for k, v in _checks.items() if k != "seconds")


def reference_build() -> ctypes.CDLL | None:
    """The block kernel's reference build (``REFERENCE_SOURCES`` for the architecture's baseline,
    vectorization off): what the start-up check compares the block kernel with, and what serves a
    format whose kernel it refused. None where it cannot be built (``why_reference()``)."""
    with _lock:
        if "ref" not in _state:
            files = tuple(Path(__file__).with_name(f) for f in REFERENCE_SOURCES)
            ref, _state["ref_why"] = _built("reference", _reference_flags(), files, "")
            if ref is not None:
                _declare_quant(ref)
            _state["ref"] = ref
        return _state["ref"]


def why_reference() -> str | None:
    return None if _state.get("ref") is not None else _state.get("ref_why")


def source_digest() -> str:
    """Identifies the kernels' source and build: a choice measured on other kernels (another ISA
    level, another build) is measured again."""
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in (*sources(), *HEADERS)))
    digest.update(" ".join(build_flags()).encode())
    return digest.hexdigest()[:16]


def why_refused(part: str) -> str:
    """The start-up check's reasons for the refused kernels whose name contains ``part``."""
    return "; ".join(f"{k}: {v.detail}" for k, v in _checks.items() if k != "seconds" and part in k and not v.ok)


def why() -> str | None:
    """Why the library is not available (None when it is, or was not tried)."""
    return None if _state.get("lib") is not None else _state.get("why")


def usable(name: str, machine: str = "") -> bool:
    """Whether the variant ``name`` is built here and meant for this CPU's vector width (never with
    ``RACER_NATIVE=off``)."""
    if os.environ.get("RACER_NATIVE", "on").lower() in ("off", "0", "no", "false"):
        return False
    lib = library(machine)
    if lib is None or name not in VARIANTS or VARIANTS[name][1] != lib.racer_vector_bits() or not dtypes(name):
        return False
    return name not in PAIRS or bool(lib.racer_bf16_pairs())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtypes(name: str) -> tuple[torch.dtype, ...]:
    """The weight dtypes the variant ``name`` takes (less those the start-up check refused)."""
    kinds = (torch.bfloat16,) if name in PAIRS else tuple(WEIGHT_TYPES)
    return tuple(d for d in kinds if not refused(f"linear {name} {_dtype_name(d)}"))


def _operands(name: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kinds, pairs: bool = False):
    """A native kernel's operands: x (float32 unless ``pairs``), the bias float32, the output;
    TypeError for a weight it does not take (the tuner skips it), RuntimeError for mismatched shapes."""
    if w.dtype not in kinds or w.device.type != "cpu" or not w.is_contiguous() or x.dtype != w.dtype:
        names = ", ".join(str(d).replace("torch.", "") for d in kinds)
        raise TypeError(f"{name}: contiguous {names} CPU weights only")
    if refused(f"{'panel' if name == PANEL else f'linear {name}'} {_dtype_name(w.dtype)}"):
        raise TypeError(f"{name}: refused for {_dtype_name(w.dtype)} by the start-up check: {why_refused(name)}")
    half = w.dtype != torch.float32
    x = x.contiguous() if pairs or not half else x.float().contiguous()
    if b is not None:
        b = b.float().contiguous() if half else b.contiguous()
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or (b is not None and b.shape != (n,)):
        bias = None if b is None else tuple(b.shape)
        raise RuntimeError(f"{name}: x has {k} columns, the weight {tuple(w.shape)}, the bias {bias}")
    return x, b, torch.empty((m, n), dtype=torch.float32)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _library(name: str) -> ctypes.CDLL:
    lib = _state.get("lib")
    if lib is None:
        raise TypeError(f"{name}: native kernels not available: {why()}")
    return lib


def _kernel(name: str, kinds, prepare, call, pairs: bool = False):
    """A native kernel ``(x, w, b) -> y`` (in x's dtype) from ``prepare(lib, w)`` (checks the weight,
    returns the kernel's constants) and ``call(lib, constants, x, w, b, y)`` (the library call on
    checked operands). Its ``bare(x, w)`` is a call of the kernel alone on operands made ready once,
    as the native decoder makes it (the tuner times that: the checks and casts around a call cost
    about as much as a one-row kernel)."""

    def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        lib = _library(name)
        const = prepare(lib, w)
        x, b, y = _operands(name, x, w, b, kinds, pairs)
        call(lib, const, x, w, b, y)
        return y.to(w.dtype) if w.dtype != torch.float32 else y

    def bare(x: torch.Tensor, w: torch.Tensor):
        lib = _library(name)
        const = prepare(lib, w)
        x, b, y = _operands(name, x, w, None, kinds, pairs)
        return lambda: call(lib, const, x, w, b, y)

    run.__name__ = name
    run.bare = bare
    return run


def linear(name: str):
    """The variant ``name`` as a kernel ``(x [M, K], w [N, K], b [N] or None) -> [M, N]`` on a CPU,
    ``w`` stored as rows (contiguous) in float32, bfloat16 or float16 (read at that width, every
    product and sum in float32, the result rounded once to ``x``'s dtype); anything else raises
    TypeError (the tuner skips it)."""
    nr, mr = VARIANTS[name][0]
    pairs = name in PAIRS

    def prepare(lib, w: torch.Tensor) -> int:
        return 3 if pairs else WEIGHT_TYPES.get(w.dtype, -1)

    def call(lib, kind: int, x, w, b, y) -> None:
        m, k = x.shape
        rc = lib.racer_linear(
            nr, mr, kind, x.data_ptr(), w.data_ptr(), _ptr(b), y.data_ptr(), m, y.shape[1], k, threads(m)
        )
        if rc:
            raise RuntimeError(f"{name}: the built library has no {nr}x{mr} tile")

    return _kernel(name, dtypes(name), prepare, call, pairs)


# Calls of at most this many rows (a session's draft tree of up to 64 nodes) run on the round
# threads; larger ones, prefills and wide batches of trees, use every thread.
ROUND_ROWS = 64
_round = {"threads": 0}
_lone = threading.local()  # .on: this thread's calls are a lone stream's round (``lone_stream``)


def round_threads(n: int) -> None:
    """Native calls of at most ``ROUND_ROWS`` rows run on ``n`` threads (at most torch's count), larger
    ones on torch's count; 0: torch's for every call. ``racer stack`` sets it (``RACER_ROUND_THREADS``)
    where its verifier's rounds have CPUs of their own and its prefills every CPU
    (``common.cpus.placement``). A row's bits do not depend on the thread count."""
    _round["threads"] = max(0, int(n))


@contextlib.contextmanager
def lone_stream():
    """Native calls on this thread, inside, run on torch's whole count whatever ``round_threads``
    says: the round of the only stream a verifier serves, whose drafter and gateway wait for its
    result, so the CPUs they work on are idle while it runs. With several streams they work for the
    others during a forward, and rounds keep the verifier's own CPUs."""
    _lone.on = True
    try:
        yield
    finally:
        _lone.on = False


def threads(rows: int) -> int:
    """Threads of a native call over ``rows`` rows (``round_threads``, ``lone_stream``)."""
    every, n = torch.get_num_threads(), _round["threads"]
    if getattr(_lone, "on", False):
        return every
    return min(n, every) if n and rows <= ROUND_ROWS else every


def top_rows(logits: torch.Tensor, k: int) -> torch.Tensor | None:
    """Each row's ``k`` largest entries' ids [n, k] int64, largest first, equal values by position (so
    column 0 is ``torch.argmax``'s choice, NaN included), from ``native_select.c``: one pass a row
    instead of torch's sort. None where it does not apply (no library, ``RACER_NATIVE=off``, not a
    float32 CPU matrix, ``k`` outside [1, columns]); the caller then asks torch."""
    lib = None if _off() or refused("top_rows") else library()
    if lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        return None
    n, v = logits.shape
    if not 1 <= k <= min(v, 4096):
        return None
    x = logits.contiguous()
    ids = torch.empty((n, k), dtype=torch.int64)
    if n and lib.racer_top_rows(x.data_ptr(), n, v, k, ids.data_ptr(), threads(n)):
        return None
    return ids


def flush(t: torch.Tensor) -> None:
    """Drops a CPU tensor's memory from the caches (written back first), where the library is built
    and the CPU can: its next read comes from memory."""
    lib = _state.get("lib")
    if lib is not None and t.device.type == "cpu":
        lib.racer_flush(t.data_ptr(), t.numel() * t.element_size())  # contiguous, or a transposed view of such


PANEL = "panel"  # the broadcast GEMM over a weight stored as panels (native_panel.c, layouts "panel")


def panel_width() -> int:
    """The panel kernel's panel width (output columns per panel), or 0 where it is not available."""
    lib = None if _off() else library()
    return lib.racer_panel_width() if lib is not None else 0


def _panel_prepare(lib, w: torch.Tensor) -> int:
    width = panel_width()
    if not width:
        raise TypeError(f"{PANEL}: native kernels not available: {why()}")
    if refused(f"panel {_dtype_name(w.dtype)}"):
        raise TypeError(f"{PANEL}: refused for {_dtype_name(w.dtype)} by the start-up check: {why_refused('panel')}")
    if w.shape[0] % width:
        raise TypeError(f"{PANEL}: {w.shape[0]} output rows are not a whole number of {width}-wide panels")
    return WEIGHT_TYPES.get(w.dtype, -1)


def _panel_call(lib, kind: int, x, w, b, y) -> None:
    m, k = x.shape
    args = (x.data_ptr(), w.data_ptr(), _ptr(b), y.data_ptr(), m, y.shape[1], k, threads(m))
    lib.racer_linear_panel(kind, *args)


# ``x @ W.T (+ b)`` on a CPU for a bfloat16 or float16 weight stored as panels (``layouts.stored_as(w)
# == "panel"``: the caller's promise, as a row tile's is that w holds rows); every product and sum in
# float32, each output one FMA chain over K in order, the result rounded once to x's dtype.
# TypeError for anything else (the tuner skips it).
linear_panel = _kernel(PANEL, (torch.bfloat16, torch.float16), _panel_prepare, _panel_call)


# -- weights kept as a GGUF file's blocks (native_quant.c) ------------------------------------------


_QUANT_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def _quant_lib(kind: int) -> ctypes.CDLL | None:
    """What serves GGML type ``kind`` (a packed one's number included): the library, or where the
    start-up check refused its kernel the reference build (the same bits by construction, slower).
    None without either."""
    lib = library()
    if lib is None:
        return None
    name = f"quant {_QUANT_NAMES.get(kind % PACKED, kind)}{' packed' if kind > PACKED else ''}"
    return reference_build() if refused(name) else lib


def quant_supported(kind: int) -> bool:
    """Whether the block kernel takes GGML type number ``kind`` here (built, not switched off)."""
    lib = None if _off() else _quant_lib(int(kind))
    return lib is not None and bool(lib.racer_quant_supported(int(kind)))


def quant_isa() -> str:
    """The integer instructions the block kernel was built with (all give the same bits)."""
    lib = library()
    return {2: "avx512-vnni", 1: "avx-vnni", 0: "avx2", -1: "generic"}[lib.racer_quant_isa()] if lib else "none"


def quant_amx() -> bool:
    """Whether the block kernel can multiply on AMX-INT8 tiles here: built with them (or with them
    emulated, ``RACER_NATIVE_EMULATE``), the CPU has them, Linux lets the process use them, and the
    start-up check found the tiles' bits equal to the reference build's."""
    lib = library()
    if lib is None or not lib.racer_quant_amx():
        return False
    tiles = [v for k, v in _checks.items() if k.startswith("amx quant")]
    return bool(tiles) and all(v.ok for v in tiles)


def quant_amx_rows(rows: int) -> None:
    """Packed-block calls of at least ``rows`` rows multiply pairs of groups on AMX-INT8 tiles (0:
    none; nothing where ``quant_amx`` says no). The same values either way."""
    lib = library()
    if lib is not None:
        lib.racer_quant_amx_rows(int(rows) if quant_amx() else 0)


def quant_stream_rows(rows: int) -> None:
    """Packed-block calls of at most ``rows`` rows hand out their weight in long runs (streaming),
    larger ones in runs of 4 groups (0: every call). The same values either way."""
    lib = library()
    if lib is not None:
        lib.racer_quant_stream_rows(int(rows))


# A packed weight's type number: its GGML number + PACKED (``quant_pack``).
PACKED = 256


def quant_pack(kind: int, blocks: torch.Tensor, n: int, k: int) -> tuple[int, torch.Tensor] | None:
    """A weight's blocks (uint8 [n, row bytes], as the file stores them; Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0, Q4_K, Q5_K or Q6_K) moved into groups of 8 rows (``native_quant.c``: the same bytes, nothing
    widened; a K-quant's 6-bit scales unpacked to a byte each), which the block kernel reads 8 rows a
    vector at a time: ``(packed type number, bytes)``, or None where the kernel does not pack this
    format or shape (then the rows are read as stored)."""
    lib = None if _off() else _quant_lib(int(kind) + PACKED)
    if lib is None or n % 8 or not lib.racer_quant_supported(int(kind) + PACKED):
        return None
    size = lib.racer_quant_packed_size(int(kind), n, k)
    if size < 0:
        return None
    blocks = blocks.contiguous()
    out = torch.empty(size, dtype=torch.uint8).view(n // 8, -1)
    if lib.racer_quant_pack(int(kind), blocks.data_ptr(), n, k, out.data_ptr()):
        return None
    return int(kind) + PACKED, out


def quant_linear(
    x: torch.Tensor, kind: int, blocks: torch.Tensor, n: int, k: int, b=None, reference: bool = False
) -> torch.Tensor:
    """``x @ W.T (+ b)`` [M, n] float32 for W [n, k] stored as GGML type ``kind``'s blocks ``blocks``
    (uint8, contiguous: [n, row bytes] as the file stores them, or packed, ``quant_pack``): x
    quantized per row to 8 bits a value in blocks of 32 and multiplied as integers, each output the
    same float32 steps in a fixed order (row invariant). ``reference``: a packed weight by the C
    code instead of the vector code (the same bits): the reference build's (``reference_build()``)."""
    lib = (reference_build() if reference else _quant_lib(int(kind))) or _library("quant")
    x = x.float().contiguous()
    if x.shape[1] != k or blocks.dtype != torch.uint8 or not blocks.is_contiguous():
        raise RuntimeError(f"quant: x {tuple(x.shape)} against blocks {tuple(blocks.shape)} of a [{n}, {k}] weight")
    if blocks.shape[0] != (n // 8 if kind > PACKED else n):
        raise RuntimeError(f"quant: blocks {tuple(blocks.shape)} are not a [{n}, {k}] weight of type {kind}")
    bias = None if b is None else b.float().contiguous()
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    args = (x.data_ptr(), blocks.data_ptr(), _ptr(bias), y.data_ptr(), x.shape[0], n, k, threads(x.shape[0]))
    if kind > PACKED:
        rc = lib.racer_quant_packed(int(kind), *args, 0 if reference else 1)
    else:
        rc = lib.racer_quant(int(kind), *args)
    if rc:
        raise TypeError(f"quant: GGML type {kind} over {k} columns is not taken ({rc})")
    return y


def quant_rows(kind: int, blocks: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``ids`` of a weight kept as blocks (as stored or packed), as the file's values in
    float32 ([len(ids), k])."""
    lib = _quant_lib(int(kind)) or _library("quant")
    ids = ids.to(torch.int64).contiguous().view(-1)
    out = torch.empty((ids.shape[0], k), dtype=torch.float32)
    if lib.racer_quant_rows(int(kind), blocks.data_ptr(), ids.data_ptr(), ids.shape[0], k, out.data_ptr()):
        raise TypeError(f"quant: GGML type {kind} over {k} columns is not taken")
    return out


_ATTENTION_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# How a block's products are made: "amx" (bfloat16 caches, AMX tiles, where the CPU has them and Linux
# lets the process use them) or "vector" (float32 vector arithmetic, any dtype, any CPU). The two
# give different bits, so a process picks one per cache dtype and head shape and keeps it
# (``attention_path``): a tree node and a one-token step must make the same computation.
PATHS = ("amx", "vector")
_paths_chosen: dict = {}


def _off() -> bool:
    return os.environ.get("RACER_NATIVE", "on").lower() in ("off", "0", "no", "false")


def attention_usable(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether ``attention`` runs here for a cache of ``dtype`` (CPU, built library, not switched
    off with ``RACER_NATIVE=off``, heads a whole number of vectors of at most 256)."""
    if _off() or device.type != "cpu" or dtype not in _ATTENTION_TYPES:
        return False
    lib = library()
    if lib is None or head_dim > 256 or head_dim % (lib.racer_vector_bits() // 32):
        return False
    return not refused(f"attention vector {_dtype_name(dtype)}")


def attention_paths(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, checked: bool = True
) -> tuple[str, ...]:
    """The paths that run here for this cache dtype and head shape (``attention_usable`` first), less
    those the start-up check refused (``checked=False``: all of them, for the check itself)."""
    lib = library()
    if lib is None:
        return ()
    if checked:
        paths = attention_paths(dtype, heads, kv_heads, head_dim, checked=False)
        return tuple(p for p in paths if not refused(f"attention {p} {_dtype_name(dtype)}"))
    amx = (
        dtype == torch.bfloat16
        and head_dim % 32 == 0
        and heads % kv_heads == 0
        and heads // kv_heads <= 16
        and bool(lib.racer_attention_amx())
    )
    return ("amx", "vector") if amx else ("vector",)


def attention_path(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str:
    """The path this process uses for this cache dtype and head shape, picked once: the one named by
    ``RACER_ATTENTION`` (amx or vector) where it runs, else the faster here of those that run,
    measured on a one-token step and a 16-row chain at 512 keys (both shapes a verifier runs all the
    time), median of 5 interleaved calls each."""
    key = (dtype, heads, kv_heads, head_dim)
    with _lock:
        if key in _paths_chosen:
            return _paths_chosen[key]
    paths = attention_paths(dtype, heads, kv_heads, head_dim)
    if not paths:
        raise TypeError(f"native attention not available: {why()}")
    wanted = os.environ.get("RACER_ATTENTION", "").lower()
    if wanted in paths:
        chosen = wanted
    elif len(paths) == 1:
        chosen = paths[0]
    else:
        chosen = _fastest(paths, dtype, heads, kv_heads, head_dim)
    log.info("native attention for %s, %d heads over %d of %d: %s", dtype, heads, kv_heads, head_dim, chosen)
    with _lock:
        return _paths_chosen.setdefault(key, chosen)


def _fastest(paths, dtype, heads: int, kv_heads: int, head_dim: int) -> str:
    gen = torch.Generator().manual_seed(0)
    past = 512
    kv = torch.randn((2, kv_heads, past + 16, head_dim), generator=gen).to(dtype)
    cases = []
    for n in (1, 16):
        counts = torch.arange(past + 1, past + n + 1, dtype=torch.long)
        q = torch.randn((n, heads, head_dim), generator=gen).to(dtype)
        cases.append((q, counts, counts.clone(), torch.zeros((n, 0), dtype=torch.long)))
    times: dict = {p: [[] for _ in cases] for p in paths}
    for rep in range(6):
        for i, (q, counts, inplace, tail) in enumerate(cases):
            for p in paths:
                t0 = time.perf_counter()
                attention(q, kv, counts, inplace, tail, head_dim**-0.5, path=p)
                if rep:  # the first call of each warms caches and threads
                    times[p][i].append(time.perf_counter() - t0)
    cost = {p: sum(statistics.median(t) for t in times[p]) for p in paths}
    return min(paths, key=lambda p: cost[p])


def attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    counts: torch.Tensor,
    inplace: torch.Tensor,
    tail: torch.Tensor,
    scale: float,
    path: str | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Invariant attention (``native_attention.c``) of query rows over one layer's cache, in place.

    q [n, H, D]; kv [2, kv_heads, capacity, D] (contiguous); counts, inplace [n] int64: keys row r
    sees, and how many of them are cache rows 0, 1, ...; tail [n, T] int64: the cache rows of its
    other keys in position order. ``path``: "amx" or "vector"; None: this process's choice
    (``attention_path``). ``softcap``: each scaled score s taken as softcap * tanh(s / softcap)
    (Gemma 2's; the vector path only). Returns [n, H, D] in q's dtype."""
    lib = library()
    if lib is None:
        raise TypeError(f"native attention not available: {why()}")
    n, h, d = q.shape
    if kv.dtype not in _ATTENTION_TYPES or not kv.is_contiguous() or kv.device.type != "cpu":
        raise TypeError("native attention: a contiguous float32, bfloat16 or float16 CPU cache only")
    path = path or attention_path(kv.dtype, h, kv.shape[1], d)
    if path not in attention_paths(kv.dtype, h, kv.shape[1], d):
        raise TypeError(f"native attention: no {path} path here for {kv.dtype}, {h} heads over {kv.shape[1]} of {d}")
    if softcap and path != "vector":
        raise TypeError(f"native attention: soft-capped scores on the vector path only, not {path}")
    out = torch.empty((n, h, d), dtype=torch.float32)
    rest = (
        out.data_ptr(),
        n,
        h,
        kv.shape[1],
        d,
        kv.shape[2],
        counts.data_ptr(),
        inplace.data_ptr(),
        tail.data_ptr(),
        tail.shape[1],
        scale,
        torch.get_num_threads(),
    )
    if path == "amx":
        qb = q.to(torch.bfloat16).contiguous()
        rc = lib.racer_attention_tiles(qb.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), *rest)
    else:
        q32 = q.float().contiguous()
        args = (_ATTENTION_TYPES[kv.dtype], q32.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), *rest)
        if softcap:
            rc = lib.racer_attention_capped(*args[:-1], softcap, args[-1])
        else:
            rc = lib.racer_attention(*args)
    if rc:
        raise RuntimeError(f"native attention ({path}): {h} heads over {kv.shape[1]} kv heads of {d} not supported")
    return out.to(q.dtype)


# -- a whole decoder in one call (native_layer.c) ---------------------------------------------------

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Shape(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "weight_type", "cache_type", "threads")
    ] + [
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("act", ctypes.c_int64),
        ("softcap", ctypes.c_float),
        ("rot_dim", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("w", ctypes.c_void_p * len(PROJECTIONS)),
        ("bias", ctypes.c_void_p * len(PROJECTIONS)),
        ("tile", (ctypes.c_int64 * 2) * len(PROJECTIONS)),
        ("qtype", ctypes.c_int64 * len(PROJECTIONS)),
        ("qnorm", ctypes.c_void_p),
        ("knorm", ctypes.c_void_p),
        ("post_attn", ctypes.c_void_p),
        ("post_ffn", ctypes.c_void_p),
        ("windowed", ctypes.c_int64),
        ("rope", ctypes.c_int64),
    ]


class _Segment(ctypes.Structure):
    _fields_ = [
        (
            name,
            ctypes.c_int64 if name in ("r0", "r1", "capacity", "past") or name.endswith("width") else ctypes.c_void_p,
        )
        for name in ("r0", "r1", "cache", "capacity", "past", "counts", "inplace", "tail", "tail_width")
        + ("wcounts", "winplace", "wtail", "wtail_width")
    ]


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()


class Decoder:
    """Every decoder layer of a Llama-family model in one native call (``native_layer.c``).

    ``layers``: per layer ``(input norm weight, post-attention norm weight, {projection: module})``
    with the modules of ``PROJECTIONS`` (a ``weight`` stored as rows, a ``bias`` or None), and
    optionally a dict of: ``qnorm``, ``knorm`` the weights of per-head q and k RMSNorms taken before the
    rotation (Qwen3's, Gemma 3's); ``post_attn``, ``post_ffn`` those of RMSNorms of the attention's and
    the MLP's outputs (Gemma 3's; its MLP's input norm is then the second weight); ``windowed`` 1 for a
    layer attending over its segments' sliding-window keys; ``rope`` 1 for one taking the second
    rotary table; ``act``: the MLP's activation, 0 SiLU, 1 GELU's tanh approximation; ``softcap``: the
    attention scores' soft cap (Gemma 2's; None: none); ``rot_dim``: the rotated dims of each head
    (None: all; fewer for Phi-3's partial rotary factor, the call's rotary tables that wide);
    ``tiles``: per projection the native variant its shape runs (row-invariant, not ``PAIRS``), or
    ``PANEL`` for a weight stored as panels;
    ``final_norm``: the last norm's weight. Norms and biases are kept as float32 copies; the
    weights are read in place (they must stay where they are). A module holding ``racer_blocks``
    (a GGUF file's blocks, ``verifier/gguf_blocks.py``) is read from them by the block kernel; the
    others of such a model are float32, on their native tile."""

    def __init__(
        self,
        layers,
        tiles: dict[str, str],
        final_norm,
        dims: dict,
        eps: float,
        scale: float,
        act: int = 0,
        softcap: float | None = None,
        rot_dim: int | None = None,
    ):
        lib = library()
        if lib is None:
            raise TypeError(f"native decoder not available: {why()}")
        if any(_refused_any(kind) for kind in ("linear", "panel", "attention")):  # refused blocks: the reference's
            raise TypeError(f"native decoder: it calls kernels the start-up check refused ({why_refused('')})")
        weights = [spec[2][p].weight for spec in layers for p in PROJECTIONS]
        blocks = [getattr(spec[2][p], "racer_blocks", None) for spec in layers for p in PROJECTIONS]
        dtype = weights[0].dtype
        if any(b is not None for b in blocks):
            weights = [w for w, b in zip(weights, blocks) if b is None] + [b.data for b in blocks if b is not None]
            if any(w.dtype not in (torch.float32, torch.uint8) or not w.is_contiguous() for w in weights):
                raise TypeError("native decoder: GGUF blocks beside contiguous float32 weights only")
            dtype = torch.float32
        elif dtype not in (torch.bfloat16, torch.float16) or any(
            w.dtype != dtype or not w.is_contiguous() or w.device.type != "cpu" for w in weights
        ):
            raise TypeError("native decoder: contiguous bfloat16 or float16 CPU weights of one dtype only")
        if any(tiles[p] != PANEL and (tiles[p] not in VARIANTS or tiles[p] in PAIRS) for p in PROJECTIONS):
            raise TypeError(f"native decoder: no widening native tile among {tiles}")
        self.lib, self.dtype = lib, dtype
        self.shape = _Shape(
            **dims,
            weight_type=WEIGHT_TYPES[dtype],
            cache_type=0,
            threads=1,
            eps=eps,
            scale=scale,
            act=act,
            softcap=softcap or 0.0,
            rot_dim=rot_dim or dims["head_dim"],
        )
        self._keep = [final_norm, *weights]  # every tensor a pointer below refers to stays alive
        self._norm = self._held(_f32(final_norm))
        self.layers = (_Layer * len(layers))(
            *[self._layer(*spec[:3], tiles, **(spec[3] if len(spec) > 3 else {})) for spec in layers]
        )

    def _held(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self._keep.append(t)
        return t.data_ptr()

    def _layer(
        self, norm1, norm2, mods, tiles, qnorm=None, knorm=None, post_attn=None, post_ffn=None, windowed=0, rope=0
    ) -> _Layer:
        layer = _Layer(norm1=self._held(_f32(norm1)), norm2=self._held(_f32(norm2)), windowed=windowed, rope=rope)
        layer.qnorm, layer.knorm = self._held(_f32(qnorm)), self._held(_f32(knorm))
        layer.post_attn, layer.post_ffn = self._held(_f32(post_attn)), self._held(_f32(post_ffn))
        for j, p in enumerate(PROJECTIONS):
            layer.w[j] = mods[p].weight.data_ptr()
            layer.bias[j] = self._held(_f32(mods[p].bias))
            layer.tile[j][0], layer.tile[j][1] = (0, 0) if tiles[p] == PANEL else VARIANTS[tiles[p]][0]
            blocks = getattr(mods[p], "racer_blocks", None)
            if blocks is not None:
                layer.w[j] = blocks.data.data_ptr()
                layer.qtype[j] = blocks.kind
        return layer

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments, cos2=None, sin2=None
    ) -> torch.Tensor:
        """x [n, hidden] float32 (the embedded rows; overwritten with the residual stream), cos/sin
        [n, rot_dim] float32 (contiguous); ``segments``: per session ``(first row, end row, cache [layers, 2,
        kv_heads, capacity, head_dim] contiguous, past length, counts, inplace, tail)`` (``attention``'s
        row keys), then optionally the keys its rows see in a sliding-window layer (the same three);
        cos2/sin2 the second rotary table's rows. Writes each segment's new K/V rows at [past, past +
        rows) of every layer. Returns
        the final-normed hidden states [n, hidden] float32."""
        segs = (_Segment * len(segments))()
        shape = _Shape.from_buffer_copy(self.shape)  # this call's: one decoder serves every session, any thread
        for seg, (r0, r1, cache, past, counts, inplace, tail, *window) in zip(segs, segments):
            if cache.dtype not in _ATTENTION_TYPES or not cache.is_contiguous():
                raise TypeError("native decoder: a contiguous float32, bfloat16 or float16 cache only")
            shape.cache_type = _ATTENTION_TYPES[cache.dtype]
            seg.r0, seg.r1, seg.cache, seg.capacity, seg.past = r0, r1, cache.data_ptr(), cache.shape[3], past
            seg.counts, seg.inplace, seg.tail = counts.data_ptr(), inplace.data_ptr(), tail.data_ptr()
            seg.tail_width = tail.shape[1]
            wcounts, winplace, wtail = window or (counts, inplace, tail)  # a layer's sliding-window keys
            seg.wcounts, seg.winplace, seg.wtail = wcounts.data_ptr(), winplace.data_ptr(), wtail.data_ptr()
            seg.wtail_width = wtail.shape[1]
        n = x.shape[0]
        for t in (cos, sin, cos2, sin2):
            if t is not None and (tuple(t.shape) != (n, shape.rot_dim) or t.dtype != torch.float32):
                want = f"({n}, {shape.rot_dim}) float32"
                raise TypeError(f"native decoder: rotary values {tuple(t.shape)} {t.dtype}, expected {want}")
        shape.threads = threads(n)
        out = torch.empty_like(x)
        rc = self.lib.racer_decoder(
            ctypes.byref(shape), self.layers, len(self.layers), segs, len(segs), x.data_ptr(), n,
            cos.data_ptr(), sin.data_ptr(), self._norm, out.data_ptr(),
            (cos if cos2 is None else cos2).data_ptr(), (sin if sin2 is None else sin2).data_ptr(),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"native decoder failed ({rc})")
        return out
