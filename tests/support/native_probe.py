"""``python -m tests.support.native_probe [--tokens N]``: what this process's native library is and
computes, as JSON on stdout, for tests that build it another way (``RACER_NATIVE_ISA``,
``RACER_NATIVE_FAULT``) in a process of its own: the build's ISA, the start-up check's verdicts, a
digest of the block kernel's outputs on fixed data per format (what every build must give bit for
bit), the same of the library's own packed kernel (bypassing the check's fallback), and with
``--tokens`` the bundled model's first N greedy tokens in ``--dtype gguf``. ``--amx-rows N``: block
kernel calls of N rows or more on AMX-INT8 tiles (``RACER_NATIVE_EMULATE=amx-int8`` where the CPU
has none), as the check allows it for the served outputs, and regardless for the library's own.)"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from verifier import native, native_check


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def quant_outputs(amx_rows: int = 0) -> dict[str, str]:
    """Per format, as stored and packed: a digest of ``native.quant_linear`` on fixed random data."""
    gen = torch.Generator().manual_seed(7)
    n, k = native_check.QUANT_SHAPE
    out = {}
    for fmt, (kind, *_) in native_check.FORMATS.items():
        w = native_check._blocks(fmt, n, k, gen)
        x = torch.randn((19, k), generator=gen)
        out[fmt] = _digest(native.quant_linear(x, kind, w, n, k))
        packed = native.quant_pack(kind, w, n, k)
        if packed is not None:
            out[f"{fmt} packed"] = _digest(native.quant_linear(x, packed[0], packed[1], n, k))
            y = torch.empty((19, n))
            lib = native.library()  # the library's own kernel, whatever the check said of it
            lib.racer_quant_amx_rows(amx_rows)
            lib.racer_quant_packed(packed[0], x.data_ptr(), packed[1].data_ptr(), None, y.data_ptr(), 19, n, k, 1, 1)
            native.quant_amx_rows(amx_rows)  # back to what the check allows
            out[f"{fmt} packed, unchecked"] = _digest(y)
    return out


def greedy_tokens(count: int) -> tuple[list[int], bool]:
    """The bundled model's first ``count`` tokens (mode off) in ``--dtype gguf``, and whether the
    native decoder ran them."""
    from common.loop import generate
    from common.params import GenerationParams
    from drafter.draft_session import DraftSession
    from verifier.engine import VerifierSession
    from verifier.model import load

    loaded = load("default", dtype="gguf")
    prompt = loaded.tokenizer("The three primary colors are")["input_ids"]
    v = VerifierSession(loaded.model, backend="llama")
    params = GenerationParams(max_new_tokens=count, mode="off")
    return [t for c in generate(DraftSession(), v, prompt, params) for t in c], v.backend.fused is not None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=0)
    ap.add_argument("--amx-rows", type=int, default=0)
    args = ap.parse_args()
    lib = native.library()
    if lib is None:
        raise SystemExit(f"no native library: {native.why()}")
    native.quant_amx_rows(args.amx_rows)
    checks = native.checks()
    report = {
        "level": native.isa_level(),
        "vector_bits": lib.racer_vector_bits(),
        "quant_isa": native.quant_isa(),
        "checks": {k: [v.ok, v.detail] for k, v in checks.items() if k != "seconds"},
        "amx_here": bool(lib.racer_quant_amx()),  # built, and the CPU runs it
        "amx": native.quant_amx(),  # and the check allowed it
        "outputs": quant_outputs(args.amx_rows),
    }
    if args.tokens:
        report["tokens"], report["fused"] = greedy_tokens(args.tokens)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
