"""The native kernels' start-up check (verifier/native_check.py) and the ISA matrix (RACER_NATIVE_ISA).

Every kernel the library offers is compared with its reference on the machine at hand before first
use; one that disagrees is refused and its calls take a path that agrees. The negative control is a
real build with a wrong sign compiled in (``RACER_NATIVE_FAULT=packed``), in a process of its own;
the ISA levels are real builds too, each in its own process (``tests/support/native_probe.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from verifier import native, native_check

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernels not built: {native.why()}")


def _probe(*args: str, **env: str) -> dict:
    """``tests.support.native_probe`` in a process of its own, with ``env`` added."""
    return _probes((args, env))[0]


def _probes(*runs: tuple[tuple[str, ...], dict]) -> list[dict]:
    """Several probes (``(args, env)`` each) in processes of their own, side by side; their reports
    in order. The same run asked again (this module's plain one) is answered from the first."""
    todo = [run for run in dict.fromkeys(_key(r) for r in runs) if run not in _REPORTS]
    procs = {
        run: subprocess.Popen(
            [sys.executable, "-m", "tests.support.native_probe", *run[0]],
            env=dict(os.environ, **dict(run[1])),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run in todo
    }
    for run, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        _REPORTS[run] = json.loads(out)
    return [_REPORTS[_key(r)] for r in runs]


def _key(run: tuple[tuple[str, ...], dict]) -> tuple:
    return tuple(run[0]), tuple(sorted(run[1].items()))


_REPORTS: dict = {}


def _expected_kernels(lib) -> set[str]:
    """What the library offers here, named as the check names them."""
    names = {f"quant {f}" for f in native_check.FORMATS} | {f"quant {f} packed" for f in native_check.PACKABLE}
    bits, pairs = lib.racer_vector_bits(), lib.racer_bf16_pairs()
    for name, (_, width) in native.VARIANTS.items():
        if width == bits and (name not in native.PAIRS or pairs):
            kinds = ("bfloat16",) if name in native.PAIRS else ("float32", "bfloat16", "float16")
            names |= {f"linear {name} {d}" for d in kinds}
    if lib.racer_panel_width():
        names |= {"panel bfloat16", "panel float16"}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        d = str(dtype).replace("torch.", "")
        names |= {f"attention {p} {d}" for p in native.attention_paths(dtype, 4, 2, 64, checked=False)}
    if lib.racer_quant_amx():
        names |= {f"amx quant {f} packed" for f in native_check.AMX_FORMATS}
    return names | {"top_rows"}


@needs_native
def test_every_kernel_the_library_offers_is_checked_and_agrees_here():
    checks = native.checks()
    seconds = checks.pop("seconds")
    assert set(checks) == _expected_kernels(native.library())
    assert [k for k, v in checks.items() if not v.ok] == []
    assert 0 < seconds
    assert native.reference_build() is not None
    assert native.reference_build().racer_quant_isa() == -1  # the reference is the C code, no vector unit


@needs_native
def test_a_refused_kernel_is_left_out_and_the_block_kernel_served_by_the_reference(monkeypatch):
    """Verdicts of refusal (as the check gives them) change what each entry point offers."""
    lib, ref = native.library(), native.reference_build()
    tile = next(n for n in native.VARIANTS if n not in native.PAIRS and native.usable(n))
    refused = ("quant Q4_1 packed", f"linear {tile} float32", "attention vector bfloat16", "top_rows")
    verdicts = {k: native_check.Verdict(k, False, "made to disagree") for k in refused}
    monkeypatch.setattr(native, "_checks", dict(native.checks(), **verdicts))

    assert native._quant_lib(3 + native.PACKED) is ref and native._quant_lib(3) is lib
    assert native.dtypes(tile) == (torch.bfloat16, torch.float16) and native.usable(tile)
    with pytest.raises(TypeError):  # the tuner skips it
        native.linear(tile)(torch.ones((1, 8)), torch.ones((4, 8)), None)
    assert not native.attention_usable(torch.bfloat16, torch.device("cpu"), 64)
    assert native.attention_usable(torch.float16, torch.device("cpu"), 64)
    assert native.top_rows(torch.randn((2, 50)), 3) is None
    with pytest.raises(TypeError, match="refused"):
        native.Decoder([], {}, None, {}, 1e-5, 1.0)

    # the block kernel still serves the format, from the reference build, with the library's bits
    gen = torch.Generator().manual_seed(3)
    n, k = native_check.QUANT_SHAPE
    w = native_check._blocks("Q4_1", n, k, gen)
    x = torch.randn((5, k), generator=gen)
    kind, packed = native.quant_pack(3, w, n, k)
    served = native.quant_linear(x, kind, packed, n, k)
    monkeypatch.setattr(native, "_checks", {})
    assert torch.equal(served, native.quant_linear(x, kind, packed, n, k))


@needs_native
def test_a_kernel_built_wrong_is_refused_at_start_up_and_the_fallback_serves_identical_tokens():
    """Negative control: a build whose packed block kernel sums with the wrong sign. The check
    refuses exactly those kernels; their calls (the native decoder's included) come from the
    reference build, so the bundled model's greedy tokens are the clean build's."""
    clean, broken = _probes((("--tokens", "12"), {}), (("--tokens", "12"), {"RACER_NATIVE_FAULT": "packed"}))
    refused = {k for k, (ok, _) in broken["checks"].items() if not ok}
    tiles = {f"amx quant {f} packed" for f in native_check.AMX_FORMATS} if broken["amx_here"] else set()
    assert refused == {f"quant {f} packed" for f in native_check.PACKABLE} | tiles  # a CPU with AMX: its tiles too
    assert all(ok for ok, _ in clean["checks"].values())
    for fmt in native_check.PACKABLE:  # the fault is real: the library's own kernel is wrong ...
        assert broken["outputs"][f"{fmt} packed, unchecked"] != clean["outputs"][f"{fmt} packed"]
    served = {k: v for k, v in broken["outputs"].items() if "unchecked" not in k}
    assert served == {k: v for k, v in clean["outputs"].items() if "unchecked" not in k}  # ... and not served
    assert broken["tokens"] == clean["tokens"] and len(clean["tokens"]) == 12
    assert clean["fused"] and broken["fused"]  # the native decoder ran both


def _levels() -> list[str]:
    return [level for level in native.ISA_LEVELS if level != "native"]


@needs_native
@pytest.mark.parametrize("level", _levels())
def test_each_isa_level_builds_checks_clean_and_gives_the_block_kernels_bits(level):
    """The library built as a CPU of a lower ISA level would build it (on this one): every kernel
    agrees with its reference, and the block kernel's outputs are bit for bit this build's."""
    levels = [((), {"RACER_NATIVE_ISA": other}) for other in _levels()]  # built side by side, once
    here, *theres = _probes(((), {}), *levels)
    there = theres[_levels().index(level)]
    assert there["level"] == level
    assert [k for k, (ok, _) in there["checks"].items() if not ok] == []
    assert there["outputs"] == here["outputs"]
    assert there["vector_bits"] <= here["vector_bits"]
    if level == "sse":
        assert (there["vector_bits"], there["quant_isa"]) == (256, "generic")
    if level in ("avx2", "no-vnni"):
        assert there["quant_isa"] in ("avx2", "generic")
    if level == "avx2":
        assert there["vector_bits"] == 256 and not any(k.startswith("attention amx") for k in there["checks"])


def test_an_unknown_isa_level_or_fault_is_refused_with_the_names(monkeypatch):
    monkeypatch.setenv("RACER_NATIVE_ISA", "avx9000")
    with pytest.raises(ValueError, match="native, no-vnni, avx2, sse"):
        native.build_flags()
    monkeypatch.setenv("RACER_NATIVE_ISA", "avx2")
    monkeypatch.setenv("RACER_NATIVE_FAULT", "packed,nonsense")
    with pytest.raises(ValueError, match="nonsense"):
        native.build_flags()
    monkeypatch.setenv("RACER_NATIVE_FAULT", "packed")
    flags = native.build_flags()
    assert "-mno-avx512f" in flags and "-DRACER_FAULT_PACKED" in flags


def test_the_bound_catches_a_wrong_sign_and_passes_rounding():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn((3, 83), generator=gen), torch.randn((37, 83), generator=gen)
    y = x @ w.T
    assert native_check._beyond_bound(y, x.double(), w.double()) is None
    y[1, 5] = -y[1, 5]
    assert "1 of 111 outputs off" in native_check._beyond_bound(y, x.double(), w.double())


@needs_native
def test_the_amx_int8_tiles_give_the_block_kernels_bits_and_a_wrong_tile_path_is_refused_alone():
    """The block kernel's AMX-INT8 path (pairs of groups on tiles), built with the tile instructions
    emulated where the CPU has none (``RACER_NATIVE_EMULATE=amx-int8``; the real instructions where it
    has them): checked at start-up against the reference, and with every call of 2 rows or more on
    tiles, the block kernel's outputs are bit for bit the vector build's. Negative control: a sign
    fault in the tile path alone (``RACER_NATIVE_FAULT=amx``) is refused, only it, and the tiles are
    then never used: the served outputs stay the clean ones."""
    from tests.support.native_probe import quant_outputs

    here = {"outputs": quant_outputs()}  # this process's build, its tiles (where it has them) unused
    tiles = {f"amx quant {f} packed" for f in native_check.AMX_FORMATS}
    emulated = {"RACER_NATIVE_EMULATE": "amx-int8"}
    faulty = {**emulated, "RACER_NATIVE_FAULT": "amx"}
    there, broken = _probes((("--amx-rows", "2"), emulated), (("--amx-rows", "2"), faulty))
    assert there["amx"] is True and there["amx_here"]
    assert tiles <= set(there["checks"]) and all(there["checks"][k][0] for k in tiles)
    assert [k for k, (ok, _) in there["checks"].items() if not ok] == []
    assert there["outputs"] == here["outputs"]  # 19 rows: a pass of 15 and one of 4, on tiles

    assert {k for k, (ok, _) in broken["checks"].items() if not ok} == tiles
    assert broken["amx"] is False
    for fmt in native_check.AMX_FORMATS:  # the fault is real on the tiles ...
        assert broken["outputs"][f"{fmt} packed, unchecked"] != here["outputs"][f"{fmt} packed"]
    served = {k: v for k, v in broken["outputs"].items() if "unchecked" not in k}
    assert served == {k: v for k, v in here["outputs"].items() if "unchecked" not in k}  # ... and not served
    for fmt in ("Q4_K", "Q5_K", "Q6_K"):  # the K-quants never take the tiles
        assert broken["outputs"][f"{fmt} packed, unchecked"] == here["outputs"][f"{fmt} packed"]
