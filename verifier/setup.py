"""What a verifier computes with, as it runs: the weights' dtype, the backend, the native kernels'
build and their start-up check (``Stats.setup``; a client or a test checks it instead of assuming it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import native


@dataclass(frozen=True)
class KernelCheck:
    kernel: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Setup:
    dtype: str  # float32, bfloat16, float16 or gguf
    backend: str  # llama or hf
    native_isa_level: str = ""  # RACER_NATIVE_ISA; "" where the library is not built
    native_quant_isa: str = ""
    native_vector_bits: int = 0
    kernel_checks: list[KernelCheck] = field(default_factory=list)
    kernel_check_seconds: float = 0.0


def of(model, backend: str) -> Setup:
    """The setup of a verifier serving ``model`` on ``backend`` ("auto" resolved as ``make_backend``
    resolves it). The native part only where the library was built (reading it builds nothing)."""
    from .llama import LlamaBackend

    if backend not in ("llama", "hf"):
        backend = "llama" if LlamaBackend.supports(model) else "hf"
    gguf = any(getattr(model, a, None) is not None for a in ("_racer_gguf_file", "_racer_gguf"))
    dtype = "gguf" if gguf else str(next(model.parameters()).dtype).replace("torch.", "")
    lib = native.loaded()
    if lib is None:
        return Setup(dtype, backend)
    checks = native.checks()
    seconds = float(checks.pop("seconds", 0.0))
    return Setup(
        dtype,
        backend,
        native.isa_level(),
        native.quant_isa(),
        int(lib.racer_vector_bits()),
        [KernelCheck(v.kernel, v.ok, v.detail) for v in checks.values()],
        seconds,
    )
